"""Collector incarnations (node, inc): de-duplication and the rule that a newer one supersedes.

Duplicates
----------
(node, inc, seq) identifies an event. Per (node, inc) the aggregator keeps the highest seq seen
and the set of seqs from `highest - DEDUP_WINDOW` (10 000) on. An event seen before is dropped and
counted in `stats.duplicates`; so is an event more than `DEDUP_WINDOW` sequence numbers behind the
newest of its incarnation (that far behind it is a redelivery, not reordering). An event more than
`DEDUP_WINDOW` ahead of the newest is the newest only once the seq before it is seen too (a
collector that dropped that many events sends on from there), and so is the first seq seen of an
incarnation (a new one, or one a restart or replay reads again): one alone is admitted and
remembered but moves nothing (a single corrupt seq of 10 000 000 made every later event of its
incarnation a "duplicate": half a stream's records lost). The state of an
incarnation is forgotten once a newer one exists, it has no containers left, and its last event
is more than max_gap + lateness + one window behind the closed end; a redelivery after that is
no longer recognised (it is then late, or an event of a container that is not named), but the
node remembers the last `FORGOTTEN_PER_NODE` incarnations it forgot: one that comes back is the
oldest of the node, never the newest (a redelivered event of a collector that overlapped a newer
one would otherwise take the node over from the collector still running).

A node's newest incarnation is **retired** the same way once it is the node's only one left
(a node that left the cluster, a collector silent that long): no containers, last event past
that horizon. Its de-duplication state goes (a redelivery is then not recognised, as above);
only its first and last event times stay, per node, and come back as the node's newest
incarnation with the node's next event, so which incarnation is newer is decided exactly as
if it had been kept.

Supersession
------------
A collector restart starts a new `inc` on the same node, and the old one never says goodbye. The
first event of a newer incarnation (one whose first event time is later; of two that began in the
same millisecond, the larger `inc`) ends every container of the older ones of that node at that
time: `Incarnations.cut` gives that time, the window close puts it on the old containers'
timelines.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections import deque
from typing import Final

from .settings import NEVER

__all__ = ["DEDUP_WINDOW", "Incarnation", "Incarnations"]

DEDUP_WINDOW: Final = 10_000
FORGOTTEN_PER_NODE: Final = 64


class Incarnation:
    """One collector incarnation (node, inc): de-duplication state and its event-time span.

    Per incarnation the highest seq seen and the set of seqs above `highest - DEDUP_WINDOW`."""

    __slots__ = ("first_ts", "hwm", "last_ts", "seqs", "starts")

    def __init__(self) -> None:
        self.hwm = -1
        self.seqs: set[int] = set()
        self.first_ts = NEVER
        self.last_ts = -NEVER
        # (ts, effective time) of each event that lowered `first_ts`, in the order admitted (the
        # effective time is the end the input let close when it came late): where each start
        # takes effect on the predecessor. An earlier start read first stays in effect when an
        # earlier one still comes late (else a drain, which reads both before closing, cut the
        # predecessor only where the late one took effect).
        self.starts: list[tuple[int, int]] = []

    def prune(self) -> None:
        low = self.hwm - DEDUP_WINDOW
        seqs = {s for s in self.seqs if s >= low}
        if len(seqs) > 2 * DEDUP_WINDOW:
            seqs = {s for s in seqs if s <= self.hwm}  # (lone seqs far ahead: no longer known)
        self.seqs = seqs

    def seen_before(self, seq: int) -> bool:
        """For a seq at or below the highest one (the caller handles the common case)."""
        if seq < self.hwm - DEDUP_WINDOW or seq in self.seqs:
            return True
        self.seqs.add(seq)
        return False


class Incarnations:
    """Every incarnation the aggregator knows, by (node, inc) and grouped by node."""

    __slots__ = ("_by_node", "_forgotten", "_incs", "_order", "_retired", "lowered", "several")

    def __init__(self) -> None:
        self._incs: dict[tuple[str, int], Incarnation] = {}
        self._by_node: dict[str, dict[int, Incarnation]] = {}
        # Per node, (first_ts, inc) of its incarnations in order: the successor of one is the
        # next (a scan of them all for every event was quadratic in a node's incarnations).
        self._order: dict[str, list[tuple[int, int]]] = {}
        self._forgotten: dict[str, deque[int]] = {}  # per node, the incarnations last forgotten
        # per node whose incarnations are all forgotten: (inc, first_ts, last_ts) of its newest
        self._retired: dict[str, tuple[int, int, int]] = {}
        # Nodes with more than one incarnation: only their events can be cut or overlap, so the
        # per-event checks ask this set first.
        self.several: set[str] = set()
        # The incarnation whose `first_ts` the last `admit` lowered: its caller adds the start
        self.lowered: Incarnation | None = None

    def admit(self, node: str, inc: int, seq: int, ts: int) -> bool:
        """Record event (node, inc, seq) at `ts`; False when it is a duplicate (nothing
        recorded then)."""
        self.lowered = None
        incarnation = self._incs.get((node, inc))
        if incarnation is None and node in self._retired:
            self._restore(node)
            incarnation = self._incs.get((node, inc))
        if incarnation is None:
            incarnation = self._incs[(node, inc)] = Incarnation()
            if inc in self._forgotten.get(node, ()):
                incarnation.first_ts = -NEVER  # back after it was forgotten: the oldest
            insort(self._order.setdefault(node, []), (incarnation.first_ts, inc))
            incs = self._by_node.setdefault(node, {})
            incs[inc] = incarnation
            if len(incs) > 1:
                self.several.add(node)
        seqs = incarnation.seqs
        hwm = incarnation.hwm
        if seq > hwm:
            if seq in seqs:
                return False  # a lone seq (below) again
            if hwm >= 0 and seq - hwm <= DEDUP_WINDOW or seq - 1 in seqs:
                incarnation.hwm = seq
            # else a lone seq: far ahead of the newest, or the first of its incarnation seen,
            # whose predecessor is not seen yet; admitted and remembered, it moves nothing
            seqs.add(seq)
            if len(seqs) > 2 * DEDUP_WINDOW:
                incarnation.prune()
        elif incarnation.seen_before(seq):
            return False
        if ts < incarnation.first_ts:
            order = self._order[node]
            del order[bisect_left(order, (incarnation.first_ts, inc))]
            incarnation.first_ts = ts
            insort(order, (ts, inc))
            self.lowered = incarnation
        if ts > incarnation.last_ts:
            incarnation.last_ts = ts
        return True

    def starts(self, node: str, inc: int) -> list[tuple[int, int]]:
        """(node, inc)'s starts as `Incarnation.starts` (none when unknown)."""
        incarnation = self._incs.get((node, inc))
        return [] if incarnation is None else incarnation.starts

    def successor(self, node: str, inc: int) -> tuple[int, int | None]:
        """(first event time, inc) of the earliest newer incarnation of `node`, or
        (NEVER, None)."""
        incs = self._by_node.get(node)
        if incs is None or len(incs) < 2:
            return NEVER, None
        mine = incs.get(inc)
        if mine is None:
            return NEVER, None
        order = self._order[node]
        at = bisect_right(order, (mine.first_ts, inc))
        if at == len(order):
            return NEVER, None
        first_ts, newer = order[at]
        return first_ts, newer

    def prune(self, live: set[tuple[str, int]], horizon: int) -> list[tuple[str, int]]:
        """Forget the older incarnations with no containers (`live` has those that have one)
        whose last event is before `horizon`, and retire a node's last one on the same terms.
        Returns the (node, inc) forgotten or retired."""
        gone: list[tuple[str, int]] = []
        for node, incs in self._by_node.items():
            if len(incs) > 1:
                newest = max(incs, key=lambda i: (incs[i].first_ts, i))
                for inc in [i for i in incs if i != newest and (node, i) not in live]:
                    if incs[inc].last_ts < horizon:
                        self._forget(node, inc)
                        gone.append((node, inc))
                if len(incs) < 2:
                    self.several.discard(node)
            if len(incs) == 1:
                inc = next(iter(incs))
                if (node, inc) not in live and incs[inc].last_ts < horizon:
                    self._retire(node, inc)
                    gone.append((node, inc))
        for node in [n for n, incs in self._by_node.items() if not incs]:
            del self._by_node[node]
        return gone

    def _retire(self, node: str, inc: int) -> None:
        """Forget the node's last incarnation but for its place among the node's (`_restore`)."""
        last = self._by_node[node].pop(inc)
        del self._incs[(node, inc)]
        del self._order[node]  # (its only one)
        self._retired[node] = (inc, last.first_ts, last.last_ts)

    def _forget(self, node: str, inc: int) -> None:
        gone = self._by_node[node].pop(inc)
        del self._incs[(node, inc)]
        order = self._order[node]
        del order[bisect_left(order, (gone.first_ts, inc))]
        forgotten = self._forgotten.setdefault(node, deque(maxlen=FORGOTTEN_PER_NODE))
        forgotten.append(inc)

    def _restore(self, node: str) -> None:
        """The node sends again: its retired newest incarnation is back in the order of its
        incarnations (with no de-duplication state)."""
        inc, first_ts, last_ts = self._retired.pop(node)
        incarnation = Incarnation()
        incarnation.first_ts = first_ts
        incarnation.last_ts = last_ts
        self._incs[(node, inc)] = incarnation
        self._by_node[node] = {inc: incarnation}
        self._order[node] = [(first_ts, inc)]
