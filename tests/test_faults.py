"""Fault injection against the simulator's ground truth: never a silent difference.

The pipeline runs as in production - the simulator writes cache files the way HAMi-core does,
real collectors scan them into a real local log (or the real broker), `hami-usage aggregate
--drain` bills - while a fault is injected: the disk fills and frees, the log is damaged, two
collectors send under one node name, the real HAMi-core writer's failure modes (`simulate
--faults`). Every run ends one of two ways: exit 0 with a bill equal
to the ground truth within the time between two scans per change, or a non-zero exit whose summary
line names the damage. Two aggregator replicas killed in turn: tests/test_file_replicas.py.
"""

from __future__ import annotations

import asyncio
import csv
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from fulldisk import full_disk
from streams import create_topic, hami

from collector.aggregate.damage import EXIT_DAMAGED
from collector.node.service import Collector, CollectSettings
from collector.simulate import GroundTruth, NodeSimulator
from collector.simulate_faults import FAULTS, FaultyNode
from collector.transport.kafka import ProducerSettings
from collector.transport.locallog import LocalLog, LogReader

INTERVAL_S = 0.1
STEP_S = 0.25
WINDOW = ["--window", "5", "--lateness", "1", "--max-gap", "3"]
_DAMAGE = re.compile(
    r"damage: corrupt_frames=(\d+) missing_records=(\d+) missing_segments=(\d+) "
    r"torn_tail_bytes=(\d+) seq_gaps=(\d+) seq_missing=(\d+)"
)
KINDS = "corrupt_frames missing_records missing_segments torn_tail_bytes seq_gaps seq_missing"


def settings(
    root: Path, log: Path, node: str = "n1", kafka: tuple[str, str] | None = None
) -> CollectSettings:
    return CollectSettings(
        root=root,
        node=node,
        log_dir=log,
        kafka=ProducerSettings(kafka[0], topic=kafka[1]) if kafka else None,
        interval_s=INTERVAL_S,
        heartbeat_s=1.0,
        nvml=False,
    )


class Run(NamedTuple):
    truth: GroundTruth
    # The longest a change can wait for a scan: the largest gap between one collector's
    # scans (from the start of the run). INTERVAL_S apart when the machine keeps up; longer on
    # a loaded one, where scans are late.
    scan_gap_s: float


def time_scans(c: Collector, start: float) -> list[float]:
    """The wall-clock times `c` starts its scans (the time its events carry), from `start`."""
    times = [start]
    scan = c.scanner.scan

    def timed(*args: Any, **kwargs: Any) -> Any:
        times.append(time.time())
        return scan(*args, **kwargs)

    c.scanner.scan = timed  # type: ignore[method-assign]
    return times


async def until(cond: Any, what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(INTERVAL_S)


async def run_pipeline(
    root: Path,
    collectors: list[tuple[float, Collector]],
    seconds: float,
    faults: dict[float, object] | None = None,
    writer_faults: frozenset[str] = frozenset(),
) -> Run:
    """Step the simulator for `seconds` (with the real writer's `writer_faults`), starting each
    collector at its offset and firing each fault (a callable) at its offset; then the pods
    end, and the collectors stop once each has seen that and sent what it had to Kafka."""
    sim: NodeSimulator = (
        FaultyNode(root, 4, "v1.2", faults=writer_faults, seed=13)
        if writer_faults
        else NodeSimulator(root, 4, "mixed", seed=13)
    )
    truth = GroundTruth()
    tasks: list[asyncio.Task[None]] = []
    scans: list[list[float]] = []
    pending = sorted((faults or {}).items(), key=lambda kv: kv[0])
    start = time.monotonic()
    wall_start = time.time()
    try:
        while (elapsed := time.monotonic() - start) < seconds:
            for at, c in collectors:
                if at <= elapsed and len(tasks) < len(collectors) and c not in started(tasks):
                    scans.append(time_scans(c, wall_start if at == 0 else time.time()))
                    task = asyncio.create_task(c.run())
                    task.collector = c  # type: ignore[attr-defined]
                    tasks.append(task)
            while pending and pending[0][0] <= elapsed:
                pending.pop(0)[1]()  # type: ignore[operator]
            sim.step(time.time())
            truth.observe(int(time.time() * 1000), sim.containers)
            await asyncio.sleep(STEP_S)
        sim.close()
        for c in sim.containers:
            shutil.rmtree(root / f"{c.pod_uid}_{c.name}")
        truth.observe(int(time.time() * 1000), [])
        # Stopped before a scan has seen the pods go, a collector's last state would be billed
        # on; stopped with records still spooled (a producer is slow to start on a loaded
        # machine), the bill would lack them. Neither is what these tests are about.
        running = started(tasks)
        await until(lambda: all(not c.scanner.published for c in running), "the pods to go")
        await until(
            lambda: all(c.forwarder.depth() == 0 for c in running if c.forwarder is not None),
            "the spools to reach Kafka",
        )
    finally:
        for _, c in collectors:
            c.stopping.set()
        await asyncio.gather(*tasks)
    gaps = [b - a for times in scans for a, b in zip(times, times[1:], strict=False)]
    return Run(truth, max(gaps, default=INTERVAL_S))


def started(tasks: list[asyncio.Task[None]]) -> list[Collector]:
    return [t.collector for t in tasks]  # type: ignore[attr-defined]


def billed(csv_path: Path) -> dict[tuple[str, str, str], float]:
    out: dict[tuple[str, str, str], float] = {}
    with csv_path.open(newline="") as fh:
        for row in csv.DictReader(fh):
            if row["container"]:
                key = (row["pod_uid"], row["container"], row["device_uuid"])
                out[key] = out.get(key, 0.0) + float(row["memory_byte_seconds"])
    return out


def exact(run: Run, bill: dict[tuple[str, str, str], float]) -> list[str]:
    """The keys whose bill differs from the truth by more than the time between two scans per
    change: a change is billed from the first scan after it (within scan_gap_s)."""
    truth, wrong = run.truth, []
    for key, byte_ms in truth.byte_ms.items():
        tolerance = truth.abs_delta.get(key, 0) * run.scan_gap_s
        if abs(bill.get(key, 0.0) - byte_ms / 1000) > tolerance:
            wrong.append(f"{key}: billed {bill.get(key, 0.0):.0f}, truth {byte_ms / 1000:.0f}")
    return wrong


def damage_of(stderr: str) -> dict[str, int]:
    m = _DAMAGE.search(stderr)
    assert m, stderr[-3000:]
    return dict(zip(KINDS.split(), map(int, m.groups()), strict=True))


def exact_or_named(rc: int, stderr: str, run: Run, csv_path: Path) -> dict[str, int]:
    """The rule of this suite; returns the damage counters (all 0 for an exact bill)."""
    assert "Traceback" not in stderr, stderr[-3000:]
    found = damage_of(stderr) if rc else {k: 0 for k in KINDS.split()}
    if rc == 0:
        assert "damage: none" in stderr
        assert exact(run, billed(csv_path)) == []
    else:
        assert rc == EXIT_DAMAGED, stderr[-3000:]
        assert any(found.values()), stderr[-3000:]
        assert "input damaged" in stderr
    return found


def aggregate_log(log: Path, csv_path: Path) -> tuple[int, str]:
    proc = hami("aggregate", "--log", log, *WINDOW, "--csv", csv_path, "--drain")
    return proc.returncode, proc.stderr


def test_disk_fills_and_frees(tmp_path: Path) -> None:
    root = tmp_path / "containers"
    root.mkdir()
    with full_disk(tmp_path / "disk") as disk:
        log = disk.directory / "events"
        if disk.kind != "tmpfs":
            # A file-size limit would stop this process's simulator too; test_disk_full.py
            # covers that kind of full disk with the collector in its own process.
            pytest.skip("an in-process collector needs a mountable tmpfs as its full disk")
        collector = Collector(settings(root, log))
        try:
            run = asyncio.run(
                run_pipeline(root, [(0.0, collector)], 7.0, {2.0: disk.fill, 4.5: disk.free})
            )
        finally:
            disk.free()
        dropped = collector.status.dropped
        assert dropped > 0 and collector.log.stats.blocked_episodes >= 1
        shutil.copytree(log, tmp_path / "events")
    rc, err = aggregate_log(tmp_path / "events", tmp_path / "bill.csv")
    found = exact_or_named(rc, err, run, tmp_path / "bill.csv")
    # The damage is named for what it is: the events the collector could not store.
    assert found["seq_missing"] == dropped
    assert f"(collectors reported {dropped} dropped)" in err
    assert found["corrupt_frames"] == found["missing_records"] == 0


def _collected(tmp_path: Path) -> tuple[Path, Run]:
    root = tmp_path / "containers"
    root.mkdir()
    log = tmp_path / "events"
    collector = Collector(settings(root, log))
    collector.log.close()  # small segments, so that there are middle ones to damage
    collector.log = LocalLog(log, segment_bytes=4096)
    run = asyncio.run(run_pipeline(root, [(0.0, collector)], 6.0))
    return log, run


def _damage(log: Path, how: str) -> None:
    bases = sorted(log.glob("*.log"))
    assert len(bases) >= 4
    if how == "cut_newest_half":
        data = bases[-1].read_bytes()
        bases[-1].write_bytes(data[: len(data) // 2])
        if LogReader(log).torn_tail() == 0:
            bases[-1].write_bytes(data[: len(data) // 2 - 1])
    elif how == "flip_bytes":
        data = bytearray(bases[-2].read_bytes())
        for at in range(100, len(data), 3001):
            data[at] ^= 0x3C
        bases[-2].write_bytes(bytes(data))
    elif how == "delete_middle":
        bases[len(bases) // 2].unlink()
    elif how == "huge_length":
        data = bytearray(bases[len(bases) // 2].read_bytes())
        data[0:4] = (0x7FFFFFFF).to_bytes(4, "little")
        bases[len(bases) // 2].write_bytes(bytes(data))


def test_damaged_log_against_the_ground_truth(tmp_path: Path) -> None:
    log, run = _collected(tmp_path)
    rc, err = aggregate_log(log, tmp_path / "intact.csv")
    assert rc == 0, err[-3000:]
    exact_or_named(rc, err, run, tmp_path / "intact.csv")
    for how in ("cut_newest_half", "flip_bytes", "delete_middle", "huge_length"):
        copy = tmp_path / how
        shutil.copytree(log, copy, ignore=shutil.ignore_patterns("consumers"))
        _damage(copy, how)
        rc, err = aggregate_log(copy, tmp_path / f"{how}.csv")
        found = exact_or_named(rc, err, run, tmp_path / f"{how}.csv")
        assert rc == EXIT_DAMAGED, (how, err[-2000:])
        assert any(found.values()), how


def test_the_real_writers_failure_modes(tmp_path: Path) -> None:
    root = tmp_path / "containers"
    root.mkdir()
    collector = Collector(settings(root, tmp_path / "events"))
    run = asyncio.run(run_pipeline(root, [(0.0, collector)], 8.0, writer_faults=frozenset(FAULTS)))
    rc, err = aggregate_log(tmp_path / "events", tmp_path / "bill.csv")
    exact_or_named(rc, err, run, tmp_path / "bill.csv")


@pytest.mark.kafka
def test_two_collectors_under_one_node_name_are_billed_once(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    asyncio.run(create_topic(kafka_bootstrap, kafka_topic, 2))
    root = tmp_path / "containers"
    root.mkdir()
    kafka = (kafka_bootstrap, kafka_topic)
    first = Collector(settings(root, tmp_path / "spool-1", "n1", kafka))
    second = Collector(settings(root, tmp_path / "spool-2", "n1", kafka))
    run = asyncio.run(run_pipeline(root, [(0.0, first), (2.0, second)], 7.0))
    proc = hami(
        "aggregate", "--kafka", kafka_bootstrap, "--topic", kafka_topic,
        "--billing-topic", f"{kafka_topic}.billing", "--group", f"{kafka_topic}.g",
        "--instance", uuid.uuid4().hex[:8], *WINDOW, "--csv", tmp_path / "bill.csv", "--drain",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    exact_or_named(proc.returncode, proc.stderr, run, tmp_path / "bill.csv")
    assert "node_conflicts=1" in proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if "two collectors send" in ln]
    assert f"incarnation {first.scanner.inc}" in line
    assert f"billing only the newest, {second.scanner.inc}" in line
    assert str(tmp_path / "spool-1") in line and str(tmp_path / "spool-2") in line
