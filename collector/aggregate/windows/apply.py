"""Applying a track's events in event-time order: samples, ends, presence and identity.

* A **usage key** is (node, inc, cid, pid, hostpid, device); every `UsageRow` (in a
  `UsageSample` or in a heartbeat's `ContainerState.rows`) is an absolute sample of its key at the
  event's `ts`. The value holds until the next sample of the key, an end of the key, or
  `max_gap_ms` after its own ts, whichever comes first.
* Ends: `ProcessExited` ends every key of (cid, pid, hostpid); `ContainerGone` ends every key
  and the presence of the container; a heartbeat that restates a container without a key the
  aggregator holds ends that key at the heartbeat's ts (the exit was missed).
* **Presence** of a container (node, inc, cid) is refreshed by every event of that cid
  (appeared, sample, limits, process events, heartbeat state; not layout anomalies), capped at
  `max_gap_ms` after the last one, and ended by `ContainerGone`. Limits are billed while present
  and not stopped by Kubernetes (`ContainerRun`, see `runs`).
* **Identity**: `ContainerAppeared` or a heartbeat's `ContainerState` names the container and
  gives its device table (UUIDs, limits); `LimitsChanged` replaces the table. Rows at a time when
  the container is not named, or of a device index its table does not list, are counted in
  `stats.unattributed_rows` and ignored. The name is dropped at `ContainerGone` and after
  `2 x max_gap_ms` without any event of the container.
* **Node rows**: a `NodeDeviceSample` names the node's pseudo-container and states one key per
  device UUID (see the package docstring).
"""

from __future__ import annotations

from msgspec.structs import astuple

from ...events import (
    MAX_BYTES,
    MAX_PERCENT,
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
from . import packed, runs
from .integrate import Integrator
from .settings import NEVER
from .state import Device, Entry, Supersede, Track

__all__ = [
    "apply",
    "apply_tuples",
    "row_ok",
    "end_process",
    "forget",
    "gone",
    "learn",
    "node_rows",
    "retire_devices",
    "apply_rows",
    "limits_ok",
    "set_limits",
    "state",
]


def row_ok(r: UsageRow) -> bool:
    """The row's numbers are within what a device can hold (hostile ones are refused)."""
    return (
        0 <= r.total <= MAX_BYTES and 0 <= r.monitor <= MAX_BYTES and 0 <= r.sm_util <= MAX_PERCENT
    )


def limits_ok(x: DeviceLimit) -> bool:
    """Both of the device's limits are within what a device can have; else neither is billed."""
    return 0 <= x.limit_bytes <= MAX_BYTES and 0 <= x.sm_limit <= MAX_PERCENT


def apply(ig: Integrator, tr: Track, e: Entry) -> None:
    """Apply an in-time event at its own ts (the track is integrated up to it)."""
    t = e[0]
    lapse(ig, tr, t)
    ws = t - t % ig.w
    if ws != tr.win:
        ig.roll(tr, ws)
    p = e[4]
    off = e[5]
    if type(p) is bytes:
        tr.alive = True
        tr.last_ts = t
        tr.pres_off = off
        apply_tuples(ig, tr, packed.rows(p), t, off, True)
    elif isinstance(p, UsageSample):
        tr.alive = True
        tr.last_ts = t
        tr.pres_off = off
        apply_rows(ig, tr, p.rows, t, off)
    elif isinstance(p, ContainerState):
        state(ig, tr, p, t, e[2], off)
        runs.restate(tr, p.running, e[2], off)
    elif isinstance(p, ContainerRun):
        runs.switch(tr, p, e[2], off)
        if t > tr.run_ts:
            tr.run_ts = t
    elif isinstance(p, ContainerGone | Supersede):
        gone(ig, tr, t, off)
    elif isinstance(p, NodeDeviceSample):
        named = node_rows(ig, tr, p, t)
        if named is not None:
            apply_rows(ig, tr, named, t, off)
    else:
        tr.alive = True
        tr.last_ts = t
        tr.pres_off = off
        if isinstance(p, ProcessExited):
            end_process(ig, tr, p.pid, p.hostpid, t, off)
        elif isinstance(p, ContainerAppeared):
            learn(ig, tr, p.pod_uid, p.container, p.devices, t, off)
        elif isinstance(p, LimitsChanged):
            set_limits(ig, tr, p.devices, t, off)


def apply_rows(ig: Integrator, tr: Track, rows: list[UsageRow], t: int, off: int) -> None:
    """Decoded samples at `t`, each row checked against `row_ok`'s bounds."""
    apply_tuples(ig, tr, [astuple(r) for r in rows], t, off, False)


def apply_tuples(
    ig: Integrator, tr: Track, rows: list[packed.Row], t: int, off: int, in_bounds: bool
) -> None:
    """Samples at `t`, rows as tuples in `UsageRow`'s field order; `in_bounds`: every row is
    known to pass `row_ok` (`packed.checked` found it so). The hot path: it runs once per usage
    row, so `row_ok` is inlined and nothing is allocated for a key that is already live.

    A collector samples the same processes in the same order scan after scan, so the track
    keeps the last in-bounds sample's rows as (pid, hostpid, device, its Device, its live
    value list) (`Track.layout`): a row with the same key as its place in the layout updates
    those directly, without looking the key up. Dropping any key (`drop_key`, `gone`) forgets
    the layout, and a device out of the table or a different key takes the full way from that
    row on, so this gives what the full way gives."""
    if tr.pod_uid is None:
        ig.stats.unattributed_rows += len(rows)
        return
    layout = tr.layout
    if in_bounds and layout is not None and len(layout) == len(rows):
        for row, (kpid, khostpid, kdev, ld, lv) in zip(rows, layout, strict=True):
            pid, hostpid, dev, total, _context, _module, _data, mon, sm = row
            if pid != kpid or hostpid != khostpid or dev != kdev or ld.uuid is None:
                # the rows before this one are applied: the rest take the full way
                rows = rows[next(i for i, r in enumerate(rows) if r is row) :]
                break
            ld.total += total - lv[0]
            ld.monitor += mon - lv[1]
            ld.sm += sm - lv[2]
            lv[0] = total
            lv[1] = mon
            lv[2] = sm
            lv[3] = t
            lv[4] = off
            ld.samples += 1
        else:
            return
        tr.layout = None
    device_of = tr.devs.get
    keys = tr.keys
    key_of = keys.get
    learned: list[tuple[int, int, int, Device, list[int]]] | None = [] if in_bounds else None
    for pid, hostpid, dev, total, _context, _module, _data, mon, sm in rows:
        d = device_of(dev)
        if d is None or d.uuid is None:
            ig.stats.unattributed_rows += 1
            learned = None
            continue
        if not in_bounds and not (
            0 <= total <= MAX_BYTES and 0 <= mon <= MAX_BYTES and 0 <= sm <= MAX_PERCENT
        ):
            ig.stats.refused_values += 1
            continue
        k = (pid, hostpid, dev)
        v = key_of(k)
        if v is None:
            v = keys[k] = [total, mon, sm, t, off]
            d.total += total
            d.monitor += mon
            d.sm += sm
            d.nkeys += 1
            tr.nkeys += 1
            exp = t + ig.gap
            if exp < tr.next_exp:
                tr.next_exp = exp
            if tr.expired:
                ig.unexpire(tr, k, t)
        else:
            d.total += total - v[0]
            d.monitor += mon - v[1]
            d.sm += sm - v[2]
            v[0] = total
            v[1] = mon
            v[2] = sm
            v[3] = t
            v[4] = off
        d.samples += 1
        if learned is not None:
            learned.append((pid, hostpid, dev, d, v))
    if learned is not None and len(learned) == len(rows):
        tr.layout = learned


def node_rows(ig: Integrator, tr: Track, sample: NodeDeviceSample, t: int) -> list[UsageRow] | None:
    """A node sample names the node's pseudo-container (pod_uid and container empty) and
    states one key per device UUID, held as the process row (0, 0, index) of that device:
    total = unaccounted bytes, monitor = NVML memory used, sm_util = device utilisation.
    Once a newer incarnation ended it, nothing names it again: None (the rows are counted as
    unattributed)."""
    uuids = tr.uuids
    assert uuids is not None
    if tr.pod_uid is None:
        if tr.gone_ts is not None:
            ig.stats.unattributed_rows += len(sample.rows)
            return None
        tr.pod_uid = ""
    if t > tr.last_ts:
        tr.last_ts = t  # only for forgetting the track; a node has no presence (alive)
    devs = tr.devs
    out = []
    for r in sample.rows:
        i = uuids.get(r.uuid)
        if i is None:
            # a retired UUID's index is gone from the middle: a new one goes past the largest
            i = uuids[r.uuid] = max(devs) + 1 if devs else 0
            devs[i] = Device()
        devs[i].uuid = r.uuid
        out.append(UsageRow(0, 0, i, r.unaccounted_bytes, 0, 0, 0, r.memory_used, r.utilization))
    return out


def retire_devices(tr: Track, horizon: int) -> None:
    """Forget the node's devices whose key expired with a sample before `horizon` (a MIG
    reconfiguration, a GPU taken out) and that hold nothing of an open window, unless an event
    read but not applied yet names them: a UUID that comes back after that starts afresh."""
    uuids = tr.uuids
    assert uuids is not None
    old = [
        (u, i)
        for u, i in uuids.items()
        if tr.expired.get((0, 0, i), horizon) < horizon and tr.devs[i].holds_nothing()
    ]
    if not old:
        return
    named = {r.uuid for e in tr.pending if isinstance(e[4], NodeDeviceSample) for r in e[4].rows}
    for u, i in old:
        if u not in named:
            del uuids[u]
            del tr.devs[i]
            del tr.expired[(0, 0, i)]


def state(ig: Integrator, tr: Track, st: ContainerState, t: int, seq: int, off: int) -> None:
    tr.alive = True
    tr.last_ts = t
    tr.pres_off = off
    tr.stated = (t, seq)
    learn(ig, tr, st.pod_uid, st.container, st.devices, t, off)
    apply_rows(ig, tr, st.rows, t, off)
    if tr.keys or tr.expired:
        stated = {(r.pid, r.hostpid, r.device) for r in st.rows}
        for k in [k for k in tr.keys if k not in stated]:
            ig.drop_key(tr, k)
            tr.ended[k] = t
            tr.ended_off[k] = off
        for k in [k for k in tr.expired if k not in stated]:
            ig.unexpire(tr, k, t)


def end_process(ig: Integrator, tr: Track, pid: int, hostpid: int, t: int, off: int) -> None:
    for dev in tr.devs:
        k = (pid, hostpid, dev)
        if k in tr.keys:
            ig.drop_key(tr, k)
        if k in tr.expired:
            ig.unexpire(tr, k, t)
    tr.ended[(pid, hostpid)] = t
    tr.ended_off[(pid, hostpid)] = off


def gone(ig: Integrator, tr: Track, t: int, off: int) -> None:
    tr.keys.clear()
    tr.layout = None
    for d in tr.devs.values():
        d.total = d.monitor = d.sm = d.nkeys = 0
    tr.nkeys = 0
    tr.next_exp = NEVER
    for k in list(tr.expired):
        ig.unexpire(tr, k, t)
    tr.alive = False
    if tr.gone_ts is None or t > tr.gone_ts:
        tr.gone_ts = t
        tr.gone_off = off
    forget(ig, tr)


def learn(
    ig: Integrator,
    tr: Track,
    pod_uid: str,
    container: str,
    devices: list[DeviceLimit],
    t: int,
    off: int,
) -> None:
    if tr.pod_uid is not None and (tr.pod_uid, tr.container) != (pod_uid, container):
        ig.output.emit(tr)  # what was accumulated belongs to the old name
    tr.pod_uid = pod_uid
    tr.container = container
    tr.ident_off = off
    set_limits(ig, tr, devices, t, off)


def lapse(ig: Integrator, tr: Track, t: int) -> None:
    """What a silence of `retain` ends by `t`: a name (`forget`: silent for too long, wait for
    a restatement), or the running gate of a track not named yet (kept that long for a late
    announcement). Both as `Aggregator._prune` drops them when a window closes in the silence,
    so that an event after it finds the same state whether or not one closed (a late event at
    the end it is applied at)."""
    if tr.pod_uid is not None:
        if t >= tr.last_ts + ig.retain:
            forget(ig, tr)
    elif tr.run is not None and t >= max(tr.last_ts, tr.run_ts) + ig.retain:
        runs.clear(tr)


def forget(ig: Integrator, tr: Track) -> None:
    """Drop the name, the device table and the running gate; the window so far is handed out
    under them first. The gate goes with the name: a track that has neither is what a new one
    would be, so `Aggregator._prune` may drop it whenever `advance()` runs (keeping a False gate
    across a silence billed a re-announced container only when no window closed in between)."""
    ig.output.emit(tr)
    tr.pod_uid = None
    tr.container = ""
    runs.clear(tr)
    for d in tr.devs.values():
        d.settle()
        d.uuid = None
        d.limit = d.sm_limit = 0
    tr.slices = False
    tr.limits_ts = None


def set_limits(ig: Integrator, tr: Track, devices: list[DeviceLimit], t: int, off: int) -> None:
    """The device list of an appeared/heartbeat/limits event is the whole table."""
    table = {x.index: x for x in devices}
    devs = tr.devs
    for d in devs.values():
        d.settle()
    if {i: d.uuid for i, d in devs.items() if d.uuid is not None} != {
        i: x.uuid for i, x in table.items()
    }:
        # A device leaves or joins the table: hand out the window so far under the old table
        # (a device joining mid-window was not observed before it joined).
        ig.output.emit(tr)
    for i, d in list(devs.items()):
        if i not in table:
            d.uuid = None
            d.limit = d.sm_limit = 0
            if d.holds_nothing():
                # Gone from the table with nothing left to bill: kept, every table of new
                # indices added 16 devices for the container's life (2 000 LimitsChanged: 32 001,
                # walked by every later event).
                del devs[i]
    for i, x in table.items():
        dev = devs.get(i)
        if dev is None:
            dev = devs[i] = Device()
        dev.uuid = x.uuid
        dev.limit = x.limit_bytes
        dev.sm_limit = x.sm_limit
        if not limits_ok(x):
            # A limit no device has: its usage is still attributed, the limit billed as 0.
            ig.stats.refused_values += 1
            dev.limit = dev.sm_limit = 0
    uuids = [x.uuid for x in table.values()]
    tr.slices = len(set(uuids)) < len(uuids)
    tr.limits_ts = t
    tr.limits_off = off
