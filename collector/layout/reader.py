"""Consistent, read-only snapshots of one cache file.

The file is opened O_RDONLY and read with `pread`, never mmap: touching a mapping past the end
of a file that shrank under us raises SIGBUS and kills the process, while `pread` just comes back
short. Only the header, the slots below `proc_num` and the tail are read, not the whole region.
"""

from __future__ import annotations

import os
import stat
import struct
from dataclasses import dataclass
from functools import cache

from .declarations import MAX_DEVICES, MAX_PROCS, UUID_LEN, Layout
from .detect import HEADER_BYTES, detect
from .snapshot import Anomaly, DeviceInfo, DeviceUsage, ProcSnapshot, Snapshot, empty_snapshot

U64_MASK = (1 << 64) - 1
WRAP = 1 << 63  # a u64 counter this large went below zero (HAMi issue #1181)
DEFAULT_RETRIES = 64


@dataclass(frozen=True)
class _Codec:
    """struct formats for one layout, derived from its declaration."""

    pid: struct.Struct
    status: struct.Struct
    used: struct.Struct
    monitorused: struct.Struct
    util: struct.Struct | None
    limits: struct.Struct
    tail: struct.Struct
    seqlock: struct.Struct


@cache
def _codec(layout: Layout) -> _Codec:
    return _Codec(
        pid=struct.Struct("<ii"),
        status=struct.Struct("<i"),
        used=struct.Struct(f"<{MAX_DEVICES * layout.dm_words}Q"),
        monitorused=struct.Struct(f"<{MAX_DEVICES}Q"),
        util=None
        if layout.device_util is None
        else struct.Struct(f"<{MAX_DEVICES * layout.du_words}Q"),
        limits=struct.Struct(f"<{MAX_DEVICES}Q"),
        tail=struct.Struct("<iiii"),
        seqlock=struct.Struct("<Q"),
    )


class _File:
    """pread on an open descriptor; reads past the end come back short, never raise."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def read_at(self, offset: int, length: int) -> bytes:
        try:
            return os.pread(self.fd, length, offset)
        except OSError:
            return b""


def _uuid(raw: bytes) -> tuple[str, bool]:
    end = raw.find(b"\0")
    text = raw if end < 0 else raw[:end]
    shown = text.decode("ascii", "backslashreplace")
    valid = (
        end >= 0
        and text[:4] in (b"GPU-", b"MIG-")
        and len(text) > 4
        and all(0x21 <= c < 0x7F for c in text)
    )
    return shown, valid


def _read_slots(
    f: _File, layout: Layout, count: int, retries: int, anomalies: list[Anomaly]
) -> list[tuple[int, bytes]]:
    """Slot bytes for slots [0, count) that lie wholly inside the file, each consistent."""
    size = layout.slot_size
    start = layout.procs
    seq = layout.slot_seqlock
    # seqlock: seq (read r0) -> slot (read r1) -> seq (read r2); each a separate read, so
    # they are ordered. Without a seqlock two reads of the slot must agree.
    before = f.read_at(start, count * size) if seq is not None else b""
    data = f.read_at(start, count * size)
    after = f.read_at(start, count * size)
    whole = min(len(data), len(after)) // size
    if seq is not None:
        whole = min(whole, len(before) // size)
    slots: list[tuple[int, bytes]] = []
    for k in range(whole):
        lo = k * size
        if seq is not None:
            s0 = before[lo + seq : lo + seq + 8]
            ok = s0 == after[lo + seq : lo + seq + 8] and not s0[0] & 1
        else:
            ok = data[lo : lo + size] == after[lo : lo + size]
        slot = data[lo : lo + size] if ok else _retry_slot(f, layout, k, retries)
        if slot is None:
            detail = f"slot {k} still changing after {retries} retries"
            anomalies.append(Anomaly("torn_read", detail, slot=k))
            continue
        if len(slot) < size:
            break  # the file shrank while we retried
        slots.append((k, slot))
    return slots


def _retry_slot(f: _File, layout: Layout, k: int, retries: int) -> bytes | None:
    off = layout.slot_offset(k)
    seq = layout.slot_seqlock
    for _ in range(retries):
        if seq is not None:
            s0 = f.read_at(off + seq, 8)
            slot = f.read_at(off, layout.slot_size)
            s1 = f.read_at(off + seq, 8)
            if len(s0) == 8 and s0 == s1 and not s0[0] & 1:
                return slot
        else:
            first = f.read_at(off, layout.slot_size)
            slot = f.read_at(off, layout.slot_size)
            if first == slot:
                return slot
        if len(slot) < layout.slot_size:
            return slot  # gone past the end: the caller stops here
    return None


def _parse_proc(
    layout: Layout, k: int, raw: bytes, ndev: int, anomalies: list[Anomaly]
) -> ProcSnapshot:
    c = _codec(layout)
    pid, hostpid = c.pid.unpack_from(raw, 0)
    (status,) = c.status.unpack_from(raw, layout.slot_status)
    used = c.used.unpack_from(raw, layout.slot_used)
    mon = c.monitorused.unpack_from(raw, layout.slot_monitorused)
    util = c.util.unpack_from(raw, layout.slot_device_util or 0) if c.util else None
    dm, du = layout.dm_words, layout.du_words
    devices: list[DeviceUsage] = []
    for d in range(MAX_DEVICES):
        ctx, mod, data, _offset, total = used[d * dm : d * dm + 5]
        monitor = mon[d]
        sm = util[d * du + 2] if util is not None else 0
        if d >= ndev and not (ctx or mod or data or total or monitor or sm):
            continue
        devices.append(DeviceUsage(d, ctx, mod, data, total, monitor, sm))
        for name, value in (
            ("context", ctx),
            ("module", mod),
            ("data", data),
            ("total", total),
            ("monitor", monitor),
        ):
            if value >= WRAP:
                detail = f"{name}={value} on device {d} went below zero as u64"
                anomalies.append(Anomaly("counter_wrapped", detail, slot=k, device=d, value=value))
        if (ctx + mod + data) & U64_MASK != total:
            detail = f"total {total} != context+module+data {ctx + mod + data} on device {d}"
            anomalies.append(Anomaly("total_mismatch", detail, slot=k, device=d, value=total))
    return ProcSnapshot(k, pid, hostpid, status, devices)


def _scan_contiguous(
    f: _File, layout: Layout, size: int, retries: int, anomalies: list[Anomaly]
) -> list[tuple[int, bytes]]:
    """proc_num lies past the end of a truncated file: take slots up to the first empty one."""
    inside = max(0, min(MAX_PROCS, (size - layout.procs) // layout.slot_size))
    slots = _read_slots(f, layout, inside, retries, anomalies)
    for n, (_, raw) in enumerate(slots):
        if raw.count(0) == len(raw):
            return slots[:n]
    return slots


def snapshot_fd(fd: int, path: str, *, retries: int = DEFAULT_RETRIES) -> Snapshot:
    """Snapshot of an open, read-only descriptor. Never raises for file content."""
    f = _File(fd)
    try:
        st = os.fstat(fd)
    except OSError as exc:
        return empty_snapshot(path, 0, [Anomaly("unreadable", f"fstat failed: {exc.strerror}")])
    if not stat.S_ISREG(st.st_mode):
        return empty_snapshot(path, 0, [Anomaly("unreadable", "not a regular file")])
    size = st.st_size
    header = f.read_at(0, HEADER_BYTES)
    found = detect(size, header, f.read_at)
    anomalies = list(found.anomalies)
    layout = found.layout
    if layout is None:
        return empty_snapshot(
            path,
            size,
            anomalies,
            initialized=found.initialized,
            major=found.major,
            minor=found.minor,
        )
    if size < layout.region_size:
        anomalies.append(
            Anomaly("truncated", f"{size} bytes, {layout.name} needs {layout.region_size}")
        )
    codec = _codec(layout)
    # Bytes a truncated file lacks read as zero; the `truncated` anomaly says so.
    header = header.ljust(HEADER_BYTES, b"\0")
    device_num = _u64_at(header, layout.device_num)
    ndev = min(device_num, MAX_DEVICES)
    if device_num > MAX_DEVICES:
        detail = f"device_num {device_num} is above {MAX_DEVICES}"
        anomalies.append(Anomaly("device_num_out_of_range", detail, value=device_num))
    limits = codec.limits.unpack_from(header, layout.limit)
    sm_limits = codec.limits.unpack_from(header, layout.sm_limit)
    devices: list[DeviceInfo] = []
    for d in range(ndev):
        off = layout.uuids + d * UUID_LEN
        uuid, valid = _uuid(header[off : off + UUID_LEN])
        if not valid:
            anomalies.append(Anomaly("invalid_uuid", f"uuid {uuid!r} on device {d}", device=d))
        devices.append(DeviceInfo(d, uuid, limits[d], sm_limits[d]))

    tail_len = layout.region_size - layout.proc_num
    tail = f.read_at(layout.proc_num, tail_len)
    proc_num = 0
    priority = utilization_switch = recent_kernel = 0
    last_kernel_time: int | None = None
    if len(tail) >= codec.tail.size:
        proc_num, utilization_switch, recent_kernel, priority = codec.tail.unpack_from(tail, 0)
        if (
            layout.last_kernel_time is not None
            and len(tail) >= layout.last_kernel_time - layout.proc_num + 8
        ):
            (last_kernel_time,) = codec.seqlock.unpack_from(
                tail, layout.last_kernel_time - layout.proc_num
            )
        if not 0 <= proc_num <= MAX_PROCS:
            detail = f"proc_num {proc_num} is outside 0..{MAX_PROCS}"
            anomalies.append(Anomaly("proc_num_out_of_range", detail, value=proc_num))
        count = min(max(proc_num, 0), MAX_PROCS)
        slots = _read_slots(f, layout, count, retries, anomalies)
    else:
        slots = _scan_contiguous(f, layout, size, retries, anomalies)

    procs = [_parse_proc(layout, k, raw, ndev, anomalies) for k, raw in slots]
    _check_limits(devices, procs, anomalies)
    return Snapshot(
        path=path,
        size=size,
        initialized=True,
        layout=layout.name,
        major=found.major,
        minor=found.minor,
        device_num=device_num,
        devices=devices,
        proc_num=proc_num,
        procs=procs,
        priority=priority,
        utilization_switch=utilization_switch,
        recent_kernel=recent_kernel,
        last_kernel_time=last_kernel_time,
        anomalies=anomalies,
    )


def _u64_at(buf: bytes, off: int) -> int:
    return int.from_bytes(buf[off : off + 8], "little")


def _check_limits(
    devices: list[DeviceInfo], procs: list[ProcSnapshot], anomalies: list[Anomaly]
) -> None:
    # HAMi enforces the limit on the sum over the container's live processes.
    for dev in devices:
        if dev.limit_bytes == 0:
            continue
        used = sum(u.total for p in procs if p.live for u in p.devices if u.index == dev.index)
        if used > dev.limit_bytes:
            detail = (
                f"live processes use {used} bytes on device {dev.index}, limit {dev.limit_bytes}"
            )
            anomalies.append(Anomaly("over_limit", detail, device=dev.index, value=used))


def read_snapshot(path: str | os.PathLike[str], *, retries: int = DEFAULT_RETRIES) -> Snapshot:
    """Snapshot of the file at `path`. Raises OSError only when it cannot be opened."""
    # O_NONBLOCK: a hostile FIFO named *.cache must not hang the open.
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        return snapshot_fd(fd, os.fspath(path), retries=retries)
    finally:
        os.close(fd)
