"""Reading a log directory, possibly while the writer in another process appends to it.

Damage is skipped and counted, never raised: a damaged frame is passed over to the next valid
frame (resynchronisation), a deleted segment is a gap. A bad or partial frame at the end of the
newest segment with nothing valid after it is a tail still being written (or a torn tail the
writer cuts when it next opens), not damage, until `torn_tail()` says it stayed that way.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import msgspec

from .checkpoint import Checkpoint, checkpoint_path, load_checkpoint, store_checkpoint
from .frames import (
    FRAME_OVERHEAD,
    Frame,
    ScanEnd,
    SegmentState,
    list_segments,
    segment_name,
    walk_frames,
)


class LogRecord(msgspec.Struct, frozen=True):
    offset: int
    timestamp_ms: int
    key: bytes
    value: bytes


@dataclass(slots=True)
class ReaderStats:
    corrupt_frames: int = 0  # distinct damaged frames passed over
    # Distinct offsets the reader skipped without returning: segments deleted before they were
    # read, damaged frames, and the unreadable rest of a segment after one.
    missing_records: int = 0
    missing_segments: int = 0  # distinct gaps in the segment sequence (deleted segments)


class LogReader:
    """Reads a log directory, possibly while a LocalLog in another process appends to it.

    Not thread-safe: use one reader per thread.
    """

    def __init__(self, directory: Path) -> None:
        self._dir = directory
        self.stats = ReaderStats()
        self._segments: dict[int, SegmentState] = {}
        self._reported_corrupt: set[tuple[int, int, int]] = set()
        self._reported_missing: list[tuple[int, int]] = []  # disjoint, sorted [lo, hi)
        self._segment_gaps: dict[int, int] = {}  # where a gap ends -> where it starts

    def read(self, from_offset: int, max_records: int = 1000) -> list[LogRecord]:
        """Up to `max_records` valid records in offset order, starting at `from_offset`.

        Starts at the oldest record still on disk if `from_offset` was deleted, passes over
        damaged frames to the next valid one, and skips the rest of a sealed segment when no
        valid frame follows; every gap is counted in stats. A bad or partial frame at the end
        of the newest segment ends the read without counting anything: it is either still
        being written, or a torn tail the writer truncates when it next opens (or skipped as
        corrupt once the writer has moved on to a newer segment).
        """
        if from_offset < 0:
            raise ValueError("from_offset must be >= 0")
        if max_records < 1:
            raise ValueError("max_records must be >= 1")
        out: list[LogRecord] = []
        want = from_offset
        bases = self._list()
        while bases:
            if want < bases[0]:
                self._report_segment_gap(want, bases[0])
                want = bases[0]
            i = bisect.bisect_right(bases, want) - 1
            base = bases[i]
            newest = i == len(bases) - 1
            upper = None if newest else bases[i + 1]
            end = self._read_segment(base, want, max_records, out, upper)
            if out:
                want = out[-1].offset + 1
            if len(out) >= max_records:
                break
            if end is None:  # deleted underneath us
                bases = [b for b in self._list() if b != base]
                continue
            if newest:
                if out:
                    break  # the caller polls again; no need to look for a newer segment now
                # Only a newer segment proves the writer is done with this one; without it,
                # a partial frame at the end is one that is still being written.
                fresh = self._list()
                if fresh and fresh[-1] > base:
                    bases = fresh
                    continue
                break
            next_base = bases[i + 1]
            if not end.clean:
                self._report_corrupt(base, end.pos, end.offset)
                self._report_missing(max(want, end.offset), next_base)
            elif end.offset < next_base:
                self._report_segment_gap(max(want, end.offset), next_base)
            want = max(want, next_base)
        return out

    def first_offset(self) -> int:
        """The oldest offset the log still holds (segments below it were deleted), or 0."""
        bases = self._list()
        return bases[0] if bases else 0

    def end_offset(self) -> int:
        """The offset the next appended record will get, as far as the disk shows."""
        while True:
            bases = self._list()
            if not bases:
                return 0
            opened = self._open(bases[-1])
            if opened is None:
                continue
            f, state, size = opened
            end = ScanEnd()
            with f:
                for _ in self._walk(f, state, size, state.frontier_pos, state.frontier_offset, end):
                    pass
            return end.offset

    def torn_tail(self) -> int:
        """Bytes at the end of the newest segment that hold no valid frame: a record being
        written right now, or one torn by a crash or a full disk (the caller tells them apart
        by asking again later)."""
        bases = self._list()
        if not bases:
            return 0
        opened = self._open(bases[-1])
        if opened is None:
            return 0
        f, state, size = opened
        end = ScanEnd()
        with f:
            for _ in self._walk(f, state, size, state.frontier_pos, state.frontier_offset, end):
                pass
        return 0 if end.clean else size - end.pos

    def offset_for_time(self, timestamp_ms: int) -> int:
        """The earliest offset whose timestamp is >= `timestamp_ms`, or end_offset() if none.

        Timestamps are not assumed to be ordered, so every segment that may hold such a record
        is searched in order; a segment whose largest timestamp is smaller is skipped.
        """
        bases = self._list()
        for i, base in enumerate(bases):
            opened = self._open(base)
            if opened is None:
                continue
            f, state, size = opened
            pos, offset = 0, base
            if state.max_timestamp_ms is None or state.max_timestamp_ms < timestamp_ms:
                pos, offset = state.frontier_pos, state.frontier_offset
            end = ScanEnd()
            upper = bases[i + 1] if i < len(bases) - 1 else None
            with f:
                for _, at, ts, _, _, _, _ in self._walk(
                    f, state, size, pos, offset, end, upper, verify_from=state.frontier_offset
                ):
                    if ts >= timestamp_ms:
                        return at
            if not end.clean and upper is not None:
                self._report_corrupt(base, end.pos, end.offset)
        return self.end_offset()

    def commit(self, group: str, offset: int, metadata: str = "") -> None:
        """Record that `group` has consumed everything below `offset`.

        The checkpoint file is replaced atomically: after a crash it holds the old or the new
        checkpoint. The writer keeps every segment that any group still needs.
        """
        if offset < 0:
            raise ValueError("offset must be >= 0")
        store_checkpoint(checkpoint_path(self._dir, group), group, Checkpoint(offset, metadata))

    def committed(self, group: str) -> tuple[int, str] | None:
        """The (offset, metadata) last committed by `group`, or None if it never committed.
        Raises CorruptCheckpointError for a checkpoint file that cannot be decoded."""
        checkpoint = load_checkpoint(checkpoint_path(self._dir, group))
        return None if checkpoint is None else (checkpoint.offset, checkpoint.metadata)

    def _list(self) -> list[int]:
        bases = list_segments(self._dir)
        for base in [b for b in self._segments if b not in bases]:
            del self._segments[base]
        return bases

    def _open(self, base: int) -> tuple[BinaryIO, SegmentState, int] | None:
        try:
            f = open(self._dir / segment_name(base), "rb")  # noqa: SIM115
        except FileNotFoundError:
            self._segments.pop(base, None)
            return None
        st = os.fstat(f.fileno())
        state = self._segments.get(base)
        # A new inode or a file shorter than what we verified is not the file we knew.
        if state is None or state.inode != st.st_ino or st.st_size < state.frontier_pos:
            state = SegmentState(base, st.st_ino)
            self._segments[base] = state
        return f, state, st.st_size

    def _walk(
        self,
        f: BinaryIO,
        state: SegmentState,
        size: int,
        pos: int,
        offset: int,
        end: ScanEnd | None = None,
        upper: int | None = None,
        *,
        verify_from: int | None = None,
    ) -> Iterator[Frame]:
        base = state.base

        def damaged(bad_pos: int, bad_offset: int, _pos: int, next_offset: int) -> None:
            self._report_corrupt(base, bad_pos, bad_offset)
            self._report_missing(bad_offset, next_offset)

        return walk_frames(
            f,
            size,
            pos,
            offset,
            offset if verify_from is None else verify_from,
            end if end is not None else ScanEnd(),
            state,
            upper,
            damaged,
        )

    def _read_segment(
        self, base: int, want: int, max_records: int, out: list[LogRecord], upper: int | None
    ) -> ScanEnd | None:
        """Append records >= `want` of one segment to `out`; None if the segment is gone."""
        opened = self._open(base)
        if opened is None:
            return None
        f, state, size = opened
        pos, offset = state.start_for(want)
        end = ScanEnd()
        verify_from = min(want, state.frontier_offset)
        with f:
            for file_pos, at, ts, key_len, buf, p, n in self._walk(
                f, state, size, pos, offset, end, upper, verify_from=verify_from
            ):
                if at < want:
                    continue
                key_at = p + FRAME_OVERHEAD
                value_at = key_at + key_len
                out.append(LogRecord(at, ts, buf[key_at:value_at], buf[value_at : p + n]))
                if len(out) >= max_records:
                    state.cursor_offset, state.cursor_pos = at + 1, file_pos + n
                    break
            else:
                state.cursor_offset, state.cursor_pos = end.offset, end.pos
        return end

    def damage_in(self, lo: int, hi: int) -> ReaderStats:
        """The damage found so far at offsets in [lo, hi) (`stats` is all of it): what a
        reader that needed only those offsets passed over."""
        return ReaderStats(
            corrupt_frames=sum(lo <= offset < hi for _, _, offset in self._reported_corrupt),
            missing_records=sum(max(0, min(b, hi) - max(a, lo)) for a, b in self._reported_missing),
            missing_segments=sum(a < hi and b > lo for b, a in self._segment_gaps.items()),
        )

    def _report_corrupt(self, base: int, pos: int, offset: int) -> None:
        key = (base, pos, offset)
        if key not in self._reported_corrupt:
            self._reported_corrupt.add(key)
            self.stats.corrupt_frames += 1

    def _report_segment_gap(self, lo: int, hi: int) -> None:
        # Keyed by where the gap ends (the next segment): reading into the same gap from
        # different offsets counts it once.
        if hi > lo and hi not in self._segment_gaps:
            self._segment_gaps[hi] = lo
            self.stats.missing_segments += 1
        self._report_missing(lo, hi)

    def _report_missing(self, lo: int, hi: int) -> None:
        """Count the offsets in [lo, hi) not counted before (callers may retry the same gap)."""
        if hi <= lo:
            return
        new = hi - lo
        kept: list[tuple[int, int]] = []
        merged_lo, merged_hi = lo, hi
        for a, b in self._reported_missing:
            if b < lo or a > hi:
                kept.append((a, b))
                continue
            new -= max(0, min(b, hi) - max(a, lo))
            merged_lo, merged_hi = min(merged_lo, a), max(merged_hi, b)
        kept.append((merged_lo, merged_hi))
        kept.sort()
        self._reported_missing = kept
        self.stats.missing_records += new
