"""Deterministic event streams for the aggregate / replay tests (and their Kafka plumbing).

A stream is what real collectors say about simulated nodes: for each node, cache files written
through `collector.simulate.CacheWriter` (the HAMi-core protocol) and a `Scanner` with a fixed
`inc` that scans them once per second of *event time* (`now_ms` is given, never the clock).
Every value is a closed formula of (node, container, process, device, second), so a test can
also work out a billed integral by hand.

Shape (per node, `Spec` defaults): 3 containers x 2 processes x 2 devices, every row changes
every second, a heartbeat every 10 s; at `exit_at` the second process of container 1 exits, at
`gone_at` container 2's file goes away, and at `restart_at` (off by default) the collector
restarts: a new incarnation re-announces every container.

Messages are what the transports carry: key = node name, value = `events.encode(e)`, record
timestamp = the event's ts (so `offsets_for_times` finds event times).
"""

from __future__ import annotations

import asyncio
import csv
import io
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from collector.aggregate.billing import decode_billing
from collector.aggregate.records import CSV_FIELDS, BillingRecord, csv_row, record_order
from collector.aggregate.service import AggregateSettings
from collector.aggregate.windows import Aggregator, WindowSettings
from collector.events import (
    SCHEMA_VERSION,
    ContainerGone,
    Event,
    UsageRow,
    UsageSample,
    encode,
)
from collector.layout.declarations import LAYOUTS
from collector.node.scan import Scanner
from collector.simulate import CacheWriter, GiB, MiB, SimDevice
from collector.transport.locallog import LocalLog

HAMI_USAGE = Path(sys.executable).parent / "hami-usage"

# The settings every test here runs the service and the in-test reference with.
# A short max_skew: windows wait that long (in record time) after their end for nodes whose
# clock is behind, and these streams have none; the services close windows while they run.
WINDOW = WindowSettings(window_ms=60_000, lateness_ms=5_000, max_gap_ms=30_000, max_skew_ms=30_000)
WINDOW_FLAGS = ["--window", "60", "--lateness", "5", "--max-gap", "30", "--max-skew", "30"]
MINUTE_MS = 60_000
# A fixed epoch for the local-log tests: 2026-03-02T10:00:00Z.
T0_MS = 1_772_445_600_000
CTX_BYTES = 200 * MiB  # context memory of every process on every device


def recent_t0(seconds: int) -> int:
    """A minute-aligned start so that a stream of `seconds` ends well before now: Kafka 4
    refuses record timestamps more than an hour ahead of the broker's clock, and the test
    topics' time-based retention must not see them as old."""
    start = int(time.time() * 1000) - (seconds + 120) * 1000
    return start - start % MINUTE_MS


# --- the formulas ------------------------------------------------------------------------


def data_bytes(n: int, c: int, p: int, d: int, s: int) -> int:
    """data_size of process p of container c on device d of node n at second s (never the same
    two seconds running, so every row is re-sampled every second)."""
    return ((n * 7 + c * 5 + p * 3 + d * 11 + s * 13) % 64 + 1) * MiB


def total_bytes(n: int, c: int, p: int, d: int, s: int) -> int:
    return CTX_BYTES + data_bytes(n, c, p, d, s)


def monitor_bytes(n: int, c: int, p: int, d: int, s: int) -> int:
    return total_bytes(n, c, p, d, s) + 300 * MiB


def sm_percent(n: int, c: int, p: int, d: int, s: int) -> int:
    return (s * 3 + n + c + p * 7 + d) % 101


def limit_bytes(c: int, d: int) -> int:
    return (4 + c + d) * GiB


SM_LIMIT = 50


def pod_uid(n: int, c: int) -> str:
    return f"{n:04d}{c:04d}-0000-4000-8000-000000000000"


def gpu_uuid(n: int, d: int) -> str:
    return f"GPU-{n:04d}{d:04d}-1111-4000-8000-000000000000"


def container_name(c: int) -> str:
    return f"ctr{c}"


def pid_of(p: int) -> int:
    return 100 + p


def hostpid_of(n: int, c: int, p: int) -> int:
    return 40_000 + n * 1000 + c * 10 + p


@dataclass(frozen=True)
class Spec:
    containers: int = 3
    procs: int = 2
    devices: int = 2
    seconds: int = 300
    heartbeat_s: int = 10
    exit_at: int | None = 100  # container 1, process 1 exits (ProcessExited at this second)
    gone_at: int | None = 200  # container 2's file goes away (ContainerGone at this second)
    restart_at: int | None = None  # the collector restarts: a new incarnation from here


def alive(spec: Spec, c: int, p: int, s: int) -> bool:
    """Whether process p of container c is live (sampled) at second s."""
    if spec.gone_at is not None and c == 2 and s >= spec.gone_at:
        return False
    return not (spec.exit_at is not None and c == 1 and p == 1 and s >= spec.exit_at)


# --- one node ----------------------------------------------------------------------------


class NodeStream:
    """The cache files of one node and the collector that scans them, one step per second."""

    def __init__(self, root: Path, n: int, name: str, spec: Spec, inc: int) -> None:
        self.root = root / name
        self.root.mkdir(parents=True)
        self.n = n
        self.name = name
        self.spec = spec
        self.inc = inc
        self.writers: dict[int, CacheWriter] = {}
        self.mem: dict[tuple[int, int, int], int] = {}  # (c, p, d) -> data bytes written
        for c in range(spec.containers):
            d = self.root / f"{pod_uid(n, c)}_{container_name(c)}"
            d.mkdir()
            devs = [SimDevice(gpu_uuid(n, i), limit_bytes(c, i), SM_LIMIT) for i in range(2)]
            w = CacheWriter(d / "0.cache", LAYOUTS["v1.2"], devs[: spec.devices])
            for p in range(spec.procs):
                w.add_process(pid_of(p), hostpid_of(n, c, p))
                for dev in range(spec.devices):
                    w.add_memory(pid_of(p), dev, "context", CTX_BYTES)
            self.writers[c] = w
        self.scanner = self._scanner(inc)

    def _scanner(self, inc: int) -> Scanner:
        return Scanner(self.root, heartbeat_s=self.spec.heartbeat_s, inc=inc)

    def step(self, s: int, now_ms: int) -> list[Event]:
        spec = self.spec
        if spec.restart_at is not None and s == spec.restart_at:
            self.inc += 1
            self.scanner = self._scanner(self.inc)
        for c, w in list(self.writers.items()):
            if spec.gone_at is not None and c == 2 and s >= spec.gone_at:
                w.close()
                del self.writers[c]
                shutil.rmtree(w.path.parent)
                continue
            watch: dict[int, dict[int, tuple[int, int]]] = {}
            for p in range(spec.procs):
                if not alive(spec, c, p, s):
                    if w.slot_of(pid_of(p)) is not None:
                        w.exit(pid_of(p))
                    continue
                for d in range(spec.devices):
                    want = data_bytes(self.n, c, p, d, s)
                    w.add_memory(pid_of(p), d, "data", want - self.mem.get((c, p, d), 0))
                    self.mem[(c, p, d)] = want
                    watch.setdefault(hostpid_of(self.n, c, p), {})[d] = (
                        monitor_bytes(self.n, c, p, d, s),
                        sm_percent(self.n, c, p, d, s),
                    )
            w.watch(watch)
        return self.scanner.scan(now_ms)

    def close(self) -> None:
        for w in self.writers.values():
            w.close()
        self.writers.clear()


@dataclass(frozen=True)
class Msg:
    """One transport record: key = node, value = encoded event, ts = record timestamp."""

    key: bytes
    value: bytes
    ts: int
    event: Event | None = None  # None: not a valid event (bad input)

    @property
    def node(self) -> str:
        return self.key.decode()


def msg(node: str, e: Event) -> Msg:
    return Msg(node.encode(), encode(e), e.ts, e)


@dataclass
class Stream:
    """Several nodes stepped together; `seconds()` yields each second's messages, merged in
    event-time order (node by node within a second)."""

    root: Path
    t0_ms: int
    spec: Spec = field(default_factory=Spec)
    nodes: Sequence[str] = ("node-a", "node-b")
    inc_base: int = 1000

    def seconds(self) -> Iterator[list[Msg]]:
        streams = [
            NodeStream(self.root, n, name, self.spec, self.inc_base + 100 * n)
            for n, name in enumerate(self.nodes)
        ]
        try:
            for s in range(self.spec.seconds):
                now = self.t0_ms + s * 1000
                yield [msg(ns.name, e) for ns in streams for e in ns.step(s, now)]
        finally:
            for ns in streams:
                ns.close()

    def messages(self) -> list[Msg]:
        return [m for batch in self.seconds() for m in batch]


def build(
    root: Path, t0_ms: int, spec: Spec | None = None, nodes: Sequence[str] = ("node-a", "node-b")
) -> list[Msg]:
    return Stream(root, t0_ms, spec or Spec(), nodes).messages()


# --- bad input ---------------------------------------------------------------------------


def bad_messages(node: str, ts: int) -> list[Msg]:
    """Undecodable bytes, a message of schema version 99, and an event an hour ahead of its
    record timestamp (a seq no real event has, so only the future rule can drop it)."""
    key = node.encode()
    future = UsageSample(
        SCHEMA_VERSION, 999_999, 0, ts + 3_600_000, 0, [UsageRow(1, 2, 0, GiB, 0, 0, GiB, 0, 0)]
    )
    v99 = ContainerGone(99, 999_998, 0, ts, 0)
    return [
        Msg(key, b"\xc1\xff not msgpack", ts),
        Msg(key, encode(v99), ts),
        Msg(key, encode(future), ts),
    ]


def with_bad_input(msgs: list[Msg]) -> list[Msg]:
    """`msgs` with the three bad messages inserted a third of the way in."""
    at = len(msgs) // 3
    return [*msgs[:at], *bad_messages(msgs[at].node, msgs[at].ts), *msgs[at:]]


def with_duplicates(msgs: list[Msg], every: int = 150, resend: int = 40) -> list[Msg]:
    """Re-sends, the way a forwarder retry does: after every `every`-th message, the last
    `resend` messages of its node again (same inc, seq and bytes), in their key order."""
    out: list[Msg] = []
    recent: dict[bytes, list[Msg]] = {}
    for i, m in enumerate(msgs):
        out.append(m)
        tail = recent.setdefault(m.key, [])
        tail.append(m)
        del tail[:-resend]
        if i % every == every - 1:
            out += tail
    return out


# --- the reference -----------------------------------------------------------------------


def sort_key(r: BillingRecord) -> tuple[int, str, str, str, str, int]:
    # The record kind too: a GPU's `gpu` and `idle` rows share the rest, and billing messages
    # (keyed by record_id) come back from several partitions in no particular order.
    return record_order(r)


def reference(
    msgs: Iterable[Msg],
    settings: WindowSettings = WINDOW,
    *,
    source_of: dict[str, int] | None = None,
    advance_every: int = 0,
) -> list[BillingRecord]:
    """Feed the events straight into Aggregators (one per source: `source_of` maps a node to
    its Kafka partition; one source for a local log), then flush; records sorted by row key.
    `advance_every`: also advance() after every that many messages (0: only the flush)."""
    aggs: dict[int, Aggregator] = {}
    offsets: dict[int, int] = {}
    records: list[BillingRecord] = []
    for i, m in enumerate(msgs):
        src = 0 if source_of is None else source_of[m.node]
        off = offsets.get(src, 0)
        offsets[src] = off + 1
        agg = aggs.get(src)
        if agg is None:
            agg = aggs[src] = Aggregator(settings)
        if m.event is not None:
            agg.add(m.node, m.event, source=src, offset=off, record_ts_ms=m.ts)
        if advance_every and i % advance_every == advance_every - 1:
            for a in aggs.values():
                records += a.advance()
    for agg in aggs.values():
        records += agg.flush()
    return sorted(records, key=sort_key)


def csv_lines(records: Iterable[BillingRecord]) -> list[str]:
    """The data lines (no header) a CSV sink writes for `records`, each with its newline."""
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(csv_row(r) for r in records)
    return buf.getvalue().splitlines(keepends=True)


CSV_HEADER = ",".join(CSV_FIELDS) + "\n"


def read_csv(path: Path) -> list[str]:
    """Data lines of a CSV output, asserting it starts with exactly one header."""
    lines = path.read_text().splitlines(keepends=True)
    assert lines and lines[0] == CSV_HEADER, lines[:1]
    assert CSV_HEADER not in lines[1:], "a second header line"
    return lines[1:]


def totals(records: Iterable[BillingRecord]) -> dict[str, float]:
    out: dict[str, float] = {}
    for r in records:
        for name in (
            "memory_byte_seconds",
            "memory_limit_byte_seconds",
            "nvml_memory_byte_seconds",
            "sm_percent_seconds",
            "sm_limit_percent_seconds",
            "observed_seconds",
            "samples",
        ):
            out[name] = out.get(name, 0) + getattr(r, name)
    return out


# --- transports --------------------------------------------------------------------------


def write_local_log(directory: Path, msgs: Iterable[Msg]) -> int:
    n = 0
    with LocalLog(directory) as log:
        for m in msgs:
            assert log.append(m.key, m.value, m.ts) is not None
            n += 1
    return n


async def create_topic(
    bootstrap: str, topic: str, partitions: int = 3, configs: dict[str, str] | None = None
) -> None:
    """Create `topic` (with these topic `configs`) and return once the broker's metadata shows
    every partition with a leader. The broker answers CreateTopics before its metadata has the
    topic (at once on an idle machine, seconds later under load), and a producer asking
    meanwhile is told that the topic does not exist and holds its records back until it
    does."""
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic
    from aiokafka.errors import RequestTimedOutError, for_code

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        response = await admin.create_topics(
            [NewTopic(topic, partitions, 1, topic_configs=configs)]
        )
        for name, code, *_ in response.topic_errors:
            # Timed out = not done within the request's timeout; it goes on, and is awaited below.
            assert code == 0 or for_code(code) is RequestTimedOutError, (name, for_code(code))
        async with asyncio.timeout(120):
            while True:
                (found,) = await admin.describe_topics([topic])
                led = [p for p in found["partitions"] if p["error_code"] == 0 and p["leader"] >= 0]
                if found["error_code"] == 0 and len(led) == partitions:
                    return
                await asyncio.sleep(0.1)
    finally:
        await admin.close()


class Producer:
    """A plain aiokafka producer (idempotent: a node's records stay in order, once each)."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        from aiokafka import AIOKafkaProducer

        self.topic = topic
        self.partition_of: dict[str, int] = {}
        self._p = AIOKafkaProducer(
            bootstrap_servers=bootstrap, enable_idempotence=True, linger_ms=20
        )

    async def __aenter__(self) -> Producer:
        await self._p.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._p.stop()

    async def send(self, msgs: Iterable[Msg]) -> None:
        futures = [
            (m, await self._p.send(self.topic, m.value, key=m.key, timestamp_ms=m.ts)) for m in msgs
        ]
        for m, fut in futures:
            meta = await fut
            known = self.partition_of.setdefault(m.node, meta.partition)
            assert known == meta.partition, "a node's events must stay in one partition"


async def produce(bootstrap: str, topic: str, msgs: Iterable[Msg]) -> dict[str, int]:
    """Send everything; return node -> partition."""
    async with Producer(bootstrap, topic) as p:
        await p.send(msgs)
        return p.partition_of


def replica(bootstrap: str, topic: str, log_dir: Path, instance: str) -> AggregateSettings:
    """Replica `instance` of the group `<topic>.g` reading `topic`, its CSV in `log_dir`."""
    return AggregateSettings(
        window=WINDOW, kafka=bootstrap, topic=topic, group=f"{topic}.g",
        billing_topic=f"{topic}.billing", log_dir=log_dir, instance=instance,
        csv=str(log_dir / f"{instance}.csv"),
    )  # fmt: skip


async def read_billing(bootstrap: str, topic: str, timeout_s: float = 60) -> list[BillingRecord]:
    """Every committed record of the billing topic (read_committed), decoded."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        isolation_level="read_committed",
        auto_offset_reset="earliest",
    )
    await consumer.start()
    try:
        async with asyncio.timeout(timeout_s):
            parts = await consumer._client._wait_on_metadata(topic)  # noqa: SLF001
            tps = [TopicPartition(topic, p) for p in sorted(parts)]
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            ends = await consumer.end_offsets(tps)  # the last stable offsets
            out: list[BillingRecord] = []
            while [tp for tp in tps if await consumer.position(tp) < ends[tp]]:
                for records in (await consumer.getmany(timeout_ms=200)).values():
                    out += [decode_billing(r.value) for r in records]
            return out
    finally:
        await consumer.stop()


async def consume_plain(topic: str, **client: Any) -> list[Any]:
    """Every committed message of `topic` as a plain aiokafka consumer sees it (no project
    code), up to the end offsets at the time. `client`: bootstrap_servers, security, group_id."""
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(
        topic,
        isolation_level="read_committed",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        **client,
    )
    await consumer.start()
    try:
        async with asyncio.timeout(60):
            while not (tps := consumer.assignment()):
                await asyncio.sleep(0.05)
            ends = await consumer.end_offsets(list(tps))
            out: list[Any] = []
            while [tp for tp in tps if await consumer.position(tp) < ends[tp]]:
                for msgs in (await consumer.getmany(timeout_ms=200)).values():
                    out += msgs
            return out
    finally:
        await consumer.stop()


async def committed_metadata(bootstrap: str, group: str) -> dict[int, tuple[int, str]]:
    """partition -> (committed offset, metadata) of `group`. An error Kafka calls retriable
    (no coordinator yet: the broker's first group creates `__consumer_offsets`) is retried
    for up to 30 s."""
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.errors import KafkaError

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    deadline = time.monotonic() + 30
    try:
        while True:
            try:
                got = await admin.list_consumer_group_offsets(group)
                break
            except KafkaError as e:
                if not e.retriable or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
    finally:
        await admin.close()
    return {tp.partition: (om.offset, om.metadata) for tp, om in got.items()}


# --- the CLI -----------------------------------------------------------------------------


def env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("HAMI_USAGE_")}


def hami(*args: str | Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run `hami-usage ARGS` to completion."""
    return subprocess.run(
        [str(HAMI_USAGE), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env(),
        check=False,
    )


def final_report(stderr: str, command: str = "aggregate") -> tuple[int, dict[str, int]]:
    """(records written, counters) from the last `aggregate: ...` (`command`) summary line."""
    lines = [ln for ln in stderr.splitlines() if f"{command}: " in ln]
    assert lines, stderr[-3000:]
    m = re.search(rf"{command}: (\d+) records(.*)$", lines[-1])
    assert m, lines[-1]
    # the damage summary follows after "; "; per-node counts follow theirs in parentheses
    counted = re.sub(r" \([^)]*\)", "", m.group(2).split(";")[0])
    counters = dict(kv.split("=", 1) for kv in counted.split())
    return int(m.group(1)), {k: int(v) for k, v in counters.items()}


def decode_checkpoint(metadata: str) -> dict[str, int]:
    out: dict[str, int] = msgspec.json.decode(metadata)
    return out
