"""The node-name guard: two collectors live under one node name are billed once.

A collector restart is a newer incarnation whose events start after the older one's stopped;
the older one's containers end where the newer one starts (`incarnations`). Two collectors that
run at the same time under one node name (a copied DaemonSet, a node name set by hand, two
spools) look the same at first, but the older one keeps sending: events of an incarnation at or
after the first event of a newer incarnation of its node. Those are the overlap. They are not
billed (only the newest incarnation is), they are counted (`stats.overlapping_events`), and each
pair is flagged once (`stats.node_conflicts`, and a `NodeConflict` the service logs), naming both
collectors from their `CollectorStarted` announcements.

An older incarnation's events that arrived before the newer one's first event but lie after it
in event time are taken off its timeline when the newer one's start is put there (at window
close), so they are not billed either; what already fell into closed windows stays billed
(closed windows are never revised).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...events import CollectorStarted
from .incarnations import Incarnations
from .stats import AggregateStats

__all__ = ["NodeConflict", "NodeGuard"]


@dataclass(frozen=True)
class NodeConflict:
    node: str
    older: int  # inc of the incarnation no longer billed
    newer: int
    since_ms: int  # first event time of the newer one: the overlap starts here
    older_is: str  # who: "host H pid P log L", or "unannounced"
    newer_is: str

    def line(self) -> str:
        return (
            f"node {self.node!r}: two collectors send under this node name from {self.since_ms}"
            f" (unix ms): incarnation {self.older} ({self.older_is}) and {self.newer}"
            f" ({self.newer_is}); billing only the newest, {self.newer}"
        )


class NodeGuard:
    __slots__ = ("_counted", "_flagged", "_incs", "_new", "_who", "stats")

    def __init__(self, incs: Incarnations, stats: AggregateStats) -> None:
        self._incs = incs
        self.stats = stats
        self._who: dict[tuple[str, int], str] = {}
        self._flagged: set[tuple[str, int, int]] = set()
        self._new: list[NodeConflict] = []
        # Per (node, inc): the seqs already counted as overlap (an event is on the timeline of
        # each container it states: a heartbeat of three containers is one event, not three).
        self._counted: dict[tuple[str, int], set[int]] = {}

    def announce(self, node: str, event: CollectorStarted) -> None:
        self._who[(node, event.inc)] = f"host {event.host} pid {event.pid} log {event.log}"

    def overlaps(self, node: str, inc: int, ts: int) -> bool:
        """Whether an event of (node, inc) at `ts` lies where a newer incarnation of the node
        already runs; flags and counts it then."""
        cut, newer = self._incs.successor(node, inc)
        if newer is None or ts < cut:
            return False
        self._flag(node, inc, newer, cut)
        self.stats.overlapping_events += 1
        return True

    def overlapped(self, node: str, inc: int, newer: int, since_ms: int, seqs: set[int]) -> None:
        """Events `seqs` of (node, inc), admitted before the newer one was seen, are left out."""
        counted = self._counted.setdefault((node, inc), set())
        self.stats.overlapping_events += len(seqs - counted)
        counted |= seqs
        self._flag(node, inc, newer, since_ms)

    def _flag(self, node: str, inc: int, newer: int, since_ms: int) -> None:
        key = (node, inc, newer)
        if key in self._flagged:
            return
        self._flagged.add(key)
        self.stats.node_conflicts += 1
        unknown = "unannounced"
        self._new.append(
            NodeConflict(
                node,
                inc,
                newer,
                since_ms,
                self._who.get((node, inc), unknown),
                self._who.get((node, newer), unknown),
            )
        )

    def forget(self, gone: list[tuple[str, int]]) -> None:
        """These incarnations are forgotten (`Incarnations.prune`): their announcements and
        counted overlap go with them. The pairs already flagged stay flagged."""
        for key in gone:
            self._who.pop(key, None)
            self._counted.pop(key, None)

    def take(self) -> list[NodeConflict]:
        """Conflicts found since the last call (for the service's log)."""
        new, self._new = self._new, []
        return new
