"""Closing a track's windows: its due events applied in (ts, seq) order, time integrated between
them, and what it accumulated handed to the output.

At close the events since the last closed end are applied sorted by (ts, seq) - seq is the
collector's own order, so events that arrive out of order but within the lateness give exactly
the records they would have given in order, and so do splits of a batch."""

from __future__ import annotations

from bisect import bisect_left

from .apply import apply
from .integrate import Integrator
from .late import apply_late
from .state import HISTORY_GAPS, Track, effective

__all__ = ["run"]


def run(ig: Integrator, tr: Track, target: int) -> None:
    """Apply this container's due events in order and integrate it up to `target`."""
    pending = tr.pending
    if pending:
        pending.sort()
        i = bisect_left(pending, target, key=effective)
        if i == len(pending):
            tr.pending = []
        else:
            tr.pending = pending[i:]
            del pending[i:]
        cur = tr.cur
        hist = tr.hist
        for e in pending:
            t = e[0]
            if t > cur:
                ig.integrate(tr, cur, t)
                cur = t
            if e[1] != t:
                apply_late(ig, tr, e, pending)
            else:
                apply(ig, tr, e)
        hist += pending
        tr.cur = cur
    ig.integrate(tr, tr.cur, target)
    if tr.next_exp <= target:
        ig.expire(tr, target)
    ig.output.emit(tr)
    tr.win = None
    tr.cur = target
    if tr.hist:
        horizon = target - HISTORY_GAPS * ig.gap
        if tr.hist[0][0] < horizon:
            tr.hist = tr.hist[bisect_left(tr.hist, horizon, key=effective) :]
