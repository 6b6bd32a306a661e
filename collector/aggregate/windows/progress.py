"""Event-time progress: per node inside each source (Kafka partition or local log), the
watermark, and the next offset to read.

Many nodes share a source, and their clocks differ (by up to `max_skew_ms` from the record
times, either way). So no node's clock decides for another: a source's progress is the
**smallest** newest event ts over its *active* nodes, and never more than `max_skew_ms` before
the newest record time (so a node whose clock is behind by that much, joining at any moment,
still finds its windows open); the watermark is the smallest over the sources, minus
`lateness_ms`. A node ahead of the others only waits for them; a node behind holds the source
back instead of having its events declared late. With record times, a window therefore closes
`max_skew_ms + lateness_ms` after its end in record time. `Aggregator.advance()` closes every
window whose end is at or below the watermark.

Idle rule: a node is **idle** once the source's record time (the largest record timestamp read
from it; the event ts where the transport gives none) is more than `idle_ms` past the node's own
last record time; idle nodes do not hold the source back. A node that sends again is active
again, and its events before the closed end are late. When every node of a source is idle, the
source closes everything: each value runs to its `max_gap_ms` cap, as `flush()` does. Only
record timestamps decide this, never the wall clock, so a replay decides exactly as the live run
did: `Aggregator.idle(now_ms)` (the service calls it with the record time of other traffic, or
the clock when there is none) has the same effect as the source's next record would have.

The watermark never goes back: before a node joins (or rejoins) and lowers the minimum, the
progress so far is kept. So the watermark is a function of the input read so far, whatever
the batching, and nothing depends on when `advance()` is called for input within the lateness.

Future events: with `record_ts_ms` (the transport's record time) given, an event whose ts is more
than `max_skew_ms` after it is dropped and counted in `stats.future_events` (and per node). It
only ever counts against its own node: it is never part of any node's progress. It is a
comparison of two recorded times, never the wall clock.
"""

from __future__ import annotations

from .settings import NEVER

__all__ = ["Progress"]


class _Node:
    """One node's progress in a source: newest event ts, newest record ts, active or idle."""

    __slots__ = ("active", "rec", "top")

    def __init__(self, top: int, rec: int) -> None:
        self.top = top
        self.rec = rec
        self.active = True


class _Source:
    __slots__ = ("floor", "newest", "next_idle", "next_offset", "nodes", "rec", "recorded")

    def __init__(self, next_offset: int) -> None:
        self.next_offset = next_offset
        self.rec = -NEVER  # newest record time (the event ts where the transport gives none)
        self.recorded = -NEVER  # newest record time the transport gave
        self.newest = -NEVER  # newest event ts of any node
        self.floor = -NEVER  # progress kept before a node joined (see the module docstring)
        self.next_idle = NEVER  # the earliest record time at which an active node turns idle
        self.nodes: dict[str, _Node] = {}

    def top(self, idle_extra: int, behind: int) -> int:
        """The source's progress: the smallest newest ts of its active nodes, at most `behind`
        before the newest record time, never below what it was; with every node idle, past the
        newest event by `idle_extra`."""
        if not self.nodes:
            return self.floor
        low = NEVER
        for n in self.nodes.values():
            if n.active and n.top < low:
                low = n.top
        if low == NEVER:
            low = self.newest + idle_extra
        elif self.recorded != -NEVER and self.recorded - behind < low:
            low = self.recorded - behind
        return low if low > self.floor else self.floor


class Progress:
    """Per source: the offset after the last one added, and each node's progress."""

    __slots__ = ("_idle", "_idle_extra", "_skew", "_src", "future_by_node")

    def __init__(self, max_skew_ms: int, idle_ms: int, idle_extra_ms: int) -> None:
        self._skew = max_skew_ms
        self._idle = idle_ms
        # How far past the newest event an all-idle source's progress goes: far enough that
        # every value reaches its cap and the window holding it closes.
        self._idle_extra = idle_extra_ms
        self._src: dict[int, _Source] = {}
        self.future_by_node: dict[str, int] = {}

    def offset(self, source: int, offset: int) -> None:
        """Every record read, whatever becomes of its event."""
        src = self._src.get(source)
        if src is None:
            self._src[source] = _Source(offset + 1)
        elif offset >= src.next_offset:
            src.next_offset = offset + 1

    def too_far_ahead(self, node: str, ts: int, record_ts_ms: int | None) -> bool:
        if record_ts_ms is not None and ts > record_ts_ms + self._skew:
            self.future_by_node[node] = self.future_by_node.get(node, 0) + 1
            return True
        return False

    def event(self, source: int, node: str, ts: int, record_ts_ms: int | None) -> int:
        """An event that counts (after `offset()` for its record). Returns a bound the
        watermark's top is at or below now (the node is active, so its source's progress is
        at most its newest ts, or the progress kept when it joined): an event at or above it
        minus the lateness is in time without asking every source."""
        s = self._src[source]
        if record_ts_ms is None:
            rec = ts
        else:
            rec = record_ts_ms
            if rec > s.recorded:
                s.recorded = rec
        if rec > s.rec:
            s.rec = rec
            if rec >= s.next_idle:
                self._turn_idle(s, rec)
        n = s.nodes.get(node)
        if n is None or not n.active:
            # Joining lowers the minimum: keep what the others had reached first.
            s.floor = s.top(self._idle_extra, self._skew)
            if n is None:
                n = s.nodes[node] = _Node(ts, rec)
            else:
                n.active = True
        if ts > s.newest:
            s.newest = ts
        if ts > n.top:
            n.top = ts
        if rec > n.rec:
            n.rec = rec
        if n.rec + self._idle < s.next_idle:
            s.next_idle = n.rec + self._idle
        return n.top if n.top > s.floor else s.floor

    def idle(self, now_ms: int) -> None:
        """Record time `now_ms` has come (from other traffic): nodes of a source silent for
        longer than the idle time turn idle, exactly as at the source's next record."""
        for s in self._src.values():
            if now_ms >= s.next_idle:
                self._turn_idle(s, now_ms)

    def _turn_idle(self, s: _Source, rec: int) -> None:
        idle = self._idle
        nxt = NEVER
        for n in s.nodes.values():
            if n.active:
                if n.rec + idle <= rec:
                    n.active = False
                elif n.rec + idle < nxt:
                    nxt = n.rec + idle
        s.next_idle = nxt

    def watermark_top(self) -> int | None:
        """The smallest progress over the sources (None before any event counts)."""
        tops = [
            s.top(self._idle_extra, self._skew) for s in self._src.values() if s.newest != -NEVER
        ]
        return min(tops) if tops else None

    def newest(self) -> int | None:
        """The largest event ts of all sources (None before any event counts)."""
        tops = [s.newest for s in self._src.values() if s.newest != -NEVER]
        return max(tops) if tops else None

    def now(self, source: int) -> int:
        """The largest event ts of `source`."""
        return self._src[source].newest

    def next_offsets(self) -> dict[int, int]:
        """Per source, sorted: the offset after the last one added."""
        return {src: s.next_offset for src, s in sorted(self._src.items())}
