"""`hami-usage demo`: the whole pipeline on one machine, with no broker and no GPU.

simulator -> cache files -> collector -> local log (or Kafka) -> aggregator -> billing CSV,
then a per-container table, the anomalies seen, and the bill per namespace and pod at the demo
prices (`DEMO_PRICES`) with its HTML report (`report.html`, `report` extra).
"""

from __future__ import annotations

import asyncio
import csv
import shutil
import sys
import tempfile
import time
import uuid as uuidlib
from dataclasses import dataclass, field
from pathlib import Path

from .aggregate.service import AggregateSettings, run_kafka, run_local
from .aggregate.windows import WindowSettings
from .events import LayoutAnomaly, decode
from .layout.declarations import V12
from .node.service import Collector, CollectSettings
from .simulate import GroundTruth, NodeSimulator, SimDevice, new_cache_file
from .transport.kafka import ProducerSettings
from .transport.locallog import LogReader
from .transport.security import KafkaSecurity

GiB = float(1 << 30)
NODE = "demo-node"
# The longest the demo waits, after its pods ended, for the collector to report and send that.
_SETTLE_S = 60.0
# Without Kubernetes the demo's pods have no namespace: the bill shows them "(unnamed)".
DEMO_PRICES = """
currency = "USD"
default = 2.00
"""


@dataclass(frozen=True)
class DemoSettings:
    duration_s: float = 20.0
    out: Path = Path("hami-usage-demo")
    kafka: str | None = None
    security: KafkaSecurity = field(default_factory=KafkaSecurity)
    containers: int = 6
    interval_s: float = 0.25
    step_s: float = 1.0
    heartbeat_s: float = 2.0
    window_s: float = 5.0
    seed: int = 7


@dataclass
class DemoResult:
    csv_path: Path
    rows: list[dict[str, str]]
    anomalies: list[tuple[str, str, str]]  # (kind, path, detail)
    truth: GroundTruth
    interval_ms: int
    damage: str = "damage: none"  # the aggregator's damage summary line
    bill: str = ""  # the priced bill as a text table, or why there is none


def _hostile_file(root: Path) -> None:
    """A file a tenant scribbled on: impossible proc_num, a UUID that is not one."""
    writer = new_cache_file(
        root, str(uuidlib.UUID(int=1)), "hostile", V12, [SimDevice("GPU-0000", limit_bytes=1 << 30)]
    )
    writer.region.proc_num = 7777
    writer.region.uuids[0].value = b"\xff\xfe not a uuid"
    writer.close()


class _Progress:
    """One rewritten line on a terminal; a plain line every few seconds otherwise (logs)."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self._last = 0.0

    def __call__(self, msg: str, *, final: bool = False) -> None:
        if self.tty:
            sys.stderr.write(f"\r{msg:<78}" + ("\n" if final else ""))
        elif final or time.monotonic() - self._last >= 5:
            self._last = time.monotonic()
            sys.stderr.write(msg + "\n")
        sys.stderr.flush()


async def _collect_and_simulate(
    s: DemoSettings, root: Path, log_dir: Path, topic: str | None
) -> GroundTruth:
    kafka = (
        ProducerSettings(s.kafka, topic=topic, security=s.security) if s.kafka and topic else None
    )
    collector = Collector(
        CollectSettings(
            root=root,
            node=NODE,
            log_dir=log_dir,
            kafka=kafka,
            interval_s=s.interval_s,
            heartbeat_s=s.heartbeat_s,
            nvml=False,  # simulated files: the real GPUs' processes would all be unaccounted
        )
    )
    task = asyncio.create_task(collector.run())
    sim = NodeSimulator(root, s.containers, "mixed", seed=s.seed)
    _hostile_file(root)
    truth = GroundTruth()
    progress = _Progress()
    start = time.monotonic()
    try:
        while (elapsed := time.monotonic() - start) < s.duration_s:
            sim.step(time.time())
            truth.observe(int(time.time() * 1000), sim.containers)
            progress(
                f"demo: {elapsed:4.1f}/{s.duration_s:.0f} s, {collector.status.appended} "
                f"events, {len(sim.containers)} containers"
            )
            await asyncio.sleep(s.step_s)
        # The pods end: their folders go, and the collector reports them gone.
        sim.close()
        for c in sim.containers:
            shutil.rmtree(root / f"{c.pod_uid}_{c.name}")
        truth.observe(int(time.time() * 1000), [])
        await _settled(collector, {c.pod_uid for c in sim.containers}, s.interval_s)
    finally:
        collector.stopping.set()
        await task
    progress(f"demo: collected {collector.status.appended} events; aggregating", final=True)
    return truth


async def _settled(collector: Collector, ended: set[str], interval_s: float) -> None:
    """Wait until the collector has reported the ended pods gone (at its next scan, later on a
    loaded machine) and, through Kafka, sent what it spooled: stopped earlier, it would leave
    the pods billed on, or their last events unsent. Bounded: a demo always ends."""
    deadline = time.monotonic() + _SETTLE_S
    while time.monotonic() < deadline and (
        any(state.pod_uid in ended for state, _ in collector.scanner.published)
        or collector.spool_depth()
    ):
        await asyncio.sleep(interval_s)


def _anomalies(log_dir: Path) -> list[tuple[str, str, str]]:
    seen: dict[tuple[str, str], str] = {}
    reader = LogReader(log_dir)
    offset = reader.offset_for_time(0)
    while batch := reader.read(offset, 5000):
        offset = batch[-1].offset + 1
        for r in batch:
            e = decode(r.value)
            if isinstance(e, LayoutAnomaly):
                seen.setdefault((e.anomaly, e.path), e.detail)
    return [(k, p, d) for (k, p), d in sorted(seen.items())]


# What the demo leaves in its folder: the billing records, the bill and its HTML report.
BILLING_CSV, BILL_CSV, REPORT_HTML = OUTPUTS = ("billing.csv", "bill.csv", "report.html")


async def run_demo(s: DemoSettings) -> DemoResult:
    s.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="hami-usage-demo-"))
    root, log_dir = work / "containers", work / "events"
    root.mkdir()
    csv_path = s.out / BILLING_CSV
    csv_path.unlink(missing_ok=True)
    suffix = f"demo-{uuidlib.uuid4().hex[:8]}"
    topic = f"hami.usage.{suffix}" if s.kafka else None
    billing_topic = f"hami.billing.{suffix}"
    if s.kafka:
        await _create_topics(s.kafka, s.security, topic or "", billing_topic)
    truth = await _collect_and_simulate(s, root, log_dir, topic)
    window = WindowSettings(
        window_ms=round(s.window_s * 1000),
        lateness_ms=1000,
        max_gap_ms=round(3 * s.heartbeat_s * 1000),
        max_skew_ms=300_000,
    )
    agg = AggregateSettings(
        window=window,
        kafka=s.kafka,
        topic=topic or "",
        billing_topic=billing_topic,
        group=f"hami-usage-{suffix}",
        log_dir=log_dir,
        csv=str(csv_path),
        drain=True,
        security=s.security,
    )
    stopping = asyncio.Event()
    if s.kafka:
        await run_kafka(agg, stopping)
    else:
        await run_local(agg, stopping)
    with csv_path.open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    anomalies = _anomalies(log_dir)
    damage = agg.stats.damage.line()
    shutil.rmtree(work, ignore_errors=True)
    bill = _bill(csv_path, rows, s.out)
    return DemoResult(csv_path, rows, anomalies, truth, round(s.interval_s * 1000), damage, bill)


def _bill(csv_path: Path, rows: list[dict[str, str]], out: Path) -> str:
    """The bill of every window in the CSV, and report.html / bill.csv beside it."""
    try:
        from .report.bill import to_csv
        from .report.command import ReportArgs, make_report, table_text
        from .report.html import render
        from .report.prices import Prices
    except ImportError as exc:  # pragma: no cover - the report extra is not installed
        return f"bill: needs the report extra ({exc})\n"
    if not rows:
        return "bill: no records\n"
    from .aggregate.records import iso_ms

    first = min(iso_ms(r["window_start"]) for r in rows)
    last = max(iso_ms(r["window_end"]) for r in rows)
    args = ReportArgs(first, last, ["namespace", "pod"], Prices.parse(DEMO_PRICES), [csv_path], [])
    bill, summary = make_report(args)
    (out / BILL_CSV).write_text(to_csv(bill))
    (out / REPORT_HTML).write_text(render(bill, summary, "hami-usage demo: GPU chargeback"))
    return table_text(bill) + f"HTML report: {out / REPORT_HTML}\n"


async def _create_topics(bootstrap: str, security: KafkaSecurity, usage: str, billing: str) -> None:
    """The demo's own two topics, sized for one broker (brokers should not auto-create)."""
    from .transport.kafka import wait_for_broker
    from .transport.topics import TopicPlan, admin_client, create_missing

    await wait_for_broker(bootstrap, 30.0, security)
    plan = TopicPlan(usage, billing, 1, 1, 1, 1, usage_retention_days=1)
    admin = admin_client(bootstrap, security)
    await admin.start()
    try:
        await create_missing(admin, plan.specs())
    finally:
        await admin.close()


def format_report(result: DemoResult) -> str:
    per: dict[tuple[str, str], dict[str, float]] = {}
    per_device: dict[tuple[tuple[str, str], str], list[float]] = {}
    for row in result.rows:
        if row.get("kind", "container") != "container":
            continue  # node rows and a GPU's own records: in the bill below
        key = (row["pod_uid"][:8] + "…", row["container"])
        acc = per.setdefault(key, {"gib_h": 0.0, "sm_h": 0.0, "peak": 0.0})
        acc["gib_h"] += float(row["memory_byte_seconds"]) / GiB / 3600
        acc["sm_h"] += float(row["sm_percent_seconds"]) / 100 / 3600
        acc["peak"] = max(acc["peak"], float(row["peak_memory_bytes"]) / GiB)
        limits = per_device.setdefault((key, row["device_uuid"]), [0.0, 0.0])
        limits[0] += float(row["memory_limit_byte_seconds"])
        limits[1] += float(row["observed_seconds"])
    lines = [
        f"{'pod':<10} {'container':<10} {'GiB·h':>10} {'SM-hours':>10} {'peak GiB':>9} "
        f"{'limit GiB':>9}",
    ]
    for (pod, ctr), a in sorted(per.items(), key=lambda kv: kv[0][1]):
        # The limit over the container's devices, each averaged over the time it was observed.
        limit = sum(bs / obs for (k, _), (bs, obs) in per_device.items() if k == (pod, ctr) and obs)
        limit /= GiB
        lines.append(
            f"{pod:<10} {ctr:<10} {a['gib_h']:>10.6f} {a['sm_h']:>10.6f} "
            f"{a['peak']:>9.3f} {limit:>9.2f}"
        )
    lines += ["", f"{len(result.rows)} billing records in {result.csv_path}", result.damage]
    lines += ["", "anomalies:"]
    lines += [
        f"  {kind:<24} {Path(path).parent.name[:28]}/…  {detail}"
        for kind, path, detail in result.anomalies
    ] or ["  none"]
    lines += ["", "bill (per namespace and pod, USD 2.00 per GPU-hour):", result.bill.rstrip()]
    return "\n".join(lines) + "\n"
