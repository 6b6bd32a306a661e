"""End to end from the real broker: our consumption path next to the same job on Quix Streams.

    .venv/bin/python bench/bench_e2e.py [--rows 400000] [--quix-python /tmp/quixvenv/bin/python]
                                        [--bootstrap HOST:PORT] [--repeat 3]

Quix Streams lives only in its own virtual environment, never in the project's:

    python3 -m venv /tmp/quixvenv && /tmp/quixvenv/bin/pip install quixstreams msgspec

What is measured, on one topic produced here first (3 partitions, key = node, gzip like the
collector, record timestamp = event time): `--rows` usage rows in `UsageSample` events (every
container samples every process on every device once a second) plus a heartbeat per node every
30 s restating its containers.

* ours: the aggregator's consumption path as in `collector/aggregate/service.py` (allocation and
  identity on, as there): aiokafka consumer in a group (read_committed, batches of up to 5000),
  msgspec decode, one `Aggregator` per partition, `add` per event, `advance` after every batch
  with its records written to a CSV sink (fsync'd, as before a commit), and at the end of the
  input `flush()` like `--drain`, so every row is applied, integrated and closed in the timed
  part (without it the records of the last max_skew of event time would stay pending).
* fetch only: the same consumer in a group of its own, every batch dropped. No job on this
  consumer can be faster: its ratio to Quix is the ceiling of ours.
* quix: a Quix Streams application (run as a subprocess of `--quix-python`) on the same topic:
  the same msgspec decode of the same event schema, a stateful step per node that integrates
  every row key exactly like ours (previous total x time to this sample, capped at max_gap)
  with its state in Quix's state store, then `tumbling_window(60 s).sum().final()` per node.

Both clocks run from the first record handed to the job to the last one processed (start-up
and the group join are not counted). Rates are usage samples (rows of UsageSample events) per
second; heartbeat rows are processed by both but not counted. The runs alternate (ours, quix,
ours, ...) so both see the same load; the ratio is of the medians, and the load average is
printed with every round. Goal: ours >= 10 x quix.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from collector.aggregate.intake import InputStats, add_kafka_records  # noqa: E402
from collector.aggregate.records import record_order  # noqa: E402
from collector.aggregate.windows import Aggregator, WindowSettings  # noqa: E402
from collector.events import (  # noqa: E402
    SCHEMA_VERSION,
    ContainerAppeared,
    ContainerState,
    DeviceLimit,
    Event,
    Heartbeat,
    UsageRow,
    UsageSample,
    encode,
)

GOAL_RATIO = 10.0
MIB = 1 << 20
MINUTE_MS = 60_000
SETTINGS = WindowSettings()  # 60 s windows, 10 s lateness, 90 s max gap


@dataclass(frozen=True)
class Shape:
    nodes: int = 4
    containers: int = 25  # per node
    procs: int = 4
    devices: int = 2

    @property
    def rows_per_second(self) -> int:
        return self.nodes * self.containers * self.procs * self.devices


def build(shape: Shape, rows: int, t0: int) -> tuple[list[tuple[str, Event]], int, int]:
    """(node, event) in event-time order; returns them, the usage rows and heartbeat rows."""
    seconds = -(-rows // shape.rows_per_second)
    out: list[tuple[str, Event]] = []
    seqs = [0] * shape.nodes
    usage_rows = heartbeat_rows = 0

    def stamp(n: int) -> tuple[int, int, int]:
        seqs[n] += 1
        return SCHEMA_VERSION, 7000 + n, seqs[n] - 1

    limits = [DeviceLimit(d, f"GPU-{d:04d}-bench", 16 * 1024 * MIB, 50) for d in range(2)]
    devices = limits[: shape.devices]

    def rows_of(n: int, c: int, s: int) -> list[UsageRow]:
        return [
            UsageRow(p, 20_000 + p, d, (256 + (s + p + c + n) % 7) * MIB, MIB, 0, 0, MIB, s % 100)
            for p in range(shape.procs)
            for d in range(shape.devices)
        ]

    for n in range(shape.nodes):
        for c in range(shape.containers):
            pod = f"pod-{n:02d}-{c:03d}"
            e = ContainerAppeared(*stamp(n), t0, c, pod, "main", f"/c/{pod}", "v1.2", devices)
            out.append((f"node-{n}", e))
    for s in range(seconds):
        ts = t0 + s * 1000
        for n in range(shape.nodes):
            for c in range(shape.containers):
                batch = rows_of(n, c, s)
                out.append((f"node-{n}", UsageSample(*stamp(n), ts, c, batch)))
                usage_rows += len(batch)
            if s % 30 == 0:
                states = [
                    ContainerState(c, f"pod-{n:02d}-{c:03d}", "main", "v1.2", devices, rows)
                    for c in range(shape.containers)
                    for rows in [rows_of(n, c, s)]
                ]
                out.append((f"node-{n}", Heartbeat(*stamp(n), ts, 30_000, 0, 1, states)))
                heartbeat_rows += sum(len(st.rows) for st in states)
    return out, usage_rows, heartbeat_rows


def start_broker(**env: str) -> str:
    """Start the test broker of scripts/kafka.sh if needed (settings in `env`); what it prints."""
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "kafka.sh"), "start"],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
        env={**os.environ, **env},
    )
    return proc.stdout


def bootstrap_address() -> str:
    """The plaintext test broker's address, started if needed."""
    return start_broker().strip()


async def produce(
    bootstrap: str,
    topic: str,
    events: list[tuple[str, Event]],
    partitions: int = 3,
    partition_of: dict[str, int] | None = None,
    **client: object,
) -> None:
    """`client`: extra aiokafka arguments (security, collector/transport/security.py);
    `partition_of`: node -> partition (default: by key hash, as the collector does)."""
    from aiokafka import AIOKafkaProducer
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **client)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, partitions, 1)])
    finally:
        await admin.close()
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        enable_idempotence=True,
        linger_ms=50,
        compression_type="gzip",
        max_batch_size=256 * 1024,
        **client,
    )
    await producer.start()
    try:
        futures = [
            await producer.send(
                topic,
                encode(e),
                key=node.encode(),
                timestamp_ms=e.ts,
                partition=None if partition_of is None else partition_of[node],
            )
            for node, e in events
        ]
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


@dataclass
class Result:
    messages: int
    rows: int
    seconds: float
    records: int = 0
    cpu: float = 0.0  # CPU seconds of the job's process (all its threads) over the same span

    @property
    def cpu_rate(self) -> float:
        return self.rows / self.cpu

    @property
    def rate(self) -> float:
        return self.rows / self.seconds


async def drive(
    consumer: Any, done: Callable[[dict[int, int]], bool], out_dir: str
) -> tuple[int, float, float, int, float]:
    """The service's consumption path (collector/aggregate/service.py) on a started consumer:
    decode, an `Aggregator` per partition, `advance` after every batch into a CSV sink, and
    `flush()` like `--drain` once `done(next offset per partition)`. Returns (messages, clock
    at the first record, clock at the end, records written, CPU seconds in between); the clock
    is `time.monotonic`."""
    from collector.aggregate.service import Outputs

    aggs: dict[int, Aggregator] = {}
    next_offsets: dict[int, int] = {}
    stats = InputStats()
    seen = 0
    started: float | None = None
    outputs = Outputs.open(str(Path(out_dir) / "records.csv"), None, None, None)
    try:
        while True:
            batch = await consumer.getmany(timeout_ms=500, max_records=5000)
            if batch and started is None:
                started = time.monotonic()
                cpu0 = time.process_time()
            for tp, msgs in batch.items():
                agg = aggs.get(tp.partition)
                if agg is None:
                    agg = aggs[tp.partition] = Aggregator(SETTINGS)
                add_kafka_records(agg, stats, tp.partition, msgs)
                seen += len(msgs)
                next_offsets[tp.partition] = msgs[-1].offset + 1
            finished = done(next_offsets)
            records = sorted(
                (r for a in aggs.values() for r in (a.flush() if finished else a.advance())),
                key=record_order,
            )
            if records or finished:
                outputs.write(records)
            if finished:
                break
        ended = time.monotonic()
        cpu = time.process_time() - cpu0
    finally:
        outputs.close()
    assert not (stats.undecodable or stats.unknown_schema), stats
    return seen, started or ended, ended, outputs.written, cpu


async def subscribe(bootstrap: str, topic: str, group: str, **client: object) -> Any:
    """A started consumer of `topic` in `group`, configured like the service's."""
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=group,
        enable_auto_commit=False,
        isolation_level="read_committed",
        auto_offset_reset="earliest",
        **client,
    )
    consumer.subscribe([topic])
    await consumer.start()
    return consumer


async def ours(
    bootstrap: str,
    topic: str,
    messages: int,
    usage_rows: int,
    group: str = "bench-ours",
    **client: object,
) -> Result:
    """`drive` on a consumer of the whole topic, to its `messages`-th message."""
    consumer = await subscribe(bootstrap, topic, f"{group}-{uuid.uuid4().hex[:8]}", **client)
    try:
        with tempfile.TemporaryDirectory(prefix="bench-e2e-") as out_dir:
            seen, started, ended, written, cpu = await drive(
                consumer, lambda nxt: sum(nxt.values()) >= messages, out_dir
            )
    finally:
        await consumer.stop()
    return Result(seen, usage_rows, ended - started, written, cpu)


async def fetch_only(
    bootstrap: str, topic: str, messages: int, usage_rows: int, **client: object
) -> Result:
    """The consumer of `ours` alone: its `getmany` batches to the `messages`-th message, and
    nothing done with them. Its rate bounds what any job on this consumer can reach.

    The clock starts when the first batch is handed over, as in `ours`; here nothing is done
    with that batch, so it is not counted either: the rate is of the batches after it (their
    share of the messages times the usage rows)."""
    consumer = await subscribe(bootstrap, topic, f"bench-fetch-{uuid.uuid4().hex[:8]}", **client)
    try:
        seen = first = 0
        started = cpu0 = 0.0
        while seen < messages:
            batch = await consumer.getmany(timeout_ms=500, max_records=5000)
            got = sum(len(msgs) for msgs in batch.values())
            if got and not first:
                first = got
                started = time.monotonic()
                cpu0 = time.process_time()
            seen += got
        ended = time.monotonic()
        cpu = time.process_time() - cpu0
    finally:
        await consumer.stop()
    if seen == first:
        raise SystemExit("bench_e2e: the topic came in one batch: nothing to time (more --rows)")
    return Result(seen - first, usage_rows * (seen - first) // seen, ended - started, 0, cpu)


# The Quix Streams job. argv: repo, bootstrap, topic, messages, state dir.
QUIX_APP = r'''
import json, sys, time
sys.path.insert(0, sys.argv[1])
from collector.events import Heartbeat, UsageSample, decode
from quixstreams import Application

bootstrap, topic_name, messages, state_dir = sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
MAX_GAP_MS = 90_000
app = Application(
    broker_address=bootstrap,
    consumer_group="bench-quix-" + str(time.time_ns()),
    auto_offset_reset="earliest",
    state_dir=state_dir,
    loglevel="WARNING",
)
topic = app.topic(topic_name, key_deserializer="str", value_deserializer="bytes")
progress = {"seen": 0, "rows": 0, "first": None, "last": None, "windows": 0, "total": 0,
            "cpu0": 0.0, "cpu": 0.0}


def integrate(value, state):
    """Like the Aggregator: each row key's previous total holds until this sample (capped at
    max_gap); returns the byte-milliseconds this message closes, per node (message key)."""
    if progress["first"] is None:
        progress["first"] = time.perf_counter()
        progress["cpu0"] = time.process_time()
    event = decode(value)
    progress["seen"] += 1
    if isinstance(event, UsageSample):
        groups = [(event.cid, event.rows)]
        progress["rows"] += len(event.rows)
    elif isinstance(event, Heartbeat):
        groups = [(c.cid, c.rows) for c in event.containers]
    else:
        groups = []
    ts = event.ts
    integral = 0
    for cid, rows in groups:
        k = f"{event.inc}:{cid}"
        last = state.get(k, {})
        for r in rows:
            rk = f"{r.pid}:{r.hostpid}:{r.device}"
            prev = last.get(rk)
            if prev is not None and ts > prev[0]:
                integral += prev[1] * min(ts - prev[0], MAX_GAP_MS)
            last[rk] = [ts, r.total]
        state.set(k, last)
    progress["total"] += integral
    if progress["seen"] >= messages:
        progress["last"] = time.perf_counter()
        progress["cpu"] = time.process_time() - progress["cpu0"]
        app.stop()
    return integral


def closed(window):
    progress["windows"] += 1
    return window


sdf = app.dataframe(topic)
sdf = sdf.apply(integrate, stateful=True)
sdf = sdf.tumbling_window(duration_ms=60_000).sum().final()
sdf = sdf.apply(closed)
app.run()
print(json.dumps({
    "messages": progress["seen"], "rows": progress["rows"],
    "seconds": progress["last"] - progress["first"], "windows": progress["windows"],
    "cpu": progress["cpu"],
    "byte_ms": progress["total"],
}))
'''


def quix(python: str, bootstrap: str, topic: str, messages: int) -> tuple[Result, dict[str, int]]:
    with tempfile.TemporaryDirectory(prefix="bench-quix-") as state:
        proc = subprocess.run(
            [python, "-c", QUIX_APP, str(REPO), bootstrap, topic, str(messages), state],
            capture_output=True,
            text=True,
            timeout=1800,
            check=False,
        )
    if proc.returncode != 0:
        raise SystemExit(f"bench_e2e: the Quix Streams job failed:\n{proc.stderr[-4000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return Result(out["messages"], out["rows"], out["seconds"], out["windows"], out["cpu"]), out


def quix_version(python: str) -> str:
    proc = subprocess.run(
        [python, "-c", "import quixstreams; print(quixstreams.__version__)"],
        capture_output=True,
        text=True,
        check=False,
    )
    return proc.stdout.strip() if proc.returncode == 0 else "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, default=400_000, help="usage rows to produce")
    ap.add_argument("--bootstrap", help="broker (default: scripts/kafka.sh start)")
    ap.add_argument("--quix-python", help="python of a venv with quixstreams and msgspec")
    ap.add_argument("--repeat", type=int, default=3, help="rounds (one run of each side)")
    args = ap.parse_args(argv)

    bootstrap = args.bootstrap or bootstrap_address()
    shape = Shape()
    seconds = -(-args.rows // shape.rows_per_second)
    start = int(time.time() * 1000) - (seconds + 120) * 1000  # past, within retention
    t0 = start - start % MINUTE_MS
    events, usage_rows, heartbeat_rows = build(shape, args.rows, t0)
    topic = f"bench-e2e-{uuid.uuid4().hex[:10]}"
    began = time.perf_counter()
    asyncio.run(produce(bootstrap, topic, events))
    produce_s = time.perf_counter() - began
    samples = sum(isinstance(e, UsageSample) for _, e in events)
    beats = sum(isinstance(e, Heartbeat) for _, e in events)
    print(
        f"bench_e2e: broker {bootstrap}, topic {topic} (3 partitions, gzip), "
        f"{shape.nodes} nodes x {shape.containers} containers x {shape.procs} procs x "
        f"{shape.devices} devices, {seconds} s of event time"
    )
    print(
        f"  produced {len(events):,} messages in {produce_s:.1f} s: {samples:,} UsageSample "
        f"({usage_rows:,} rows), {beats} heartbeats ({heartbeat_rows:,} rows), "
        f"{len(events) - samples - beats} ContainerAppeared"
    )

    version = quix_version(args.quix_python) if args.quix_python else ""
    if not args.quix_python:
        print(
            "  quix: skipped (no --quix-python; create the venv with: python3 -m venv "
            "/tmp/quixvenv && /tmp/quixvenv/bin/pip install quixstreams msgspec)"
        )
    mine: list[Result] = []
    theirs: list[Result] = []
    fetched: list[Result] = []
    for i in range(args.repeat):
        gc.collect()
        f = asyncio.run(fetch_only(bootstrap, topic, len(events), usage_rows))
        fetched.append(f)
        print(
            f"  round {i + 1} (load {load()}): fetch only {f.messages:,} messages after the "
            f"first batch, {f.seconds:.3f} s ({f.cpu:.3f} s CPU), {f.rate:,.0f} samples/s"
        )
        r = asyncio.run(ours(bootstrap, topic, len(events), usage_rows))
        mine.append(r)
        print(
            f"  round {i + 1} (load {load()}): ours {r.messages:,} messages, {r.records:,} "
            f"records written, {r.seconds:.3f} s ({r.cpu:.3f} s CPU), {r.rate:,.0f} samples/s"
        )
        if args.quix_python:
            q, raw = quix(args.quix_python, bootstrap, topic, len(events))
            assert q.messages == len(events) and q.rows == usage_rows, raw
            theirs.append(q)
            print(
                f"  round {i + 1} (load {load()}): quix {q.messages:,} messages, {q.records:,} "
                f"windows closed, {q.seconds:.3f} s ({q.cpu:.3f} s CPU), {q.rate:,.0f} samples/s"
            )
    summary("fetch only (the same aiokafka consumer, records dropped)", fetched)
    summary("ours (aiokafka + msgspec + Aggregator + CSV sink)", mine)
    fetch_rate = statistics.median(r.rate for r in fetched)
    ours_rate = statistics.median(r.rate for r in mine)
    print(
        f"  fetching is {ours_rate / fetch_rate:.0%} of our time by medians; the rest, "
        f"{1 - ours_rate / fetch_rate:.0%}, is decoding, windowing and the sink"
    )
    if theirs:
        summary(f"quix (Quix Streams {version}, stateful apply + tumbling_window sum)", theirs)
        quix_rate = statistics.median(q.rate for q in theirs)
        ratio = ours_rate / quix_rate
        per_cpu = statistics.median(r.cpu_rate for r in mine) / statistics.median(
            q.cpu_rate for q in theirs
        )
        verdict = "met" if ratio >= GOAL_RATIO else "NOT met"
        print(
            f"  ratio ours/quix by medians: {ratio:.2f}x (goal >= {GOAL_RATIO:.0f}x: {verdict}); "
            f"per round: "
            + ", ".join(f"{a.rate / b.rate:.2f}x" for a, b in zip(mine, theirs, strict=True))
            + f"; per CPU second by medians: {per_cpu:.2f}x"
        )
        ceiling = fetch_rate / quix_rate
        print(
            f"  ceiling: the consumer alone is {ceiling:.2f}x quix by medians (a job that took "
            f"no time after the fetch would reach that ratio, no more)"
        )
    print(f"  python {sys.version.split()[0]}, load average at the end {load()}")
    return 0


def summary(what: str, runs: list[Result]) -> None:
    rates = [r.rate for r in runs]
    per_cpu = statistics.median(r.cpu_rate for r in runs)
    print(
        f"  {what}: median {statistics.median(rates):,.0f} samples/s of {len(rates)} runs (best "
        f"{max(rates):,.0f}); per CPU second median {per_cpu:,.0f}"
    )


def load() -> str:
    """The 1-, 5- and 15-minute load averages (the machine is shared: say how busy it was)."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    raise SystemExit(main())
