"""NVML against the cache files, once per scan: inventory, accounting drift, unaccounted use.

The join: a cache file's device table maps its index to an NVML uuid (`GPU-…`, or `MIG-…` for a
MIG instance), its live slots carry the host pid, and NVML lists (host pid, usedGpuMemory) per
GPU or MIG instance. Per live process with a known host pid, per device uuid of its file that
NVML listed this interval (a uuid at several indices, slices of one GPU, summed over them):

* `accounting_drift`: NVML's bytes against `used.total` (what HAMi enforces and what is billed),
  and against `monitorused` where it is non-zero (HAMi's utilization watcher only runs in some
  containers, so 0 means "not written", not "uses nothing"). A process NVML does not list on that
  device uses 0 bytes there. Drift counts both ways: a cache that under-reports (tenant code
  rewrote its own counters) and one that over-reports (HAMi accounting bugs: a u64 underflow,
  usage that never drops). Tolerance: `max(bytes, ratio * NVML bytes)`. An N/A usedGpuMemory
  (None) makes no claim either way.
* `unaccounted_process`: a process NVML lists on a device that no file accounts for (no live slot
  with that host pid in a file whose device table holds that uuid). cid -1, path "". The node
  sample's `unaccounted_bytes` of a device is their bytes less the used.total of the live slots
  whose host pid HAMi has not learnt (their containers are billed for them), never below 0.

Both are reported once when they have held for `confirm` consecutive intervals (the file and
NVML are read a few ms apart; a process that allocates in between, or whose host pid HAMi has not
filled in yet, must not raise an alarm) and again only after having cleared. An interval in
which a device's processes could not be read leaves that device's state as it was.
`nvml_error` (per failing call scope, or value out of range: see nvml.py) and `nvml_timeout`
are reported once while they persist.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Generic, TypeVar

from ..events import (
    DeviceInventory,
    DeviceUsageRow,
    Event,
    GpuInfo,
    LayoutAnomaly,
    NodeDeviceSample,
)
from .diff import FileState, Stamp
from .nvml import NvmlDevice, NvmlProcess, NvmlReading, NvmlSource

MiB = 1 << 20
DEFAULT_TOLERANCE_BYTES = 64 * MiB
DEFAULT_TOLERANCE_RATIO = 0.05
DEFAULT_CONFIRM = 2


@dataclass(frozen=True)
class DriftTolerance:
    bytes: int = DEFAULT_TOLERANCE_BYTES
    ratio: float = DEFAULT_TOLERANCE_RATIO

    @functools.cached_property
    def _ratio(self) -> Fraction:
        # The ratio as written (0.7 is 7/10): the float product could land a byte below it.
        return Fraction(repr(self.ratio))

    def allowed(self, nvml: int) -> int:
        r = self._ratio
        return max(self.bytes, nvml * r.numerator // r.denominator)

    def drifts(self, nvml: int, cache: int) -> bool:
        return abs(cache - nvml) > self.allowed(nvml)


K = TypeVar("K", bound=Hashable)
DriftKey = tuple[int, int, int, str]  # (cid, pid, hostpid, uuid)
ProcKey = tuple[int, str]  # (host pid, uuid)


class _Persisting(Generic[K]):
    """Conditions keyed by K: report a key once it held `confirm` consecutive known intervals;
    forget it when a known interval does not have it (so it is reported again if it returns)."""

    def __init__(self, confirm: int) -> None:
        self.confirm = max(1, confirm)
        self.held: dict[K, int] = {}
        self.reported: set[K] = set()

    def update(self, present: Mapping[K, object], known: Callable[[K], bool]) -> list[K]:
        """The keys to report now, in order."""
        for key in [k for k in self.held if k not in present and known(k)]:
            del self.held[key]
            self.reported.discard(key)
        due: list[K] = []
        for key in sorted(present):  # type: ignore[type-var]
            self.held[key] = n = self.held.get(key, 0) + 1
            if n >= self.confirm and key not in self.reported:
                self.reported.add(key)
                due.append(key)
        return due


@dataclass(frozen=True)
class _Drift:
    st: FileState
    pid: int
    hostpid: int
    devices: tuple[int, ...]  # the file's indices of the uuid (several: slices of one GPU)
    uuid: str
    nvml: int
    listed: bool
    total: int
    monitor: int
    tolerance: int

    def detail(self) -> str:
        seen = f"NVML {self.nvml} B" if self.listed else "NVML lists no such process (0 B)"
        where = ", ".join(map(str, self.devices))
        where = f"device {where}" if len(self.devices) == 1 else f"devices {where}"
        parts = [
            f"host pid {self.hostpid} (pid {self.pid}) on {self.uuid} ({where}): "
            f"{seen}, cache used.total {self.total} B, monitorused {self.monitor} B"
        ]
        for name, cache in (("used.total", self.total), ("monitorused", self.monitor)):
            if name == "monitorused" and cache == 0:
                continue
            if abs(cache - self.nvml) > self.tolerance:
                way = "under-reports" if cache < self.nvml else "over-reports"
                parts.append(f"{name} {way} by {abs(cache - self.nvml)} B")
        return "; ".join(parts) + f" (tolerance {self.tolerance} B)"


def inventory_of(devices: Iterable[NvmlDevice]) -> list[GpuInfo]:
    """Each GPU followed by its MIG instances."""
    out: list[GpuInfo] = []
    for d in devices:
        out.append(GpuInfo(d.index, d.uuid, d.name, d.memory_total, d.mig_mode))
        out += [
            GpuInfo(m.index, m.uuid, m.name, m.memory_total, False, parent_uuid=d.uuid)
            for m in d.mig_devices
        ]
    return out


class CrossCheck:
    """Per scan: `events += crosscheck.check(ts, files, stamp)` after the files were diffed."""

    def __init__(
        self,
        source: NvmlSource,
        *,
        tolerance: DriftTolerance | None = None,
        confirm: int = DEFAULT_CONFIRM,
        inventory_every_ms: int | None = None,
    ) -> None:
        self.source = source
        self.tolerance = tolerance or DriftTolerance()
        self.inventory_every_ms = inventory_every_ms  # restate it (e.g. with each heartbeat)
        self._devices: dict[int, NvmlDevice] = {}  # last good reading per GPU index
        self._current: dict[int, NvmlDevice] = {}  # the GPUs this interval's reading read
        self._inventory: list[GpuInfo] | None = None
        self._inventory_ms = 0
        self._timeout_reported = False
        self._errors: set[str] = set()  # scopes reported
        self._drift: _Persisting[DriftKey] = _Persisting(confirm)
        self._unaccounted: _Persisting[ProcKey] = _Persisting(confirm)
        self._stale_util: _Persisting[DriftKey] = _Persisting(confirm)

    @property
    def devices(self) -> dict[int, NvmlDevice]:
        """The last good reading of each GPU, by index (replaced whole, never mutated)."""
        return self._devices

    @property
    def current(self) -> dict[int, NvmlDevice]:
        """The GPUs read in this interval, by index: what the `/metrics` gauges show. A GPU
        whose query failed (lost, timed out) stays in the inventory as last seen, but its
        last values are not served as if read now."""
        return self._current

    def close(self) -> None:
        self.source.close()

    def check(self, now_ms: int, files: Iterable[FileState], stamp: Stamp) -> list[Event]:
        poll = self.source.poll()
        if poll.reading is None:
            self._current = {}  # nothing was read this interval
            if self._timeout_reported:
                return []
            self._timeout_reported = True
            return [_node_anomaly(stamp, "nvml_timeout", poll.timeout_detail)]
        self._timeout_reported = False
        reading = poll.reading
        events: list[Event] = []
        unknown = self._update_devices(reading)
        if reading.count is not None:
            events += self._inventory_events(now_ms, stamp)
        events += self._errors_events(reading, unknown, stamp)
        events += self._join(reading, [st for st in files if st.appeared], stamp)
        return events

    # --- inventory and NVML errors -------------------------------------------------------

    def _update_devices(self, reading: NvmlReading) -> set[str]:
        """Merge the reading into the known devices; return the leaf uuids whose state is
        unknown this interval (their GPU's own query failed: last known leaves)."""
        if reading.count is None:
            self._current = {}
            return {u for d in self._devices.values() for u, _, _ in d.leaves()}
        self._current = {i: d for i, d in reading.devices.items() if 0 <= i < reading.count}
        devices: dict[int, NvmlDevice] = {}
        unknown: set[str] = set()
        for i in range(reading.count):
            dev = reading.devices.get(i)
            if dev is None:  # a failing GPU stays in the inventory as last seen
                dev = self._devices.get(i)
                if dev is not None:
                    unknown.update(u for u, _, _ in dev.leaves())
            if dev is not None:
                devices[i] = dev
        self._devices = devices
        return unknown

    def _errors_events(self, reading: NvmlReading, unknown: set[str], stamp: Stamp) -> list[Event]:
        events: list[Event] = []
        for scope, detail in sorted(reading.errors.items()):
            if scope not in self._errors:
                device = int(scope.split()[1]) if scope.startswith("device ") else None
                events.append(
                    _node_anomaly(stamp, "nvml_error", f"{scope}: {detail}", device=device)
                )
        if reading.count is None:
            kept = self._errors  # nothing below the count was asked
        else:
            kept = {s for s in self._errors if s.startswith("processes ") and s[10:] in unknown}
        self._errors = kept | reading.errors.keys()
        return events

    def _inventory_events(self, now_ms: int, stamp: Stamp) -> list[Event]:
        inventory = inventory_of(self._devices[i] for i in sorted(self._devices))
        due = self.inventory_every_ms is not None and (
            now_ms - self._inventory_ms >= self.inventory_every_ms
        )
        if inventory == self._inventory and not due:
            return []
        self._inventory, self._inventory_ms = inventory, now_ms
        return [stamp(DeviceInventory, devices=inventory)]

    # --- the join ------------------------------------------------------------------------

    def _join(self, reading: NvmlReading, files: list[FileState], stamp: Stamp) -> list[Event]:
        listed = reading.processes  # leaf uuid -> processes, for the leaves read this interval
        leaves = {u for d in self._devices.values() for u, _, _ in d.leaves()}

        def known(uuid: str) -> bool:  # this interval says whether a condition on `uuid` holds
            return uuid in listed or uuid not in leaves

        events = self._drift_events(listed, files, known, stamp)
        events += self._stale_util_events(listed, files, stamp)
        unaccounted_bytes, unaccounted = self._unaccounted_events(listed, files, known, stamp)
        events += unaccounted
        rows = [
            DeviceUsageRow(uuid, used, util or 0, unaccounted_bytes.get(uuid, 0))
            for i in sorted(self._devices)
            if i in reading.devices
            for uuid, used, util in self._devices[i].leaves()
            if uuid in listed
        ]
        if rows:
            events.append(stamp(NodeDeviceSample, rows=rows))
        return events

    def _drift_events(
        self,
        listed: Mapping[str, list[NvmlProcess]],
        files: list[FileState],
        known: Callable[[str], bool],
        stamp: Stamp,
    ) -> list[Event]:
        by_uuid = {u: {p.pid: p for p in procs} for u, procs in listed.items()}
        drifts: dict[DriftKey, _Drift] = {}
        na: set[DriftKey] = set()  # NVML says N/A: no claim either way, state kept
        for st in files:
            # NVML's bytes are the whole process's on the GPU: compare them once per uuid with
            # the sum over the file's slices of it (one uuid at several indices).
            indices: dict[str, list[int]] = {}
            for dev in st.devices:
                indices.setdefault(dev.uuid, []).append(dev.index)
            for pid, hostpid in sorted(st.procs):
                if hostpid <= 0:
                    continue  # HAMi has not learnt the host pid yet: cannot be joined
                for uuid, idx in indices.items():
                    on_device = by_uuid.get(uuid)
                    if on_device is None:
                        continue  # not a device NVML listed this interval
                    key = (st.cid, pid, hostpid, uuid)
                    proc = on_device.get(hostpid)
                    if proc is not None and proc.used_memory is None:
                        na.add(key)
                        continue
                    nvml = 0 if proc is None or proc.used_memory is None else proc.used_memory
                    rows = [r for i in idx if (r := st.rows.get((pid, hostpid, i))) is not None]
                    total = sum(r.total for r in rows)
                    monitor = sum(r.monitor for r in rows)
                    if self.tolerance.drifts(nvml, total) or (
                        monitor != 0 and self.tolerance.drifts(nvml, monitor)
                    ):
                        drifts[key] = _Drift(
                            st,
                            pid,
                            hostpid,
                            tuple(idx),
                            uuid,
                            nvml,
                            proc is not None,
                            total,
                            monitor,
                            self.tolerance.allowed(nvml),
                        )
        live_cids = {st.cid for st in files}

        def drift_known(key: DriftKey) -> bool:
            return key[0] not in live_cids or (known(key[3]) and key not in na)

        return [
            stamp(
                LayoutAnomaly,
                cid=d.st.cid,
                path=d.st.path,
                anomaly="accounting_drift",
                detail=d.detail(),
                device=d.devices[0],
                value=d.nvml,
            )
            for d in map(drifts.__getitem__, self._drift.update(drifts, drift_known))
        ]

    def _stale_util_events(
        self, listed: Mapping[str, list[NvmlProcess]], files: list[FileState], stamp: Stamp
    ) -> list[Event]:
        """`stale_utilization`: a cache row claims SM use on a device NVML says is idle (0 %)
        and lists no such process on. HAMi's watcher of 2025-2026 reset `sm_util` of a vanished
        process on device 0 only, so devices 1-15 could keep a last value forever."""
        idle = {
            uuid
            for d in self._devices.values()
            for uuid, _, util in d.leaves()
            if util == 0 and uuid in listed
        }
        stale: dict[DriftKey, tuple[FileState, int, int]] = {}
        for st in files:
            uuids = {dev.index: dev.uuid for dev in st.devices}
            for (pid, hostpid, device), row in st.rows.items():
                uuid = uuids.get(device)
                if row.sm_util <= 0 or uuid not in idle:
                    continue
                if any(p.pid == hostpid for p in listed[uuid]):
                    continue
                stale[(st.cid, pid, hostpid, uuid)] = (st, device, row.sm_util)
        events: list[Event] = []
        for key in self._stale_util.update(stale, lambda key: key[3] in listed):
            st, device, sm = stale[key]
            detail = (
                f"host pid {key[2]} (pid {key[1]}) on {key[3]} (device {device}): cache sm_util "
                f"{sm} % but NVML says the device is idle and lists no such process: a stale value"
            )
            events.append(
                stamp(
                    LayoutAnomaly,
                    cid=st.cid,
                    path=st.path,
                    anomaly="stale_utilization",
                    detail=detail,
                    device=device,
                    value=sm,
                )
            )
        return events

    def _unaccounted_events(
        self,
        listed: Mapping[str, list[NvmlProcess]],
        files: list[FileState],
        known: Callable[[str], bool],
        stamp: Stamp,
    ) -> tuple[dict[str, int], list[Event]]:
        """(unaccounted bytes per leaf uuid, anomalies due now)."""
        accounted = {
            (hostpid, dev.uuid)
            for st in files
            for _, hostpid in st.procs
            if hostpid > 0
            for dev in st.devices
        }
        unaccounted: dict[ProcKey, NvmlProcess] = {}
        nbytes: dict[str, int] = {}
        for uuid, procs in listed.items():
            for p in procs:
                if (p.pid, uuid) not in accounted:
                    unaccounted[(p.pid, uuid)] = p
                    nbytes[uuid] = nbytes.get(uuid, 0) + (p.used_memory or 0)
        # A slot whose host pid HAMi has not learnt cannot be joined, so NVML's listing of its
        # process counts above as unaccounted; its container is billed for those bytes, and the
        # node row must bill only what no container accounts for.
        for uuid, billed in _unjoinable_bytes(files).items():
            if uuid in nbytes:
                nbytes[uuid] = max(0, nbytes[uuid] - billed)
        events: list[Event] = []
        for key in self._unaccounted.update(unaccounted, lambda key: known(key[1])):
            p, uuid = unaccounted[key], key[1]
            mem = "N/A" if p.used_memory is None else f"{p.used_memory} B"
            detail = f"host pid {p.pid} on {uuid} uses {mem}; no cache file accounts for it"
            events.append(_node_anomaly(stamp, "unaccounted_process", detail, value=p.used_memory))
        return nbytes, events


def _unjoinable_bytes(files: list[FileState]) -> dict[str, int]:
    """used.total per device uuid of the live slots without a host pid (hostpid <= 0)."""
    out: dict[str, int] = {}
    for st in files:
        for pid, hostpid in st.procs:
            if hostpid > 0:
                continue
            for dev in st.devices:
                row = st.rows.get((pid, hostpid, dev.index))
                if row is not None:
                    out[dev.uuid] = out.get(dev.uuid, 0) + row.total
    return out


def _node_anomaly(
    stamp: Stamp, anomaly: str, detail: str, *, device: int | None = None, value: int | None = None
) -> Any:
    return stamp(
        LayoutAnomaly, cid=-1, path="", anomaly=anomaly, detail=detail, device=device, value=value
    )
