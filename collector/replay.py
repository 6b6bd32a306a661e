"""`hami-usage replay`: the aggregate code over a past range of the event log.

Reading starts `WindowSettings.lookback_ms` (or the idle time, if longer) + slack before
`--from` (found by record time): the same settings that decide how long a container's name is
kept, so every value in effect at `--from` and every name still held there has been seen again,
and so has every node that still held the windows open there (silent, but for less than the
idle time). Reading a source stops once its watermark has passed `--to` (every window in the
range closed as it did live), or at the end of the log; never on record time alone, since a
spool drained after an outage sends events of the range long after it. Only windows inside
[from, to) are written. The records are the ones the live service wrote for the same
input, byte for byte, because they come from the same `Aggregator`.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .aggregate.intake import InputStats, add_record
from .aggregate.records import BillingRecord, record_order
from .aggregate.service import TAIL_SETTLE_S, Checkpoint, Outputs, read_damage, report
from .aggregate.tally import future_by_node
from .aggregate.windows import Aggregator, WindowSettings
from .transport.consumer import ConsumerSettings, read_range
from .transport.locallog import LogReader

# Records between two looks at whether a source has read past the range (a batch is up to 5000).
CHECK_EVERY = 256


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


def _local(log_dir: Path, start_ms: int) -> tuple[LogReader, int, int]:
    """A reader of the log, the offset reading starts at, and `missing_history`."""
    reader = LogReader(log_dir)
    first = reader.offset_for_time(start_ms)
    kept = reader.read(first, 1)
    begin = reader.first_offset()
    return (
        reader,
        first,
        missing_history(begin, first, kept[0].timestamp_ms if kept else None, start_ms),
    )


def missing_history(begin: int, first: int, first_ts: int | None, start_ms: int) -> int:
    """Offsets the input no longer holds (below `begin`, deleted by retention) that reading
    from `start_ms` may need: all of them (their count is what is known) when reading starts
    at the oldest record kept and that one is already newer than `start_ms` (or nothing is kept
    at all), so what was in effect at the range's start may not be seen again; else 0."""
    late = first_ts is None or first_ts > start_ms
    return begin if begin > 0 and first <= begin and late else 0


def replay_start_ms(window: WindowSettings, rng: ReplayRange) -> int:
    """The record time reading starts at."""
    return window.history_from(rng.from_ms)


def _in_range(r: BillingRecord, rng: ReplayRange) -> bool:
    return rng.from_ms <= r.window_start_ms and r.window_end_ms <= rng.to_ms


class Replay:
    """One Aggregator per source fed batch by batch; keeps the windows inside the range."""

    def __init__(self, total: int, window: WindowSettings, rng: ReplayRange) -> None:
        self.window = window
        self.rng = rng
        self.stats = InputStats()
        self.progress = Progress(total)
        self.finished: set[int] = set()  # sources read past the range
        self._aggs: dict[int, Aggregator] = {}
        self._kept: list[BillingRecord] = []
        self.fed_end = 0  # the offset after the last record taken (of the local log's source)

    def feed(self, batch: list[Raw]) -> None:
        for i, raw in enumerate(batch, start=1):
            if raw.source in self.finished:
                continue
            agg = self._aggs.setdefault(raw.source, Aggregator(self.window))
            self.fed_end = raw.offset + 1
            add_record(
                agg,
                self.stats,
                raw.key,
                raw.value,
                source=raw.source,
                offset=raw.offset,
                record_ts_ms=raw.timestamp_ms,
            )
            if not i % CHECK_EVERY:
                self._close(raw.source, agg)
        for source, agg in self._aggs.items():
            self._close(source, agg)
        self.progress.advance(len(batch))

    def _close(self, source: int, agg: Aggregator) -> None:
        """The windows `agg` can close (the same records whenever this runs); the source is
        finished once every window in the range is."""
        self._kept += [r for r in agg.advance() if _in_range(r, self.rng)]
        if agg.emitted_until_ms >= self.rng.to_ms:
            self.finished.add(source)

    def lost_history(self, offsets: int) -> None:
        """Offsets the input no longer holds that reading may have needed (deleted by
        retention): said as deleted records, so the replay is not taken for complete."""
        if offsets:
            self.stats.damage.missing_segments += 1
            self.stats.damage.missing_records += offsets

    def finish(self, outputs: Outputs) -> InputStats:
        for agg in self._aggs.values():
            self._kept += [r for r in agg.flush() if _in_range(r, self.rng)]
        self.progress.close()
        self._kept.sort(key=record_order)
        outputs.write(self._kept)
        return self.stats

    def summary(self, written: int) -> str:
        """The summary line, as `aggregate`'s: the counts are of everything read, the
        lookback before the range included."""
        counted = [agg.stats for agg in self._aggs.values()]
        return report("replay", self.stats, counted, future_by_node(self._aggs.values()), written)


def _replaced(window: WindowSettings) -> Checkpoint:
    """New files for the range (what was in them before is replaced): a checkpoint of this
    release with every file at 0 (`Checkpoint.lengths_of`: an older release's 0 keeps them)."""
    return Checkpoint(window_ms=window.window_ms)


def replay_local(
    log_dir: Path, window: WindowSettings, rng: ReplayRange, csv: str | None, jsonl: str | None
) -> tuple[str, InputStats]:
    reader, first, lost = _local(log_dir, replay_start_ms(window, rng))
    replay = Replay(reader.end_offset() - first, window, rng)
    position, at_end = first, False
    while 0 not in replay.finished:  # no further than the range needs
        batch = reader.read(position, 5000)
        if not batch:
            at_end = True
            break
        position = batch[-1].offset + 1
        replay.feed([Raw(0, r.offset, r.timestamp_ms, r.key, r.value) for r in batch])
    damage = replay.stats.damage
    # Only damage among what the range needed: not what finding its start passed over, nor
    # what lies after the last record it took.
    read_damage(reader.damage_in(first, position if at_end else replay.fed_end), damage)
    replay.lost_history(lost)
    if at_end:
        torn = reader.torn_tail()
        if torn:
            time.sleep(TAIL_SETTLE_S)
            torn = reader.torn_tail()
        damage.torn_tail_bytes = torn
    outputs = Outputs.open(csv, jsonl, None, _replaced(window))
    try:
        stats = replay.finish(outputs)
    finally:
        outputs.close()
    return replay.summary(outputs.written), stats


async def replay_kafka(
    source: ConsumerSettings,
    topic: str,
    window: WindowSettings,
    rng: ReplayRange,
    csv: str | None,
    jsonl: str | None,
) -> tuple[str, InputStats]:
    async with read_range(source, topic, replay_start_ms(window, rng)) as reading:
        replay = Replay(reading.total, window, rng)
        start = replay_start_ms(window, rng)
        for tp in reading.partitions:
            b = reading.begin[tp]
            replay.lost_history(missing_history(b, reading.first[tp], reading.first_ts[tp], start))
        async for batch in reading.batches(replay.finished):
            replay.feed([Raw(m.partition, m.offset, m.timestamp, m.key, m.value) for m in batch])
    outputs = Outputs.open(csv, jsonl, None, _replaced(window))
    try:
        stats = replay.finish(outputs)
    finally:
        outputs.close()
    return replay.summary(outputs.written), stats
