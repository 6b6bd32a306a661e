"""Current values per container billing row (for OTLP gauges), as of the newest event time of
each container's source."""

from __future__ import annotations

from collections.abc import Iterable

from ...events import (
    ContainerAppeared,
    ContainerGone,
    ContainerRun,
    ContainerState,
    LimitsChanged,
    ProcessExited,
    UsageSample,
)
from ..records import Gauge
from .apply import limits_ok, row_ok
from .progress import Progress
from .settings import NEVER
from .state import Supersede, Track, unpacked

__all__ = ["gauges"]


def gauges(
    tracks: Iterable[Track], progress: Progress, gap: int, flushed: int | None = None
) -> list[Gauge]:
    """Current values per container billing row, as of the newest event time of its source
    (events not yet integrated included; late ones judged by their own ts, roughly), or of
    `flushed` when later (the time `Aggregator.flush` ran every value to). Node rows have no
    gauges."""
    rows: dict[tuple[str, str, str, str], list[int]] = {}
    for tr in tracks:
        if tr.uuids is not None:
            continue
        now = progress.now(tr.source)
        if flushed is not None and flushed > now:
            now = flushed
        ident = None if tr.pod_uid is None else (tr.pod_uid, tr.container)
        table = {i: (d.uuid, d.limit) for i, d in tr.devs.items() if d.uuid is not None}
        limits_ts = -NEVER if tr.limits_ts is None else tr.limits_ts
        keys = {k: (v[0], v[1], v[2], v[3]) for k, v in tr.keys.items()}
        alive = tr.alive
        last = tr.last_ts
        run, run_seq = tr.run, tr.run_seq
        for e in sorted(tr.pending):
            ts = e[1]
            p = unpacked(e[4])
            if isinstance(p, ContainerGone | Supersede):
                keys = {k: v for k, v in keys.items() if v[3] > ts}
                if last <= ts:
                    alive = False
                    ident = None
                continue
            if isinstance(p, ContainerRun):
                run = p.running  # pending ones are in (time, seq) order
                continue
            if isinstance(p, ContainerState) and p.running is not None and e[2] > run_seq:
                run = p.running
            if ts >= last:
                alive = True
                last = ts
            if isinstance(p, ContainerAppeared | ContainerState):
                ident = (p.pod_uid, p.container)
            if isinstance(p, ContainerAppeared | ContainerState | LimitsChanged) and (
                ts >= limits_ts
            ):
                table = {x.index: (x.uuid, x.limit_bytes if limits_ok(x) else 0) for x in p.devices}
                limits_ts = ts
            if isinstance(p, UsageSample | ContainerState):
                for r in p.rows:
                    if not row_ok(r):
                        continue
                    k = (r.pid, r.hostpid, r.device)
                    old = keys.get(k)
                    if old is None or old[3] <= ts:
                        keys[k] = (r.total, r.monitor, r.sm_util, ts)
            if isinstance(p, ContainerState):
                stated = {(r.pid, r.hostpid, r.device) for r in p.rows}
                keys = {k: v for k, v in keys.items() if k in stated or v[3] > ts}
            elif isinstance(p, ProcessExited):
                proc = (p.pid, p.hostpid)
                keys = {k: v for k, v in keys.items() if k[:2] != proc or v[3] > ts}
        if ident is None:
            continue
        present = alive and last + gap > now and run is not False
        usage: dict[int, list[int]] = {}
        for k, v in keys.items():
            if v[3] + gap > now:
                u = usage.setdefault(k[2], [0, 0, 0])
                u[0] += v[0]
                u[1] += v[1]
                u[2] += v[2]
        limits: dict[str, int] = {}  # a GPU listed at several indices: its slices add up
        for dev in set(usage) | (set(table) if present else set()):
            if dev not in table:
                continue
            uuid, limit = table[dev]
            u = usage.get(dev, [0, 0, 0])
            g = rows.setdefault((tr.node, ident[0], ident[1], uuid), [0, 0, 0, 0])
            g[0] += u[0]
            limits[uuid] = limits.get(uuid, 0) + (limit if present else 0)
            g[2] += u[2]
            g[3] += u[1]
        for uuid, limit in limits.items():
            # An older and a newer track of one container name one row: its limit once.
            g = rows[(tr.node, ident[0], ident[1], uuid)]
            g[1] = max(g[1], limit)
    return [
        Gauge(
            node=node,
            pod_uid=pod_uid,
            container=container,
            device_uuid=uuid,
            memory_used_bytes=g[0],
            memory_limit_bytes=g[1],
            sm_percent=g[2],
            nvml_memory_bytes=g[3],
        )
        for (node, pod_uid, container, uuid), g in sorted(rows.items())
    ]
