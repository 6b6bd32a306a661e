"""Damaged input, found and said: never a silently different bill.

What a consumer (aggregate, replay, demo) can tell about its input besides the events:
* from the stream alone (so the Kafka path too): gaps in a collector incarnation's `seq`. One
  node's events live in one partition (and one local log) in the collector's own order, so a
  seq beyond the highest one seen + 1 means events went missing in between: dropped by the
  collector (its heartbeats say how many: `dropped`), or lost on the way. The first seq seen of
  an incarnation is where this reader came in, not a gap; so is the first one after a partition
  was assigned to this reader again (`forget_source`: another replica read what lies between).
  But an incarnation of a node this reader already read from that source began after it came
  in: seqs below its first one seen were lost (a collector restarted on a full disk), unless
  another incarnation of the node sends after it (two collectors live under one node name,
  both already running when the reader came in): that gap is taken back.
* from the local log: damaged frames passed over, deleted segments, records skipped, and a torn
  tail (the newest segment ends inside a frame and stays that way).

`DamageReport.line()` is the one summary line; `damaged` says whether any of it happened.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from ..events import Event, Heartbeat

EXIT_DAMAGED = 3  # aggregate --drain / replay: records written, but the input was damaged
EXIT_CHECKPOINT = 4  # a consumer checkpoint that cannot be used: nothing was done


class CheckpointError(Exception):
    """A consumer checkpoint that is unreadable or points past the end of its input; the
    message is one line for stderr."""


@dataclass
class _Incarnation:
    highest: int


@dataclass
class DamageReport:
    corrupt_frames: int = 0
    missing_records: int = 0  # local-log offsets skipped (damaged frames, deleted segments)
    missing_segments: int = 0
    torn_tail_bytes: int = 0
    seq_gaps: int = 0  # places where an incarnation's seq jumped
    seq_missing: int = 0  # events missing in those gaps
    # (source, node, inc): a node's events are in one source, read in its order
    _incs: dict[tuple[int, str, int], _Incarnation] = field(default_factory=dict)
    _nodes: set[tuple[int, str]] = field(default_factory=set)  # (source, node) read so far
    # (source, node) -> (inc, seqs) of a gap counted at the head of its newest incarnation
    _heads: dict[tuple[int, str], tuple[int, int]] = field(default_factory=dict)
    # (source, node, inc) -> the largest `dropped` its heartbeats reported; kept when a source
    # is forgotten (what the collector said it dropped stays said)
    _dropped: dict[tuple[int, str, int], int] = field(default_factory=dict)

    def see(self, node: str, event: Event, source: int = 0) -> None:
        """Every decoded event, in the order of its partition (duplicates included)."""
        self.see_seq(node, event.inc, event.seq, source)
        if isinstance(event, Heartbeat) and event.dropped:
            key = (source, node, event.inc)
            if event.dropped > self._dropped.get(key, 0):
                self._dropped[key] = event.dropped

    def see_seq(self, node: str, inc: int, seq: int, source: int = 0) -> _Incarnation:
        """`see` for an event known by its (inc, seq) alone (not a heartbeat)."""
        key = (source, node, inc)
        known = self._incs.get(key)
        if self._heads:
            self._interleaved(source, node, inc)
        if known is None:
            known = self._incs[key] = _Incarnation(seq)
            if seq > 0 and (source, node) in self._nodes:
                self.seq_gaps += 1  # it began after this reader came in: its head was lost
                self.seq_missing += seq
                self._heads[(source, node)] = (inc, seq)
            else:
                self._heads.pop((source, node), None)
            self._nodes.add((source, node))
        elif seq > known.highest:
            if seq > known.highest + 1:
                self.seq_gaps += 1
                self.seq_missing += seq - known.highest - 1
            known.highest = seq
        return known

    def _interleaved(self, source: int, node: str, inc: int) -> None:
        """An event of `inc`: if a gap was counted at the head of another, newer incarnation of
        the node, both send side by side, and that one was running before the reader came in."""
        head = self._heads.get((source, node))
        if head is not None and head[0] != inc and (source, node, inc) in self._incs:
            self.seq_gaps -= 1
            self.seq_missing -= head[1]
            del self._heads[(source, node)]

    @contextmanager
    def uncounted(self) -> Iterator[None]:
        """Events seen inside were seen and counted before (read again by the same process):
        the gaps they count are taken back; their seqs stay seen."""
        before = (self.seq_gaps, self.seq_missing)
        # The head gaps stand for counted gaps: one counted inside is taken back with it, and
        # one taken back inside (its incarnation seen alongside) is counted again.
        heads = dict(self._heads)
        try:
            yield
        finally:
            self.seq_gaps, self.seq_missing = before
            self._heads = heads

    def forget_source(self, source: int) -> None:
        """`source` is read from a new position (a partition assigned again: what lies between
        was read by another replica): where this reader comes in again is not a gap. The gaps
        and drops counted so far stay counted."""
        for key in [k for k in self._incs if k[0] == source]:
            del self._incs[key]
        self._nodes = {k for k in self._nodes if k[0] != source}
        self._heads = {k: v for k, v in self._heads.items() if k[0] != source}

    @property
    def dropped_by_collectors(self) -> int:
        return sum(self._dropped.values())

    @property
    def damaged(self) -> bool:
        return bool(
            self.corrupt_frames
            or self.missing_records
            or self.missing_segments
            or self.torn_tail_bytes
            or self.seq_gaps
        )

    def counts(self) -> tuple[int, int, int, int, int, int]:
        return (
            self.corrupt_frames,
            self.missing_records,
            self.missing_segments,
            self.torn_tail_bytes,
            self.seq_gaps,
            self.seq_missing,
        )

    def line(self) -> str:
        if not self.damaged:
            return "damage: none"
        return (
            f"damage: corrupt_frames={self.corrupt_frames} "
            f"missing_records={self.missing_records} "
            f"missing_segments={self.missing_segments} "
            f"torn_tail_bytes={self.torn_tail_bytes} "
            f"seq_gaps={self.seq_gaps} seq_missing={self.seq_missing} "
            f"(collectors reported {self.dropped_by_collectors} dropped)"
        )
