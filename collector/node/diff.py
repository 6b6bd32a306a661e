"""Successive snapshots of one cache file -> change events.

Processes are keyed by (pid, hostpid), never by slot: compaction moves slots around. Values in
events are absolute. Each distinct anomaly is reported once while it persists, and again when
it comes back after having gone.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..events import (
    ContainerAppeared,
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
    anomalies: set[AnomalyKey] = field(default_factory=set)
    appeared: bool = False
    # The last snapshot was unusable (unreadable, garbage): nothing is restated for it, so the
    # aggregator lets its values lapse after max_gap instead of billing stale ones forever.
    unobserved: bool = False
    last_kernel_time: int | None = None

    def state(self) -> ContainerState:
        rows = [self.rows[k] for k in sorted(self.rows)]
        return ContainerState(
            self.cid, self.pod_uid, self.container, self.layout, self.devices, rows
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


def diff(
    st: FileState, snap: Snapshot, stamp: Stamp, *, host_proc: str | None = None
) -> list[Event]:
    """Events that take the world from `st` to `snap`; updates `st` in place."""
    events: list[Event] = []
    if st.appeared and snap.layout is None and st.layout:
        # A file we could read before is unreadable or garbage now: say so, but a transient
        # open error or a scribble must not look like every process exiting.
        st.unobserved = True
        _report_anomalies(st, list(snap.anomalies), stamp, events)
        return events
    st.unobserved = False
    st.last_kernel_time = snap.last_kernel_time
    devices = [DeviceLimit(d.index, d.uuid, d.limit_bytes, d.sm_limit) for d in snap.devices]
    layout = snap.layout or ""
    if not st.appeared:
        st.appeared = True
        st.layout, st.devices = layout, devices
        events.append(
            stamp(
                ContainerAppeared,
                cid=st.cid,
                pod_uid=st.pod_uid,
                container=st.container,
                path=st.path,
                layout=layout,
                devices=devices,
            )
        )
    elif devices != st.devices or layout != st.layout:
        st.layout, st.devices = layout, devices
        events.append(stamp(LimitsChanged, cid=st.cid, devices=devices))

    anomalies = list(snap.anomalies)
    procs = live_procs(snap)
    if host_proc is not None:
        for pid, hostpid in list(procs):
            if hostpid > 0 and not host_pid_alive(host_proc, hostpid):
                # SIGKILLed: the slot stays until a later process compacts; it uses nothing.
                del procs[(pid, hostpid)]
                detail = f"pid {pid} (host pid {hostpid}) has a slot but no process"
                anomalies.append(Anomaly("stale_process", detail, value=hostpid))

    _report_anomalies(st, anomalies, stamp, events)

    # A slot left out as torn_read is still there: its process has not exited.
    torn = any(a.kind == "torn_read" for a in snap.anomalies)
    gone = set() if torn else st.procs - procs.keys()
    for pk in sorted(gone):
        events.append(stamp(ProcessExited, cid=st.cid, pid=pk[0], hostpid=pk[1]))
        for rk in [rk for rk in st.rows if rk[:2] == pk]:
            del st.rows[rk]
    for pk in sorted(procs.keys() - st.procs):
        events.append(stamp(ProcessStarted, cid=st.cid, pid=pk[0], hostpid=pk[1]))
    st.procs = (st.procs - gone) | procs.keys()

    changed: list[UsageRow] = []
    seen: set[RowKey] = set()
    for rows in procs.values():
        for row in rows:
            rk = (row.pid, row.hostpid, row.device)
            seen.add(rk)
            if st.rows.get(rk) != row:
                st.rows[rk] = row
                changed.append(row)
    for rk in sorted(k for k in st.rows.keys() - seen if k[:2] not in st.procs or not torn):
        # The device dropped out of the slot (counters back to zero): state that absolutely.
        del st.rows[rk]
        changed.append(UsageRow(rk[0], rk[1], rk[2], 0, 0, 0, 0, 0, 0))
    if changed:
        events.append(stamp(UsageSample, cid=st.cid, rows=changed))
    return events


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
