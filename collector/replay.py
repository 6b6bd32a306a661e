"""`hami-usage replay`: the aggregate code over a past range of the event log.

Reading starts `max_gap + lateness + slack` before `--from` (found by record time), so every
value in effect at `--from` and every container's identity (restated by each heartbeat, at most
max_gap apart) has been seen again; reading stops once the watermark has passed `--to` or the
log ends. Only windows inside [from, to) are written. The records are the ones the live service
wrote for the same input, byte for byte, because they come from the same `Aggregator`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .aggregate.records import BillingRecord
from .aggregate.service import Checkpoint, InputStats, Outputs, add_record
from .aggregate.windows import Aggregator, WindowSettings

# Record timestamps are the collector's append or send time, a little after the event time.
SLACK_MS = 60_000


@dataclass(frozen=True)
class ReplayRange:
    from_ms: int
    to_ms: int


@dataclass(frozen=True)
class Raw:
    source: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes


class Progress:
    """A one-line progress bar on a terminal; silent otherwise."""

    def __init__(self, total: int) -> None:
        self.total = max(total, 1)
        self.tty = sys.stderr.isatty()
        self.done = 0
        self._shown = -1

    def advance(self, n: int) -> None:
        self.done += n
        pct = min(100, self.done * 100 // self.total)
        if self.tty and pct != self._shown:
            self._shown = pct
            bar = "#" * (pct // 4)
            sys.stderr.write(f"\rreplay [{bar:<25}] {pct:3d}% {self.done}/{self.total} events")
            sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


def _local(log_dir: Path, start_ms: int) -> tuple[int, Iterator[list[Raw]]]:
    from .transport.locallog import LogReader

    reader = LogReader(log_dir)
    first = reader.offset_for_time(start_ms)
    total = reader.end_offset() - first

    def batches() -> Iterator[list[Raw]]:
        position = first
        while True:
            batch = reader.read(position, 5000)
            if not batch:
                return
            position = batch[-1].offset + 1
            yield [Raw(0, r.offset, r.timestamp_ms, r.key, r.value) for r in batch]

    return total, batches()


def _in_range(r: BillingRecord, rng: ReplayRange) -> bool:
    return rng.from_ms <= r.window_start_ms and r.window_end_ms <= rng.to_ms


def replay_batches(
    total: int,
    batches: Iterator[list[Raw]],
    window: WindowSettings,
    rng: ReplayRange,
    outputs: Outputs,
) -> InputStats:
    stats = InputStats()
    aggs: dict[int, Aggregator] = {}
    stop_ms = rng.to_ms + window.lateness_ms + window.max_gap_ms + SLACK_MS
    progress = Progress(total)
    kept: list[BillingRecord] = []
    finished: set[int] = set()
    for batch in batches:
        for raw in batch:
            if raw.source in finished:
                continue
            if raw.timestamp_ms > stop_ms:
                finished.add(raw.source)
                continue
            agg = aggs.setdefault(raw.source, Aggregator(window))
            add_record(
                agg,
                stats,
                raw.key,
                raw.value,
                source=raw.source,
                offset=raw.offset,
                record_ts_ms=raw.timestamp_ms,
            )
        for agg in aggs.values():
            kept += [r for r in agg.advance() if _in_range(r, rng)]
        progress.advance(len(batch))
    for agg in aggs.values():
        kept += [r for r in agg.flush() if _in_range(r, rng)]
    progress.close()
    kept.sort(key=lambda r: (r.window_start_ms, r.node, r.pod_uid, r.container, r.device_uuid))
    outputs.write(kept)
    return stats


def replay_local(
    log_dir: Path, window: WindowSettings, rng: ReplayRange, csv: str | None, jsonl: str | None
) -> tuple[int, InputStats]:
    start = rng.from_ms - window.max_gap_ms - window.lateness_ms - SLACK_MS
    total, batches = _local(log_dir, start)
    outputs = Outputs.open(csv, jsonl, None, Checkpoint())
    try:
        stats = replay_batches(total, batches, window, rng, outputs)
    finally:
        outputs.close()
    return outputs.written, stats


async def replay_kafka(
    bootstrap: str,
    topic: str,
    window: WindowSettings,
    rng: ReplayRange,
    csv: str | None,
    jsonl: str | None,
) -> tuple[int, InputStats]:
    from aiokafka import AIOKafkaConsumer, TopicPartition

    start = rng.from_ms - window.max_gap_ms - window.lateness_ms - SLACK_MS
    stop_ms = rng.to_ms + window.lateness_ms + window.max_gap_ms + SLACK_MS
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        isolation_level="read_committed",
        client_id="hami-usage-replay",
    )
    await consumer.start()
    try:
        parts = consumer.partitions_for_topic(topic) or set()
        if not parts:
            await consumer._client.force_metadata_update()  # noqa: SLF001 - first lookup
            parts = consumer.partitions_for_topic(topic) or set()
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        consumer.assign(tps)
        found = await consumer.offsets_for_times({tp: max(start, 0) for tp in tps})
        ends = await consumer.end_offsets(tps)
        begins = await consumer.beginning_offsets(tps)
        firsts = {tp: (found[tp].offset if found.get(tp) else ends[tp]) for tp in tps}
        for tp in tps:
            consumer.seek(tp, max(firsts[tp], begins[tp]))
        total = sum(ends[tp] - firsts[tp] for tp in tps)

        async def fetch_all() -> list[list[Raw]]:
            out: list[list[Raw]] = []
            while True:
                pending = [tp for tp in tps if await consumer.position(tp) < ends[tp]]
                if not pending:
                    return out
                got = await consumer.getmany(*pending, timeout_ms=1000, max_records=5000)
                batch: list[Raw] = []
                for tp, msgs in got.items():
                    for m in msgs:
                        batch.append(Raw(tp.partition, m.offset, m.timestamp, m.key, m.value))
                    if msgs and msgs[-1].timestamp > stop_ms:
                        consumer.seek(tp, ends[tp])  # past the range: this partition is done
                if batch:
                    out.append(batch)

        batches = await fetch_all()
    finally:
        await consumer.stop()
    outputs = Outputs.open(csv, jsonl, None, Checkpoint())
    try:
        stats = replay_batches(total, iter(batches), window, rng, outputs)
    finally:
        outputs.close()
    return outputs.written, stats
