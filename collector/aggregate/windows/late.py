"""Late events: counted, never corrected.

An event whose ts is before the end of the windows the input read before it lets close (see
`progress`; closed by `advance()` yet or not, so when `advance()` runs never decides it) is
**late**. It is counted in `stats.late_events`. Closed windows are never revised: there are no
correction records and `revision` is always 0 (the field is kept for evolution). The event still
takes effect from that end (the closed end below) onward, so the following windows are right: a
late sample replaces a key's value unless a newer sample or an end of that key (or of its
process or container), or a heartbeat after it (which restated or ended every key of the
container), is already known, and it keeps its own ts for the `max_gap_ms` cap; a late end ends
only keys sampled before it; a late event refreshes presence only if it is newer than the last
event seen.

What the closed windows got wrong, in key-milliseconds, computed when the late event is applied
(at the close after it arrived), each interval cut at the closed end `C`:

* `stats.late_ms_dropped`: for each attributed usage row of a late event at `ts`, the time its
  value would have held, `[ts, min(ts + max_gap_ms, next, C))`, where `next` is the ts of the
  first other event of that key after `ts` (a sample, or an end of the key, its process or its
  container; in time or late) among the events of the container's last `HISTORY_GAPS x
  max_gap_ms` before `C`. So late rows of one key never count the same time twice.
* `stats.late_ms_overbilled`: for each key a late end at `ts` ends (a `ProcessExited`,
  `ContainerGone`, a newer incarnation, or a heartbeat that no longer states it), the time the
  closed windows went on billing it after the end: `[ts, min(sample + max_gap_ms, C))`, where
  `sample` is the ts of its newest sample (there is none after `ts`, or the end would not apply).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar

from ...events import (
    ContainerAppeared,
    ContainerGone,
    ContainerRun,
    ContainerState,
    DeviceLimit,
    LimitsChanged,
    NodeDeviceSample,
    ProcessExited,
    UsageRow,
    UsageSample,
)
from . import runs
from .apply import forget, lapse, learn, node_rows, row_ok, set_limits
from .integrate import Integrator
from .settings import NEVER
from .state import Entry, Key, Supersede, Track, unpacked
from .stats import AggregateStats

__all__ = ["apply_late", "count_late"]

_K = TypeVar("_K", bound=Hashable)


def count_late(stats: AggregateStats) -> None:
    """An event arrived after the input let the window its ts lies in close (accounted when
    applied)."""
    stats.late_events += 1


def apply_late(ig: Integrator, tr: Track, e: Entry, batch: list[Entry]) -> None:
    """A late event, applied at the closed end but judged by its own ts (module docstring).
    `batch`: the entries applied at this close (the late ones among them are not in the
    track's history yet)."""
    ts = e[1]
    p = unpacked(e[4])
    off = e[5]
    closed = e[0]
    if tr.uuids is None:  # (a node's pseudo-container has no name nor gate)
        lapse(ig, tr, closed)
    if isinstance(p, ContainerRun):
        runs.late(tr, p, e[2], off)
        if ts > tr.run_ts:
            tr.run_ts = ts
        return
    if isinstance(p, ContainerGone | Supersede):
        _end_late(ig, tr, ts, off, closed, lambda k: True)
        if tr.last_ts < ts:
            tr.alive = False
            forget(ig, tr)
        if tr.gone_ts is None or ts > tr.gone_ts:
            tr.gone_ts = ts
            tr.gone_off = off
        return
    if isinstance(p, NodeDeviceSample):
        named = node_rows(ig, tr, p, ts)
        if named is not None:
            _late_rows(ig, tr, named, ts, e[2], off, closed, batch)
        return
    if ts > tr.last_ts and (tr.gone_ts is None or ts > tr.gone_ts):
        tr.alive = True
        tr.last_ts = ts
        tr.pres_off = off
    if isinstance(p, UsageSample):
        _late_rows(ig, tr, p.rows, ts, e[2], off, closed, batch)
    elif isinstance(p, ContainerState):
        if (ts, e[2]) > tr.stated:
            tr.stated = (ts, e[2])  # later late samples before it are not taken (_late_rows)
        _late_identity(ig, tr, p.pod_uid, p.container, p.devices, ts, off)
        runs.restate(tr, p.running, e[2], off)
        _late_rows(ig, tr, p.rows, ts, e[2], off, closed, batch)
        stated = {(r.pid, r.hostpid, r.device) for r in p.rows}
        _end_late(ig, tr, ts, off, closed, lambda k: k not in stated)
    elif isinstance(p, ProcessExited):
        proc = (p.pid, p.hostpid)
        _end_late(ig, tr, ts, off, closed, lambda k: k[:2] == proc)
        if tr.ended.get(proc, -NEVER) < ts:
            tr.ended[proc] = ts
            tr.ended_off[proc] = off
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


def _end_late(
    ig: Integrator, tr: Track, ts: int, off: int, closed: int, which: Callable[[Key], bool]
) -> None:
    """End the keys selected by `which` that were sampled before `ts`; count what the closed
    windows billed of them after `ts`."""
    gap = ig.gap
    stats = ig.stats
    for k in [k for k, v in tr.keys.items() if v[3] < ts and which(k)]:
        stats.late_ms_overbilled += max(0, min(tr.keys[k][3] + gap, closed) - ts)
        ig.drop_key(tr, k)
        if tr.ended.get(k, -NEVER) < ts:
            tr.ended[k] = ts
            tr.ended_off[k] = off
    for k in [k for k, s in tr.expired.items() if s < ts and which(k)]:
        stats.late_ms_overbilled += max(0, min(tr.expired[k] + gap, closed) - ts)
        ig.unexpire(tr, k, ts)


class _Held:
    """For a late event at `ts`: the first event after it, before `limit`, that samples or ends
    each key, from the track's history and this close's batch, each decoded once. (Asked for
    every row of the event, a walk of the whole history per row made one late sample of 800
    rows cost a close 10 s.)"""

    def __init__(self, tr: Track, ts: int, limit: int, batch: list[Entry]) -> None:
        self.limit = limit
        self.all = limit  # a heartbeat states or ends every key; so do a gone and a newer inc
        self.rows: dict[Key, int] = {}  # a sample's rows
        self.procs: dict[tuple[int, int], int] = {}  # an exit ends every device of its process
        self.devs: dict[int, int] = {}  # a node sample's devices (a node track's keys)
        uuids = tr.uuids
        for entries in (tr.hist, batch):
            for e in entries:
                t = e[1]
                if not ts < t < limit:
                    continue
                p = unpacked(e[4])
                if isinstance(p, UsageSample):
                    for r in p.rows:
                        _first(self.rows, (r.pid, r.hostpid, r.device), t)
                elif isinstance(p, ProcessExited):
                    _first(self.procs, (p.pid, p.hostpid), t)
                elif isinstance(p, NodeDeviceSample):
                    if uuids is not None:
                        for d in p.rows:
                            i = uuids.get(d.uuid)
                            if i is not None:
                                _first(self.devs, i, t)
                elif isinstance(p, ContainerState | ContainerGone | Supersede) and t < self.all:
                    self.all = t

    def until(self, k: Key) -> int:
        """When `k`'s late sample stops counting: its first event after, or the limit."""
        limit = self.limit
        return min(
            self.all,
            self.rows.get(k, limit),
            self.procs.get(k[:2], limit),
            self.devs.get(k[2], limit),
        )


def _first(firsts: dict[_K, int], k: _K, t: int) -> None:
    if t < firsts.get(k, NEVER):
        firsts[k] = t


def _late_rows(
    ig: Integrator,
    tr: Track,
    rows: list[UsageRow],
    ts: int,
    seq: int,
    off: int,
    closed: int,
    batch: list[Entry],
) -> None:
    if tr.pod_uid is None:
        ig.stats.unattributed_rows += len(rows)
        return
    limit = min(ts + ig.gap, closed)
    gone = -NEVER if tr.gone_ts is None else tr.gone_ts
    ended = tr.ended
    held = _Held(tr, ts, limit, batch) if ts < limit else None
    for r in rows:
        d = tr.devs.get(r.device)
        if d is None or d.uuid is None:
            ig.stats.unattributed_rows += 1
            continue
        if not row_ok(r):
            ig.stats.refused_values += 1
            continue
        k = (r.pid, r.hostpid, r.device)
        if held is not None:
            ig.stats.late_ms_dropped += held.until(k) - ts
        v = tr.keys.get(k)
        if v is not None and v[3] >= ts:
            continue  # a newer sample is in effect
        if tr.expired.get(k, -NEVER) >= ts or gone >= ts:
            continue
        if ended.get(k, -NEVER) >= ts or ended.get(k[:2], -NEVER) >= ts:
            continue
        if (ts, seq) < tr.stated:
            continue  # a later heartbeat restated the key or ended it (the key need not be known)
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
