"""Successive snapshots of one cache file -> change events.

Processes are keyed by (pid, hostpid), never by slot: compaction moves slots around. Values in
events are absolute. Each distinct anomaly is reported once while it persists, and again when
it comes back after having gone.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from ..events import (
    ContainerAppeared,
    ContainerGone,
    ContainerState,
    DeviceLimit,
    Event,
    LayoutAnomaly,
    LimitsChanged,
    ProcessExited,
    ProcessStarted,
    UsageRow,
    UsageSample,
)
from ..layout.declarations import LAYOUTS, MAX_PROCS
from ..layout.snapshot import Anomaly, Snapshot

E = TypeVar("E", bound=Event)
Stamp = Callable[..., Any]  # Stamp(EventClass, **fields) -> the event, with v/inc/seq/ts set

ProcKey = tuple[int, int]  # (pid, hostpid)
RowKey = tuple[int, int, int]  # (pid, hostpid, device)
AnomalyKey = tuple[str, int | None, int | None, int | None]


def _anomaly_key(a: Anomaly) -> AnomalyKey:
    # A stale process is one host pid (several can be stale at once, and compaction moves
    # slots); other kinds are keyed without their value, which changes while they persist.
    value = a.value if a.kind == "stale_process" else None
    return (a.kind, a.slot, a.device, value)


@dataclass
class FileState:
    """What the collector last told the world about one cache file."""

    cid: int
    pod_uid: str
    container: str
    path: str
    layout: str = ""
    devices: list[DeviceLimit] = field(default_factory=list)
    rows: dict[RowKey, UsageRow] = field(default_factory=dict)
    procs: set[ProcKey] = field(default_factory=set)
    slots: dict[ProcKey, int] = field(default_factory=dict)  # where each process was last seen
    anomalies: set[AnomalyKey] = field(default_factory=set)
    appeared: bool = False
    # The last snapshot was unusable (unreadable, garbage): nothing is restated for it, so the
    # aggregator lets its values lapse after max_gap instead of billing stale ones forever.
    unobserved: bool = False
    # The file was not fully observed since the last good scan (unusable, a torn slot, a garbled
    # proc_num): the next good scan restates every row, not only the changed ones, so values
    # that lapsed in the aggregator or changed unseen are billed again from then on.
    restate: bool = False
    # --host-proc: usage counters of slots whose host pid is gone, as first seen so, and the
    # slots whose counters moved since (a live process the slot's host pid has not caught up
    # with).
    dead_rows: dict[ProcKey, list[UsageRow]] = field(default_factory=dict)
    vouched: set[ProcKey] = field(default_factory=set)
    moving: set[ProcKey] = field(default_factory=set)  # counters unlike dead_rows at the last scan
    # Slots of processes seen alive, then judged dead: they stay dead until their counters
    # move, whatever /proc says of their host pid later (the host may give that pid to an
    # unrelated process).
    dead: set[ProcKey] = field(default_factory=set)
    last_kernel_time: int | None = None
    running: bool | None = None  # what the last ContainerRun said (runs.py); None: nothing

    def state(self) -> ContainerState:
        rows = [self.rows[k] for k in sorted(self.rows)]
        return ContainerState(
            self.cid, self.pod_uid, self.container, self.layout, self.devices, rows, self.running
        )


def live_procs(snap: Snapshot) -> dict[ProcKey, list[UsageRow]]:
    """Live processes and their rows. An exit marker (pid 0 / status 0) is not live even though
    its counters stay in the file; the first slot wins if compaction left a duplicate."""
    out: dict[ProcKey, list[UsageRow]] = {}
    for p in snap.procs:
        if p.pid == 0 or p.status == 0:
            continue
        key = (p.pid, p.hostpid)
        if key in out:
            continue
        out[key] = [
            UsageRow(
                p.pid,
                p.hostpid,
                u.index,
                u.total,
                u.context,
                u.module,
                u.data,
                u.monitor,
                u.sm_util,
            )
            for u in p.devices
        ]
    return out


def host_pid_alive(host_proc: str, hostpid: int) -> bool:
    return os.path.exists(os.path.join(host_proc, str(hostpid)))


def _counters(rows: list[UsageRow]) -> list[tuple[int, int, int, int, int]]:
    # What the process itself writes; monitorused and sm_util are the watcher's, which zeroes
    # them for every slot it cannot match to a process. A device's row of zeros is no counter:
    # the reader gives a slot one for each device the table lists, so a table filled in later
    # (HAMi-core registers devices lazily) adds them without the slot's bytes changing.
    return [
        (r.device, r.context, r.module, r.data, r.total)
        for r in rows
        if r.context or r.module or r.data or r.total
    ]


def drop_dead_hosts(
    st: FileState,
    procs: dict[ProcKey, list[UsageRow]],
    host_proc: str,
    anomalies: list[Anomaly],
    *,
    seqlock: bool = True,
) -> None:
    """Remove from `procs` the slots whose process is dead by both accounts: its host pid is
    gone and its counters have not moved since the host pid was first seen gone. A restarted
    container's first process can reuse a slot (same container pid) before HAMi-core has
    replaced the slot's host pid, or never if the host-pid lookup times out: its counters move.

    A slot is judged dead when its host pid is gone at a scan after one that saw it live or
    saw it gone too; only at its first scan is it not held to it (its host pid may not have been
    visible yet: a lookup that raced the process's start). Judged dead, it stays dead while its
    counters stay as they were, even once its host pid is there again: a process's host pid does
    not come back, the host reuses it for another process, and that one does not write the
    slot's counters. Counters count as moved when they differ from those first seen with the
    host pid gone; in a layout without a slot `seqlock`, at two scans in a row: one read of a
    slot half-copied by compaction, which such a layout cannot tell (the seqlock layouts' read
    leaves it out as torn), is not a move. A dead slot the snapshot does not
    show (past a lowered count, torn, beyond a garbled one) is still dead when it shows again,
    and so is a dead slot that compaction moved, and a vouched-for one still vouched for; at
    most `MAX_PROCS` of each are remembered a file."""
    dead_rows: dict[ProcKey, list[UsageRow]] = {}
    vouched: set[ProcKey] = set()
    dead: set[ProcKey] = set()
    moving: set[ProcKey] = set()
    for key, rows in list(procs.items()):
        pid, hostpid = key
        before = st.dead_rows.get(key)
        differs = before is not None and _counters(before) != _counters(rows)
        moved = differs and (seqlock or key in st.moving)
        if key in st.dead and not moved:
            pass  # dead already, and nothing wrote its counters since: dead still
        elif hostpid <= 0 or host_pid_alive(host_proc, hostpid):
            continue
        elif key in st.vouched or moved:
            dead_rows[key] = rows
            vouched.add(key)
            continue
        # SIGKILLed: the slot stays until a later process compacts; it uses nothing.
        dead_rows[key] = rows if before is None else before
        if differs:
            moving.add(key)
        if key in st.procs or key in st.dead or before is not None:
            dead.add(key)
        del procs[key]
        detail = f"pid {pid} (host pid {hostpid}) has a slot but no process"
        anomalies.append(Anomaly("stale_process", detail, value=hostpid))
    # What a snapshot does not show is judged as it was: a dead slot stays dead and a live one
    # under a stale host pid stays vouched for (judged afresh, a torn read was its exit).
    for was, now in ((st.dead, dead), (st.vouched, vouched)):
        for key in was:
            if key not in now and key not in procs and len(now) < MAX_PROCS:
                now.add(key)
                dead_rows[key] = st.dead_rows[key]
    st.dead_rows, st.vouched, st.dead, st.moving = dead_rows, vouched, dead, moving


def end_all(st: FileState, stamp: Stamp, events: list[Event]) -> None:
    """Every process of the file has ended (the file went back to uninitialised: the container
    restarted and re-initialises it in place)."""
    for pk in sorted(st.procs):
        events.append(stamp(ProcessExited, cid=st.cid, pid=pk[0], hostpid=pk[1]))
    st.procs.clear()
    st.rows.clear()
    st.dead_rows.clear()
    st.vouched.clear()
    st.dead.clear()
    st.moving.clear()


Presence = Literal["folder", "processes"]


def diff(
    st: FileState,
    snap: Snapshot,
    stamp: Stamp,
    *,
    host_proc: str | None = None,
    policy: Presence = "folder",
) -> list[Event]:
    """Events that take the world from `st` to `snap`; updates `st` in place.

    `policy` (the `presence` setting): "folder" announces a container as long as its file is
    there; "processes" only while its file has a live process (`ContainerGone` when the last one
    ends, `ContainerAppeared` again with the next), so its limits are billed only then."""
    events: list[Event] = []
    if st.appeared and snap.layout is None and st.layout:
        _report_anomalies(st, list(snap.anomalies), stamp, events)
        if any(a.kind == "not_initialized" for a in snap.anomalies):
            # Back to uninitialised (emptied or zeroed): what the file held has ended. Its
            # device table stays until the new run writes one.
            if st.unobserved and policy == "folder":
                _announce(st, stamp, events)  # the aggregator may have forgotten it
            st.unobserved = False
            end_all(st, stamp, events)
            if policy == "processes":
                vanish(st, stamp, events)
            return events
        # Unreadable or garbage now: say so, but a transient open error or a scribble must not
        # look like every process exiting.
        st.unobserved = st.restate = True
        return events
    again = st.appeared and st.unobserved
    st.unobserved = False
    st.last_kernel_time = snap.last_kernel_time

    anomalies = list(snap.anomalies)
    procs = live_procs(snap)
    if host_proc is not None:
        layout = LAYOUTS.get(snap.layout or "")
        seqlock = layout is None or layout.slot_seqlock is not None
        drop_dead_hosts(st, procs, host_proc, anomalies, seqlock=seqlock)
    # A slot left out as torn_read is still there: the process last seen in it has not exited
    # (nor lost its rows), while every other process's exit goes out as usual. A garbled
    # proc_num shows the slots up to the first empty one, and maybe stale ones beyond the real
    # end: no process starts on its word, and none last seen beyond that slot exits.
    torn = any(a.kind == "torn_read" for a in snap.anomalies)
    garbled = [a for a in snap.anomalies if a.kind == "proc_num_out_of_range"]
    if garbled:
        procs = {pk: rows for pk, rows in procs.items() if pk in st.procs}
    partial = torn or bool(garbled)

    announce = policy == "folder" or bool(procs) or bool(st.procs)
    restate = _identity(st, snap, stamp, events, announce=announce, again=again) or st.restate
    _report_anomalies(st, anomalies, stamp, events)

    held = _held(st, snap, procs.keys()) | _beyond_the_count(st, garbled)
    gone = st.procs - procs.keys() - held
    for pk in sorted(gone):
        events.append(stamp(ProcessExited, cid=st.cid, pid=pk[0], hostpid=pk[1]))
        for rk in [rk for rk in st.rows if rk[:2] == pk]:
            del st.rows[rk]
    for pk in sorted(procs.keys() - st.procs):
        events.append(stamp(ProcessStarted, cid=st.cid, pid=pk[0], hostpid=pk[1]))
    st.procs = (st.procs - gone) | procs.keys()
    slots = {(p.pid, p.hostpid): p.slot for p in snap.procs if p.pid and p.status}
    st.slots = {pk: slots.get(pk, st.slots.get(pk, -1)) for pk in st.procs}
    _sample(st, procs, restate and not partial, held, stamp, events)
    st.restate = partial
    if policy == "processes" and st.appeared and not st.procs:
        vanish(st, stamp, events)
    return events


def _identity(
    st: FileState,
    snap: Snapshot,
    stamp: Stamp,
    events: list[Event],
    *,
    announce: bool,
    again: bool = False,
) -> bool:
    """Announce the container (when `announce`), or state a changed device table; True when
    the table changed (every row is restated with a new one). An unannounced container keeps
    its table quietly: its announcement carries the table of that moment. `again`: the file
    is usable after an unusable spell, in which no heartbeat stated the container and the
    aggregator may have forgotten its name (after 2 x max_gap): it is announced again, with
    the table of now, so the rows restated with it are billed under it."""
    devices = [DeviceLimit(d.index, d.uuid, d.limit_bytes, d.sm_limit) for d in snap.devices]
    layout = snap.layout or ""
    changed = devices != st.devices or layout != st.layout
    st.layout, st.devices = layout, devices
    if st.appeared and not (again and announce):
        if changed:
            events.append(stamp(LimitsChanged, cid=st.cid, devices=devices))
        return changed
    if announce:
        _announce(st, stamp, events)
    return changed and again


def _announce(st: FileState, stamp: Stamp, events: list[Event]) -> None:
    """`ContainerAppeared` with the container's name, path and device table as `st` has them."""
    st.appeared = True
    events.append(
        stamp(
            ContainerAppeared,
            cid=st.cid,
            pod_uid=st.pod_uid,
            container=st.container,
            path=st.path,
            layout=st.layout,
            devices=st.devices,
        )
    )


def vanish(st: FileState, stamp: Stamp, events: list[Event]) -> None:
    """presence = processes: the file has no live process left, so the container is not
    present (its next process announces it again)."""
    events.append(stamp(ContainerGone, cid=st.cid))
    st.appeared = False
    st.rows.clear()


def _sample(
    st: FileState,
    procs: dict[ProcKey, list[UsageRow]],
    restate: bool,
    held: set[ProcKey],
    stamp: Stamp,
    events: list[Event],
) -> None:
    """The rows that changed (all of them when `restate`), as one absolute sample. Rows of a
    device the file's table does not list yet (HAMi-core registers devices lazily) are not
    sent: there is no UUID to bill them under. They go out once the device is registered."""
    known = {d.index for d in st.devices}
    changed: list[UsageRow] = []
    seen: set[RowKey] = set()
    for rows in procs.values():
        for row in rows:
            if row.device not in known:
                continue
            rk = (row.pid, row.hostpid, row.device)
            seen.add(rk)
            if restate or st.rows.get(rk) != row:
                st.rows[rk] = row
                changed.append(row)
    for rk in sorted(k for k in st.rows.keys() - seen if k[:2] not in held):
        # The device dropped out of the slot (counters back to zero): state that absolutely.
        del st.rows[rk]
        changed.append(UsageRow(rk[0], rk[1], rk[2], 0, 0, 0, 0, 0, 0))
    if changed:
        events.append(stamp(UsageSample, cid=st.cid, rows=changed))


def _held(st: FileState, snap: Snapshot, live: Collection[ProcKey]) -> set[ProcKey]:
    """Processes in a slot this snapshot left out as torn_read: one a slot, with the pid the
    collector read there (`value`): the one last seen in that slot, else the one compaction
    may be moving there (it moves the last slot down), last seen highest above it and not
    live elsewhere; every one last seen in that slot when its pid could not be read. (Every
    known process of that pid was held: a tenant that kept one slot torn and wrote that pid
    under new host pids in its other slots had their exits held back, and its state grow, for
    good.)"""
    held: set[ProcKey] = set()
    for a in snap.anomalies:
        if a.kind != "torn_read" or a.slot is None:
            continue
        k = a.slot
        if not a.value:
            held.update(pk for pk in st.procs if st.slots.get(pk) == k)
            continue
        here = [pk for pk in st.procs if pk[0] == a.value and st.slots.get(pk) == k]
        if not here:
            above = [pk for pk in st.procs if pk[0] == a.value and pk not in live
                     and pk not in held and st.slots.get(pk, -1) > k]  # fmt: skip
            here = sorted(above, key=lambda pk: st.slots.get(pk, -1))[-1:]
        held.update(here)
    return held


def _beyond_the_count(st: FileState, garbled: list[Anomaly]) -> set[ProcKey]:
    """Known processes a garbled count may hide: last seen beyond its first empty slot (what
    lies there is not read). One last seen below or in that slot and not live there now has
    exited: compaction only moves processes down, and an all-zero slot is an exit marker (a
    process that ended before it had a host pid or memory leaves one, also as the last counted
    slot, which makes a count first seen that way look garbled: see `_within_contents`). A
    count outside 0..1024 says nothing of where the contents end: every known process is
    held."""
    if not garbled:
        return set()
    first_empty = min((a.slot for a in garbled if a.slot is not None), default=None)
    if first_empty is None:
        return set(st.procs)
    return {pk for pk in st.procs if st.slots.get(pk, -1) > first_empty}


def _report_anomalies(
    st: FileState, anomalies: list[Anomaly], stamp: Stamp, events: list[Event]
) -> None:
    """Each distinct anomaly once while it persists, again when it comes back."""
    current = {_anomaly_key(a) for a in anomalies}
    for a in anomalies:
        key = _anomaly_key(a)
        if key not in st.anomalies:
            st.anomalies.add(key)  # a kind repeated in one snapshot is reported once
            events.append(
                stamp(
                    LayoutAnomaly,
                    cid=st.cid,
                    path=st.path,
                    anomaly=a.kind,
                    detail=a.detail,
                    slot=a.slot,
                    device=a.device,
                    value=a.value,
                )
            )
    st.anomalies = current
