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
did: `Aggregator.idle(now_ms)` (the service calls it with the source's own newest record time
moved on by the time it was seen at its end: `aggregate/silence.py`) has the same effect as the
source's next record would have.

The watermark never goes back: before a node joins (or rejoins) and lowers the minimum, the
progress so far is kept. So the watermark is a function of the input read so far, whatever
the batching, and nothing depends on when `advance()` is called for input within the lateness.

Restarts: a restart reads again from `needed_offsets()` with no progress of its own, and knows a
node only once it reads an event of it. A node silent there (its collector's spool filling while
the others' events move on) held this run back, but would not hold the restart back: the
restart would close windows this run kept open for it, and bill its spool, drained later, as
late. So each node remembers the silences through which it held back a progress that could
otherwise have passed it, and the restart offset is moved out of them and out of every active
node's silence since its last event (`held_back`). A restart that read from after the active
node read last while every node read after it turned idle would know only idle nodes, and its
progress would jump past their newest event as an all-idle source's does: that node's silence
counts too (`_Node.jumped`). A silence ends with the node's next event
that is no longer behind (so a drained spool is part of its outage) or when the node turned
idle (an idle node holds nothing back); one that ended more than `max_skew_ms` +
`idle_extra_ms` - `lateness_ms` of record time before the closed end is forgotten (`forget`).

Future events: with `record_ts_ms` (the transport's record time) given, an event whose ts is more
than `max_skew_ms` after it is dropped and counted in `stats.future_events` (and per node). It
only ever counts against its own node: it is never part of any node's progress. It is a
comparison of two recorded times, never the wall clock.
"""

from __future__ import annotations

import heapq

from .settings import NEVER

__all__ = ["Progress"]


class _Node:
    """One node's progress in a source: newest event ts, newest record ts, active or idle; and,
    for restarts, its last event and its silences (see `Progress.held_back`)."""

    __slots__ = ("active", "jumped", "last", "rec", "silences", "top")

    def __init__(self, top: int, rec: int, last: int) -> None:
        self.top = top
        self.rec = rec
        self.active = True
        self.last = last  # offset of its last event that counted (-1: not read from a source)
        # (offset of its last event before, of its last event read while still passed or of
        # the first offset read once it turned idle, the source's record time then): the
        # silences through which it held back a progress that could otherwise have passed it
        # (`_Source.passes`), one per outage (`_silence`)
        self.silences: list[tuple[int, int, int]] = []
        # Since its last event, the nodes read after it all turned idle while it was still
        # active: a restart that did not know it could have jumped past it (`_turn_idle`).
        self.jumped = False


def _silence(n: _Node, end: int, rec: int) -> None:
    """Node `n` was silent from its last event to offset `end` (the source's record time then
    `rec`). One that goes on from where the one before ended (its spool drained one event at a
    time, each still behind) extends it: one entry per outage."""
    if n.silences and n.silences[-1][1] == n.last:
        n.silences[-1] = (n.silences[-1][0], end, rec)
    else:
        n.silences.append((n.last, end, rec))


class _Source:
    __slots__ = (
        "active", "due", "floor", "idle_lasts", "latest", "latest_at", "low", "newest",
        "next_idle", "next_offset", "nodes", "rec", "recorded", "silent_at",
    )  # fmt: skip

    def __init__(self, next_offset: int) -> None:
        self.next_offset = next_offset
        self.rec = -NEVER  # newest record time (the event ts where the transport gives none)
        self.recorded = -NEVER  # newest record time the transport gave
        self.newest = -NEVER  # newest event ts of any node
        self.floor = -NEVER  # progress kept before a node joined (see the module docstring)
        self.next_idle = NEVER  # the earliest record time at which an active node turns idle
        self.silent_at = -NEVER  # the record time its silence has come to (`Progress.idle`)
        self.nodes: dict[str, _Node] = {}
        # Kept so that a partition written under many node names (most of them idle) costs
        # per event what one of few nodes does, not a look at every node it has seen:
        self.active: dict[str, _Node] = {}  # the nodes active now
        self.low: int | None = NEVER  # the smallest top of `active` (NEVER: none), None: unknown
        # (-last, name) of nodes as they turned idle: a heap whose first entry that is still
        # an idle node's last event is the largest such (see `_idle_after`)
        self.idle_lasts: list[tuple[int, str]] = []
        # (record time it turns idle at, name) of each active node: a heap, its first entry
        # exact after `_turn_idle`, the others at or before their node's time
        self.due: list[tuple[int, str]] = []
        self.latest: _Node | None = None  # the node of the largest offset read (`_turn_idle`)
        self.latest_at = -1  # that offset

    def top(self, idle_extra: int, behind: int) -> int:
        """The source's progress: the smallest newest ts of its active nodes, at most `behind`
        before the newest record time, never below what it was; with every node idle, past the
        newest event by `idle_extra`."""
        if not self.nodes:
            return self.floor
        low = self.low
        if low is None:
            low = NEVER
            for n in self.active.values():
                if n.top < low:
                    low = n.top
            self.low = low
        if low == NEVER:
            low = self.newest + idle_extra
        elif self.recorded != -NEVER and self.recorded - behind < low:
            low = self.recorded - behind
        return low if low > self.floor else self.floor

    def passes(self, top: int, behind: int, lateness: int) -> bool:
        """Whether a progress that did not know a node could close windows past `top`, its
        newest ts: such a progress is at most the newest event, and at most `behind` before
        the newest record time. (A node that sends every 30 s while the others send every
        second is never passed, with the defaults: 300 s behind the newest record time.)"""
        bound = self.newest
        if self.recorded != -NEVER and self.recorded - behind < bound:
            bound = self.recorded - behind
        return bound - lateness > top

    def idle_after(self, last: int) -> bool:
        """Whether an idle node's last event is after offset `last`."""
        heap, nodes = self.idle_lasts, self.nodes
        while heap:
            neg, name = heap[0]
            n = nodes[name]
            if not n.active and n.last == -neg:
                return -neg > last
            heapq.heappop(heap)  # active again since, or idle again with a later last event
        return False


class Progress:
    """Per source: the offset after the last one added, and each node's progress."""

    __slots__ = ("_idle", "_idle_extra", "_lateness", "_reach", "_skew", "_src", "future_by_node")

    def __init__(
        self, max_skew_ms: int, idle_ms: int, idle_extra_ms: int, lateness_ms: int
    ) -> None:
        self._skew = max_skew_ms
        self._idle = idle_ms
        self._lateness = lateness_ms
        # A silence that ended at source record time R can still matter to a restart while a
        # restart's progress before R could pass the closed end: that progress is at most R +
        # max_skew + idle_extra (an all-idle source), and closes windows `lateness` behind.
        self._reach = max_skew_ms + idle_extra_ms - lateness_ms
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

    def event(self, source: int, node: str, ts: int, record_ts_ms: int | None, offset: int) -> int:
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
                self._turn_idle(s, rec, offset)
        n = s.nodes.get(node)
        if (
            n is not None
            and n.active
            and offset >= 0 <= n.last
            and (n.jumped or s.passes(n.top, self._skew, self._lateness))
        ):
            _silence(n, offset, s.rec)  # it held the source back through it
        if n is None or not n.active:
            # Joining lowers the minimum: keep what the others had reached first.
            s.floor = s.top(self._idle_extra, self._skew)
            if n is None:
                n = s.nodes[node] = _Node(ts, rec, offset)
            else:
                n.active = True
                if ts > n.top:
                    n.top = ts
            s.active[node] = n
            heapq.heappush(s.due, (rec + self._idle, node))
            if s.low is not None and n.top < s.low:
                s.low = n.top
        elif ts > n.top:
            if n.top == s.low:
                s.low = None  # (the smallest may have moved up)
            n.top = ts
        if offset >= 0:
            n.last = offset
            n.jumped = False
            if offset > s.latest_at:
                s.latest, s.latest_at = n, offset
        if ts > s.newest:
            s.newest = ts
        if rec > n.rec:
            n.rec = rec
        if n.rec + self._idle < s.next_idle:
            s.next_idle = n.rec + self._idle
        return n.top if n.top > s.floor else s.floor

    def idle(self, now_ms: int) -> None:
        """Record time `now_ms` has come (`aggregate/silence.py`): nodes of a source silent for
        longer than the idle time turn idle, exactly as at the source's next record."""
        for s in self._src.values():
            if now_ms > s.silent_at:
                s.silent_at = now_ms
            at = now_ms - self._lead(s)
            if at >= s.next_idle:
                self._turn_idle(s, at, s.next_offset)

    def _lead(self, s: _Source) -> int:
        """How far the source's newest record time is ahead of the earliest newest record time
        of its nodes active as of it. `now_ms` is that newest record time moved on by the
        silence, but each node's next record comes no sooner than its own last one moved on by
        the silence: when the newest came from a node whose clock runs ahead, the next record
        (of a node behind it) carries an earlier time than `now_ms`, and the nodes that time
        leaves active stay so at it. Taking the lead away keeps the silence's closes to those
        that record makes (a replay's), as the module docstring says. A node idle before the
        silence, or one not seen yet, is not bounded so."""
        if s.rec == -NEVER:
            return 0
        low = s.rec
        for n in s.nodes.values():
            if n.rec < low and n.rec + self._idle > s.rec:
                low = n.rec
        return s.rec - low

    def _turn_idle(self, s: _Source, rec: int, offset: int) -> None:
        """Nodes silent for `idle_ms` of record time `rec` turn idle; `offset`: the first
        offset read with them idle."""
        idle, due, nodes = self._idle, s.due, s.nodes
        while due and due[0][0] <= rec:
            _, name = heapq.heappop(due)
            n = nodes[name]
            if n.rec + idle > rec:  # (it has sent since the entry was made)
                heapq.heappush(due, (n.rec + idle, name))
                continue
            n.active = False
            del s.active[name]
            if n.top == s.low:
                s.low = None
            heapq.heappush(s.idle_lasts, (-n.last, name))
            if n.last >= 0 and (n.jumped or s.passes(n.top, self._skew, self._lateness)):
                _silence(n, offset, rec)
        while due and nodes[due[0][1]].rec + idle != due[0][0]:
            name = heapq.heappop(due)[1]
            heapq.heappush(due, (nodes[name].rec + idle, name))
        s.next_idle = due[0][0] if due else NEVER
        if len(s.idle_lasts) > 2 * (len(nodes) - len(s.active)) + 64:
            # (entries of nodes active again, or idle again since, are dropped only when they
            # come first: without this a node that comes and goes would grow it for good)
            s.idle_lasts = [(-n.last, k) for k, n in nodes.items() if not n.active]
            heapq.heapify(s.idle_lasts)
        # A restart that read from after the last event of the active node read last knows
        # none but nodes idle now: its progress jumps past their newest event (`top`), and
        # can pass that node, which this run's progress waits for. (That node is the one of
        # the largest offset read, unless it is idle or a rewind read it again since.)
        last = s.latest
        if last is None or not last.active or last.last != s.latest_at:
            last = None
            for n in s.active.values():
                if n.last >= 0 and (last is None or n.last > last.last):
                    last = n
        if (
            last is not None
            and s.newest + self._idle_extra - self._lateness > last.top
            and s.idle_after(last.last)
        ):
            last.jumped = True

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
        """The largest event ts of `source`, or the record time its silence has come to, if
        later: what the OTLP gauges take for now (a source whose only node stopped sending kept
        that node's gauges, its limits among them, at their last values for good)."""
        s = self._src[source]
        return s.newest if s.newest > s.silent_at else s.silent_at

    def held_back(self, need: dict[int, int]) -> None:
        """Lower each source's restart offset in `need` out of every silence of a node that
        held the source back through it, to that node's last event before: so the restart
        knows the node there and is held back by it as this run was. Otherwise the restart's
        progress would pass the node's, and close windows this run kept open for it: the
        node's events read after (a spool drained after an outage, with its old times) would
        be late there and in time here. A past silence counts when a progress that did not
        know the node could have passed it (`_Source.passes`); every active node's silence
        since its last event counts, since it may go on after the restart. Lowering the
        offset can put it inside another silence: repeated until it is in none."""
        for source, s in self._src.items():
            r = need.get(source)
            if r is None:
                continue
            spans: list[tuple[int, int, int]] = []
            for n in s.nodes.values():
                spans += n.silences
                if n.active and n.last >= 0:
                    # silent from here, maybe past the restart: every active node's
                    spans.append((n.last, NEVER, NEVER))
            lowered = True
            while lowered:
                lowered = False
                for first, end, _ in spans:
                    if first < r < end:
                        r = first
                        lowered = True
            need[source] = r

    def forget(self, closed: int) -> None:
        """Forget the silences no restart needs any more: those that ended before a restart's
        progress could pass `closed`, the end of the windows closed."""
        reach = self._reach
        for s in self._src.values():
            for n in s.nodes.values():
                if n.silences:
                    n.silences = [x for x in n.silences if x[2] + reach > closed]

    def next_offsets(self) -> dict[int, int]:
        """Per source, sorted: the offset after the last one added."""
        return {src: s.next_offset for src, s in sorted(self._src.items())}
