"""Restart (exactly once): which offsets must be read again to rebuild the open windows.

`needed_offsets()` gives, per source, the earliest offset whose event is still needed to rebuild
the open windows: pending events, the samples behind every live key, the events behind each
container's identity, limits, presence and running gate (`runs`), and the ends (exits, gone,
keys a heartbeat no longer states) of the last `max_gap_ms` before the closed end, by which a
late or redelivered event is judged: without them a restarted instance would let an exit
delivered before an older heartbeat, or a duplicate whose original lies before the restart
offset, revive what had ended. The pod identities and GPU inventory statements an open window
can still use are added by `Aggregator.needed_offsets` (`identity`, `inventory`), and last the
silences of nodes that held their source back (`Progress.held_back`: without them the restart's
progress would pass such a node's, and its spool, drained later, would be late). A new
`Aggregator(emitted_until_ms=E)` fed from those offsets recomputes the windows ending at or
before E and suppresses them. One node's events are assumed to stay in one source (the node is
the Kafka key). Late events are classified against what the input read before them lets
close, which a restart rebuilds from the input it reads again only as far as that input
reaches, so a restart can classify a late event differently; in-time input gives the same
records.
"""

from __future__ import annotations

from collections.abc import Iterable

from .progress import Progress
from .settings import NEVER
from .state import Track

__all__ = ["earliest", "needed_offsets"]


def needed_offsets(
    tracks: Iterable[Track], progress: Progress, closed: int | None, gap: int
) -> dict[int, int]:
    """Per source: the earliest offset still needed to rebuild the open windows, or the
    offset after the last one added when nothing is."""
    need: dict[int, int] = {}
    for tr in tracks:
        m = NEVER
        for e in tr.pending:
            if 0 <= e[5] < m:
                m = e[5]
        for v in tr.keys.values():
            if v[4] < m:
                m = v[4]
        # The ends a late or redelivered event is judged by, while they are kept.
        for o in tr.ended_off.values():
            if 0 <= o < m:
                m = o
        gone = tr.gone_ts
        if gone is not None and (closed is None or gone > closed - gap) and 0 <= tr.gone_off < m:
            m = tr.gone_off
        if tr.run is not None and 0 <= tr.run_off < m:
            m = tr.run_off  # the gate's change or restatement (runs)
        if tr.uuids is not None:
            pass  # the node: every sample names it, so its keys and pending events are all
        elif tr.pod_uid is not None:
            # the last event too: it decides when the name is forgotten
            m = min(m, tr.ident_off, tr.limits_off, tr.pres_off)
        elif tr.alive and (closed is None or tr.last_ts + gap > closed) and tr.pres_off < m:
            m = tr.pres_off
        if m < need.get(tr.source, NEVER):
            need[tr.source] = m
    return {src: min(need.get(src, nxt), nxt) for src, nxt in progress.next_offsets().items()}


def earliest(kept: Iterable[tuple[int, int]]) -> dict[int, int]:
    """Per source, the earliest offset among these (source, offset) pairs (offset -1: synthetic,
    nothing to re-read)."""
    need: dict[int, int] = {}
    for source, offset in kept:
        if offset >= 0 and offset < need.get(source, offset + 1):
            need[source] = offset
    return need
