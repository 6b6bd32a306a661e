"""Late events: counted, never corrected.

An event whose ts is before the end of the last window this instance closed is **late**. It is
counted in `stats.late_events`, and for each of its usage rows the part of the row's interval
that fell into closed windows, `min(closed_end - ts, max_gap_ms)`, is added to
`stats.late_ms_dropped`. Closed windows are never revised: there are no correction records and
`revision` is always 0 (the field is kept for evolution). The event still takes effect from the
closed end onward, so the following windows are right: a late sample replaces a key's value
unless a newer sample or an end of that key (or of its process or container) is already known,
and it keeps its own ts for the `max_gap_ms` cap; a late end ends only keys sampled before it;
a late event refreshes presence only if it is newer than the last event seen.
"""

from __future__ import annotations

from collections.abc import Callable

from ...events import (
    ContainerAppeared,
    ContainerGone,
    ContainerState,
    DeviceLimit,
    LimitsChanged,
    NodeDeviceSample,
    ProcessExited,
    UsageRow,
    UsageSample,
)
from .apply import forget, learn, node_rows, set_limits
from .integrate import Integrator
from .settings import NEVER
from .state import Entry, Key, Supersede, Track
from .stats import AggregateStats

__all__ = ["apply_late", "count_late"]


def count_late(stats: AggregateStats, rows: int, ts: int, closed: int, gap: int) -> None:
    """Count an event at `ts` with `rows` usage rows that arrived after `closed` was closed."""
    stats.late_events += 1
    stats.late_ms_dropped += rows * min(closed - ts, gap)


def apply_late(ig: Integrator, tr: Track, e: Entry) -> None:
    """A late event, applied at the closed end but judged by its own ts (module docstring)."""
    ts = e[1]
    p = e[4]
    off = e[5]
    if isinstance(p, ContainerGone | Supersede):
        _end_late(ig, tr, ts, lambda k: True)
        if tr.last_ts < ts:
            tr.alive = False
            forget(ig, tr)
        if tr.gone_ts is None or ts > tr.gone_ts:
            tr.gone_ts = ts
        return
    if isinstance(p, NodeDeviceSample):
        named = node_rows(ig, tr, p, ts)
        if named is not None:
            _late_rows(ig, tr, named, ts, off)
        return
    if ts > tr.last_ts and (tr.gone_ts is None or ts > tr.gone_ts):
        tr.alive = True
        tr.last_ts = ts
        tr.pres_off = off
    if isinstance(p, UsageSample):
        _late_rows(ig, tr, p.rows, ts, off)
    elif isinstance(p, ContainerState):
        _late_identity(ig, tr, p.pod_uid, p.container, p.devices, ts, off)
        _late_rows(ig, tr, p.rows, ts, off)
        stated = {(r.pid, r.hostpid, r.device) for r in p.rows}
        _end_late(ig, tr, ts, lambda k: k not in stated)
    elif isinstance(p, ProcessExited):
        proc = (p.pid, p.hostpid)
        _end_late(ig, tr, ts, lambda k: k[:2] == proc)
        if tr.ended.get(proc, -NEVER) < ts:
            tr.ended[proc] = ts
    elif isinstance(p, ContainerAppeared):
        _late_identity(ig, tr, p.pod_uid, p.container, p.devices, ts, off)
    elif isinstance(p, LimitsChanged) and (tr.limits_ts is None or ts > tr.limits_ts):
        set_limits(ig, tr, p.devices, ts, off)


def _late_identity(
    ig: Integrator,
    tr: Track,
    pod_uid: str,
    container: str,
    devices: list[DeviceLimit],
    ts: int,
    off: int,
) -> None:
    if tr.gone_ts is not None and tr.gone_ts >= ts:
        return
    if tr.pod_uid is None:
        learn(ig, tr, pod_uid, container, devices, ts, off)
    elif tr.limits_ts is None or ts > tr.limits_ts:
        set_limits(ig, tr, devices, ts, off)


def _end_late(ig: Integrator, tr: Track, ts: int, which: Callable[[Key], bool]) -> None:
    """End the keys selected by `which` that were sampled before `ts`."""
    for k in [k for k, v in tr.keys.items() if v[3] < ts and which(k)]:
        ig.drop_key(tr, k)
        if tr.ended.get(k, -NEVER) < ts:
            tr.ended[k] = ts
    for k in [k for k, s in tr.expired.items() if s < ts and which(k)]:
        ig.unexpire(tr, k, ts)


def _late_rows(ig: Integrator, tr: Track, rows: list[UsageRow], ts: int, off: int) -> None:
    if tr.pod_uid is None:
        ig.stats.unattributed_rows += len(rows)
        return
    gone = -NEVER if tr.gone_ts is None else tr.gone_ts
    ended = tr.ended
    for r in rows:
        d = tr.devs.get(r.device)
        if d is None or d.uuid is None:
            ig.stats.unattributed_rows += 1
            continue
        k = (r.pid, r.hostpid, r.device)
        v = tr.keys.get(k)
        if v is not None and v[3] >= ts:
            continue  # a newer sample is in effect
        if tr.expired.get(k, -NEVER) >= ts or gone >= ts:
            continue
        if ended.get(k, -NEVER) >= ts or ended.get(k[:2], -NEVER) >= ts:
            continue
        if v is not None:
            ig.drop_key(tr, k)
        elif tr.expired:
            ig.unexpire(tr, k, ts)
        tr.keys[k] = [r.total, r.monitor, r.sm_util, ts, off]
        d.total += r.total
        d.monitor += r.monitor
        d.sm += r.sm_util
        d.nkeys += 1
        tr.nkeys += 1
        # The cap counts from the sample's own ts; integrate() expires it on its first step.
        if ts + ig.gap < tr.next_exp:
            tr.next_exp = ts + ig.gap
