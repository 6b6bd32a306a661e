"""The typed result of reading one cache file: what `inspect --json` prints and the node diffs."""

from __future__ import annotations

import os

import msgspec


class Anomaly(msgspec.Struct, frozen=True, omit_defaults=True):
    """A problem found in a file. `kind` is a stable string; never rename one."""

    kind: str
    detail: str
    slot: int | None = None
    device: int | None = None
    value: int | None = None


class DeviceInfo(msgspec.Struct, frozen=True):
    index: int
    uuid: str
    limit_bytes: int
    sm_limit: int


class DeviceUsage(msgspec.Struct, frozen=True):
    index: int
    context: int
    module: int
    data: int
    total: int
    monitor: int
    sm_util: int


class ProcSnapshot(msgspec.Struct, frozen=True):
    slot: int
    pid: int
    hostpid: int
    status: int
    devices: list[DeviceUsage]

    @property
    def live(self) -> bool:
        # Since 2026-03 an exiting process writes pid=0/status=0 and leaves its counters.
        return self.pid != 0


def shown_path(path: str) -> str:
    """A path as events and `inspect` carry it: a name that is not UTF-8 (its bytes held as
    surrogates) has them escaped, `\\xff`, since no encoder takes a surrogate."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


class Snapshot(msgspec.Struct, frozen=True):
    path: str  # shown_path(): always UTF-8
    size: int
    initialized: bool
    layout: str | None
    major: int | None
    minor: int | None
    device_num: int
    devices: list[DeviceInfo]
    proc_num: int
    procs: list[ProcSnapshot]
    priority: int
    utilization_switch: int
    recent_kernel: int
    last_kernel_time: int | None
    anomalies: list[Anomaly]


def empty_snapshot(
    path: str,
    size: int,
    anomalies: list[Anomaly],
    *,
    initialized: bool = False,
    major: int | None = None,
    minor: int | None = None,
) -> Snapshot:
    """A file that could not be read as any layout: still a full object, with its anomalies."""
    return Snapshot(
        path=path,
        size=size,
        initialized=initialized,
        layout=None,
        major=major,
        minor=minor,
        device_num=0,
        devices=[],
        proc_num=0,
        procs=[],
        priority=0,
        utilization_switch=0,
        recent_kernel=0,
        last_kernel_time=None,
        anomalies=anomalies,
    )
