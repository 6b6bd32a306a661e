"""Consistent, read-only snapshots of one cache file.

The file is opened O_RDONLY and read with `pread`, never mmap: touching a mapping past the end
of a file that shrank under us raises SIGBUS and kills the process, while `pread` just comes back
short. Only the header, the slots below `proc_num` and the tail are read, not the whole region.
"""

from __future__ import annotations

import ctypes as C
import os
import re
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import msgspec

from ..events import MAX_BYTES, MAX_PERCENT
from .declarations import LAYOUTS, MAX_DEVICES, MAX_PROCS, UUID_LEN, Layout
from .detect import HEADER_BYTES, Detection, detect
from .snapshot import (
    Anomaly,
    DeviceInfo,
    DeviceUsage,
    ProcSnapshot,
    Snapshot,
    empty_snapshot,
    shown_path,
)

U64_MASK = (1 << 64) - 1
_LOW_BIT = bytes(b & 1 for b in range(256))  # bytes.translate table: each byte -> its low bit
WRAP = 1 << 63  # a u64 counter this large went below zero (HAMi issue #1181)
DEFAULT_RETRIES = 64
# A snapshot retries at most this many slots' worth of `retries` in all: a writer holds a slot
# odd for nanoseconds, so a file with many slots odd at once is a dead or hostile writer, and
# 1 024 slots held odd cost a scan 0.2 s of retries, every scan (writer_faults then reads those
# still odd at the next scan as stuck).
RETRIED_SLOTS = 4
_EMPTY_IDS = bytes(8)  # pid and hostpid of an empty slot
# Slots [proc_num, end) read along twice, as (proc_num, end, first read, second read, offset):
# the slots are each read's bytes from `offset` on (the reads begin below them).
Past = tuple[int, int, bytes, bytes, int]


@dataclass(frozen=True)
class _Codec:
    """struct formats for one layout, derived from its declaration."""

    slot: struct.Struct  # one unpack of a slot: see _slot_format
    has_util: bool
    limits: struct.Struct
    tail: struct.Struct
    seqlock: struct.Struct


# The tuple a slot struct unpacks: pid, hostpid, the 5 counters of each device (context,
# module, data, offset, total), monitorused of each device, [sm_util of each device], status.
_USED = 2
_NO_UTIL = (0,) * MAX_DEVICES


def _slot_format(layout: Layout, ndev: int = MAX_DEVICES) -> str:
    """A struct format for the fields of a slot that are read (the per-device ones for devices
    below `ndev`), skipping everything else."""
    dm, du = layout.device_memory, layout.device_util
    parts = ["<ii"]
    at = 8

    def skip_to(offset: int) -> None:
        nonlocal at
        assert offset >= at, "slot fields out of order"
        parts.append(f"{offset - at}x")
        at = offset

    skip_to(layout.slot_used)
    # context, module, data, offset, total are the first five u64 of device_memory_t.
    parts.append(f"5Q{C.sizeof(dm) - 40}x" * ndev)
    at += C.sizeof(dm) * ndev
    skip_to(layout.slot_monitorused)
    parts.append(f"{ndev}Q")
    at += 8 * ndev
    if du is not None:
        assert layout.slot_device_util is not None
        skip_to(layout.slot_device_util)
        sm_at: int = du.sm_util.offset
        parts.append(f"{sm_at}xQ{C.sizeof(du) - sm_at - 8}x" * ndev)
        at += C.sizeof(du) * ndev
    skip_to(layout.slot_status)
    parts.append("i")
    return "".join(parts)


@dataclass(frozen=True)
class _Short:
    """For a file with `ndev` devices: a struct for a slot's fields of devices below `ndev`, and
    the byte ranges of the per-device arrays from `ndev` on (all zero in the usual case)."""

    slot: struct.Struct
    used: slice
    monitorused: slice
    device_util: slice
    zeros: tuple[bytes, bytes, bytes]


def _short(layout: Layout, ndev: int) -> _Short:
    # Keyed on the name: hashing a Layout (a frozen dataclass of 25 fields) is slow.
    short = _SHORTS.get((layout.name, ndev))
    if short is None:
        short = _SHORTS[layout.name, ndev] = _make_short(layout, ndev)
    return short


_SHORTS: dict[tuple[str, int], _Short] = {}


def _make_short(layout: Layout, ndev: int) -> _Short:
    dm = C.sizeof(layout.device_memory)
    du = 0 if layout.device_util is None else C.sizeof(layout.device_util)
    util = layout.slot_device_util or 0
    used = slice(layout.slot_used + ndev * dm, layout.slot_used + MAX_DEVICES * dm)
    monitorused = slice(
        layout.slot_monitorused + ndev * 8, layout.slot_monitorused + MAX_DEVICES * 8
    )
    device_util = slice(util + ndev * du, util + MAX_DEVICES * du)
    z = [bytes(r.stop - r.start) for r in (used, monitorused, device_util)]
    fmt = struct.Struct(_slot_format(layout, ndev))
    return _Short(fmt, used, monitorused, device_util, (z[0], z[1], z[2]))


def _codec(layout: Layout) -> _Codec:
    codec = _CODECS.get(layout.name)
    if codec is None:
        codec = _CODECS[layout.name] = _make_codec(layout)
    return codec


_CODECS: dict[str, _Codec] = {}


def _make_codec(layout: Layout) -> _Codec:
    return _Codec(
        slot=struct.Struct(_slot_format(layout)),
        has_util=layout.device_util is not None,
        limits=struct.Struct(f"<{MAX_DEVICES}Q"),
        tail=struct.Struct("<iiii"),
        seqlock=struct.Struct("<Q"),
    )


def _size_now(fd: int, size: int) -> int:
    """The descriptor's size now, no more than `size` (0 if it cannot be had)."""
    try:
        return min(size, os.fstat(fd).st_size)
    except OSError:
        return 0


class _File:
    """pread on an open descriptor; reads past the end come back short, never raise. `short`:
    whether any read came back shorter than asked (the file may have been cut since its fstat)."""

    def __init__(self, fd: int, retries: int = DEFAULT_RETRIES) -> None:
        self.fd = fd
        self.short = False
        self.retries_left = retries * RETRIED_SLOTS  # this snapshot's, for `_retry_slot`

    def read_at(self, offset: int, length: int) -> bytes:
        try:
            got = os.pread(self.fd, length, offset)
        except OSError:
            got = b""
        if len(got) < length:
            self.short = True
        return got


def _cut(f: _File, size: int, layout: Layout, anomalies: list[Anomaly], at: int) -> int:
    """The size the snapshot was read at, with `truncated` put at `anomalies[at]` when it is
    short. A file cut between the fstat and the last read shows only as a short read: its
    snapshot is a truncated one, as the next scan's would be."""
    if f.short:
        size = _size_now(f.fd, size)
    if size < layout.region_size:
        detail = f"{size} bytes, {layout.name} needs {layout.region_size}"
        anomalies.insert(at, Anomaly("truncated", detail))
    return size


_UUID = re.compile(rb"(?:GPU|MIG)-[\x21-\x7e]+")  # NVML UUID: prefix, printable, no space


@lru_cache(maxsize=4096)  # a node has few distinct GPUs; the same 96 bytes come back every scan
def _uuid(raw: bytes) -> tuple[str, bool]:
    end = raw.find(b"\0")
    text = raw if end < 0 else raw[:end]
    # Escaped where not printable ASCII: a newline or ESC would forge rows in inspect's table,
    # and a UUID reaches events and metric labels as it is shown here.
    shown = "".join(chr(b) if 0x20 <= b <= 0x7E else f"\\x{b:02x}" for b in text)
    valid = end >= 0 and _UUID.fullmatch(text) is not None
    return shown, valid


def _uuid_fault(raw: bytes) -> str:
    """What is wrong with a stored UUID, without quoting it: a detail never carries bytes a
    valid cache file could not hold (they could be anyone's)."""
    end = raw.find(b"\0")
    text = raw if end < 0 else raw[:end]
    if end < 0:
        return f"no NUL in its {len(raw)} bytes"
    if text[:4] not in (b"GPU-", b"MIG-"):
        return f"{len(text)} bytes that do not begin with GPU- or MIG-"
    bad = next((i for i, b in enumerate(text) if not 0x21 <= b <= 0x7E), None)
    if bad is None:
        return "nothing after the GPU-/MIG- prefix"
    return f"{len(text)} bytes, byte {bad} is not printable ASCII"


def _read_slots(
    f: _File, layout: Layout, count: int, retries: int, anomalies: list[Anomaly], first: int = 0
) -> list[tuple[int, bytes]]:
    """Slot bytes for slots [first, first + count) that lie wholly inside the file, each
    consistent."""
    size = layout.slot_size
    start = layout.slot_offset(first)
    seq = layout.slot_seqlock
    # seqlock: seq (read r0) -> slot (read r1) -> seq (read r2); each a separate read, so
    # they are ordered. Without a seqlock two reads of the slot must agree.
    before = f.read_at(start, count * size) if seq is not None else b""
    data = f.read_at(start, count * size)
    after = f.read_at(start, count * size)
    whole = min(len(data), len(after)) // size
    if seq is not None:
        whole = min(whole, len(before) // size)
    n = whole * size
    # Fast path, the usual case: nothing changed at all between the reads (and, with a
    # seqlock, no seqlock word is odd: `[seq:n:size]` is the low byte of each).
    if seq is None:
        clean = data[:n] == after[:n]
    else:
        clean = before[:n] == after[:n] and 1 not in before[seq:n:size].translate(_LOW_BIT)
    if clean:
        return [(first + k, data[k * size : k * size + size]) for k in range(whole)]
    slots: list[tuple[int, bytes]] = []
    for k in range(whole):
        lo = k * size
        if seq is not None:
            s0 = before[lo + seq : lo + seq + 8]
            ok = s0 == after[lo + seq : lo + seq + 8] and not s0[0] & 1
        else:
            ok = data[lo : lo + size] == after[lo : lo + size]
        tries = min(retries, f.retries_left)
        slot = data[lo : lo + size] if ok else _retry_slot(f, layout, first + k, tries)
        if slot is None:
            detail = f"slot {first + k} still changing after {tries} retries"
            anomalies.append(Anomaly("torn_read", detail, slot=first + k))
            continue
        if len(slot) < size:
            break  # the file shrank while we retried
        slots.append((first + k, slot))
    return slots


def _retry_slot(f: _File, layout: Layout, k: int, retries: int) -> bytes | None:
    off = layout.slot_offset(k)
    seq = layout.slot_seqlock
    for _ in range(retries):
        f.retries_left -= 1
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
    c: _Codec,
    short: _Short,
    k: int,
    raw: bytes,
    ndev: int,
    live_used: list[int],
    anomalies: list[Anomaly],
) -> ProcSnapshot:
    """One slot. Adds its totals to `live_used` (per device) when the process is live."""
    z_used, z_mon, z_util = short.zeros
    if (
        raw[short.used] == z_used
        and raw[short.monitorused] == z_mon
        and raw[short.device_util] == z_util
    ):
        # The usual case: no counter set on a device at or above device_num; only the devices
        # below it are unpacked and listed.
        t = short.slot.unpack_from(raw, 0)
        last = ndev
    else:
        # Devices at or above device_num are listed too when a counter is set.
        t = c.slot.unpack_from(raw, 0)
        last = MAX_DEVICES
    mon_at = _USED + 5 * last
    sm_at = mon_at + last
    used = t[_USED:mon_at]
    mon = t[mon_at:sm_at]
    sms = t[sm_at : sm_at + last] if c.has_util else _NO_UTIL
    live = t[0] != 0  # pid 0 is an exit marker: its counters no longer count
    devices: list[DeviceUsage] = []
    # range(last) is the shortest: zip stops at device `last`.
    for d, ctx, mod, data, total, monitor, sm in zip(
        range(last), used[0::5], used[1::5], used[2::5], used[4::5], mon, sms, strict=False
    ):
        if d >= ndev and not (ctx or mod or data or total or monitor or sm):
            continue
        if unbillable(ctx, mod, data, total, monitor, sm):
            # Never billed nor sent: the device's row is left out of the slot.
            _impossible(k, d, ctx, mod, data, total, monitor, sm, anomalies)
            continue
        devices.append(DeviceUsage(d, ctx, mod, data, total, monitor, sm))
        if live:
            live_used[d] += total
        if (ctx + mod + data) & U64_MASK != total:
            detail = f"total {total} != context+module+data {ctx + mod + data} on device {d}"
            anomalies.append(Anomaly("total_mismatch", detail, slot=k, device=d, value=total))
    return ProcSnapshot(k, t[0], t[1], t[-1], devices)


def parse_slot(
    layout: Layout, k: int, raw: bytes, device_num: int
) -> tuple[ProcSnapshot, list[Anomaly]]:
    """Slot `k`'s bytes as a snapshot parses them, for slots read outside `snapshot_fd` (past
    proc_num, or a stuck seqlock's). `raw` must be a whole slot."""
    anomalies: list[Anomaly] = []
    ndev = min(device_num, MAX_DEVICES)
    live_used = [0] * MAX_DEVICES
    proc = _parse_proc(_codec(layout), _short(layout, ndev), k, raw, ndev, live_used, anomalies)
    return proc, anomalies


def unbillable(ctx: int, mod: int, data: int, total: int, monitor: int, sm: int) -> bool:
    """Whether a device's counters in a slot are beyond any device (a u64 gone below zero among
    them): its row is left out of the slot, never billed (the simulator's ground truth asks
    the same)."""
    return ctx | mod | data | total | monitor > MAX_BYTES or sm > MAX_PERCENT


def _impossible(
    k: int,
    d: int,
    ctx: int,
    mod: int,
    data: int,
    total: int,
    monitor: int,
    sm: int,
    out: list[Anomaly],
) -> None:
    """`counter_wrapped` for a u64 that went below zero (HAMi #1181), `counter_out_of_range` for
    one larger than any device (events.MAX_BYTES) or a percentage beyond events.MAX_PERCENT."""
    named = (("context", ctx), ("module", mod), ("data", data), ("total", total))
    for name, value in (*named, ("monitor", monitor)):
        if value >= WRAP:
            detail = f"{name}={value} on device {d} went below zero as u64"
            out.append(Anomaly("counter_wrapped", detail, slot=k, device=d, value=value))
        elif value > MAX_BYTES:
            detail = f"{name}={value} on device {d} is larger than any device"
            out.append(Anomaly("counter_out_of_range", detail, slot=k, device=d, value=value))
    if sm > MAX_PERCENT:
        detail = f"sm_util={sm} on device {d} is above {MAX_PERCENT}"
        out.append(Anomaly("counter_out_of_range", detail, slot=k, device=d, value=sm))


def _scan_contiguous(
    f: _File, layout: Layout, size: int, retries: int, anomalies: list[Anomaly]
) -> list[tuple[int, bytes]]:
    """proc_num is unknown (past the end of a truncated file) or garbled: take slots up to the
    first empty one, read a few at a time so nothing beyond the real contents is read."""
    inside = max(0, min(MAX_PROCS, (size - layout.procs) // layout.slot_size))
    slots: list[tuple[int, bytes]] = []
    pos, chunk = 0, 8
    while pos < inside:
        n = min(chunk, inside - pos)
        got = _read_slots(f, layout, n, retries, anomalies, pos)
        if not got:
            return slots  # the file shrank
        for k, raw in got:
            if raw.count(0) == len(raw):
                return slots
            slots.append((k, raw))
        pos, chunk = pos + n, chunk * 2
    return slots


def _within_contents(
    slots: list[tuple[int, bytes]],
    proc_num: int,
    anomalies: list[Anomaly],
    counted: int | None = None,
) -> list[tuple[int, bytes]]:
    """The slots of the file's real contents. HAMi-core fills a slot before it counts it, so
    an all-zero slot below `proc_num` is either the exit marker of a process that exited before
    it had a host pid or any memory (pid and status 0, its counters untouched: all zero), or a
    sign that the count is garbled. The count is the writer's, and every empty slot below it an
    exit marker, when its last slot holds something, or when it is `counted` (the count of this
    file's last snapshot that took it for the writer's) or rose from it by empty slots only: an
    exit never changes the count, so a CUDA probe that ended last leaves its marker as the last
    counted slot (`_counted`). Otherwise the count is taken for garbled and the slots end at
    the first empty one: what lies beyond is not the file's real contents, at most stale
    copies."""
    for n, (k, raw) in enumerate(slots):
        if _empty(raw):
            if not _empty(slots[-1][1]) or _counted(slots, proc_num, counted):
                return slots  # exit markers: read as slots whose process is not live
            detail = f"proc_num {proc_num} but slot {k} is empty"
            anomalies.append(Anomaly("proc_num_out_of_range", detail, slot=k, value=proc_num))
            return slots[:n]
    return slots


def _counted(slots: list[tuple[int, bytes]], proc_num: int, counted: int | None) -> bool:
    """The count is `counted`, or rose from it by slots that are all empty: HAMi-core fills a
    slot before it counts it, so a slot added since is a process that has exited already (a
    probe that lived between two scans)."""
    if counted is None or not 0 <= counted <= proc_num:
        return False
    return all(_empty(raw) for k, raw in slots if k >= counted)


def _bearing(counted: int | None, block: bytes, slot_size: int) -> int | None:
    """`counted` where it can bear on how `block` (the slots below proc_num) is read: only
    when its last slot is empty; else None, so that a parse memo made with another count is
    still the same reading (a count that moved on would miss it the scan after every change)."""
    if len(block) >= slot_size and _empty(block[-slot_size:]):
        return counted
    return None


def _empty(raw: bytes) -> bool:
    return raw.startswith(_EMPTY_IDS) and raw.count(0) == len(raw)  # pid, hostpid 0: cheap


# What detect() reads of the header lies below every layout's first slot, so a header memo
# keyed on the bytes below `procs` covers everything detection and the device table read.
assert max(lay.uuids + 4 for lay in LAYOUTS.values()) <= min(lay.procs for lay in LAYOUTS.values())


class ParseMemo:
    """What the last snapshot of one file parsed, reused where its bytes are the same.

    Parsing is a pure function of the bytes read (and the layout and device count), so a slot
    whose consistent bytes equal last scan's, compared in full, parses to the same
    `ProcSnapshot` and anomalies: those objects are reused instead of rebuilt. Reading is never
    skipped: every snapshot still reads and checks every byte it uses. One memo per file; it
    holds the last scan's slots only (at most `MAX_PROCS`).

    While the header is as last scan's the layout is known before anything is read, so the
    snapshot is taken in four reads (`_snapshot_known`): the tail with the bytes detection
    probed, the header with the seqlock words before, the slots, the slots again; in two
    while the header and slots read as the last read that passed the protocol.
    """

    __slots__ = ("header", "slots", "block", "last", "past")

    def __init__(self) -> None:
        self.header: _Header | None = None
        # (tail bytes, the snapshot, the bytes below the tail `_snapshot_known` read, or None):
        # returned again when nothing it was made of changed
        self.last: tuple[bytes, Snapshot, bytes | None] | None = None
        # slot -> (the _Short it was parsed with, its bytes, the proc, its anomalies)
        self.slots: dict[int, tuple[_Short, bytes, ProcSnapshot, list[Anomaly]]] = {}
        # slots [0, proc_num) in one piece, and the `counted` they were read with -> the procs,
        # their anomalies and live totals
        self.block: (
            tuple[_Short, bytes, int | None, list[ProcSnapshot], list[Anomaly], tuple[int, ...]]
            | None
        ) = None
        # The slots past proc_num the last snapshot read along (see `snapshot_fd`'s `ahead`):
        # (proc_num, end slot, first read, second read, where in the reads they begin), or
        # None when it read none.
        self.past: Past | None = None


@dataclass(frozen=True, eq=False)
class _Header:
    """What detection and the device table made of a header, and the bytes they read."""

    size: int
    below: bytes  # the header below the first slot (all that detection and the table read)
    probes: tuple[tuple[int, bytes], ...]  # what detection read beyond it, as (offset, bytes)
    found: Detection
    device_num: int
    devices: list[DeviceInfo]
    anomalies: list[Anomaly]  # the device table's
    # One read of [lo, hi) covers the tail and every probe.
    lo: int
    hi: int


def _header_memo(
    size: int,
    below: bytes,
    probes: tuple[tuple[int, bytes], ...],
    found: Detection,
    device_num: int,
    devices: list[DeviceInfo],
    anomalies: list[Anomaly],
) -> _Header:
    layout = found.layout
    assert layout is not None
    lo = min([layout.proc_num, *(off for off, _ in probes)])
    hi = max([layout.region_size, *(off + len(was) for off, was in probes)])
    return _Header(size, below, probes, found, device_num, devices, anomalies, lo, hi)


def snapshot_fd(
    fd: int,
    path: str,
    *,
    retries: int = DEFAULT_RETRIES,
    memo: ParseMemo | None = None,
    st: os.stat_result | None = None,
    ahead: Callable[[int], int] | None = None,
    counted: int | None = None,
) -> Snapshot:
    """Snapshot of an open, read-only descriptor. Never raises for file content.

    `counted`: the proc_num of this file's last snapshot that took it for the writer's (no
    `proc_num_out_of_range`), which `_within_contents` trusts when it ends in exit markers.

    `st`: the descriptor's `fstat` when the caller has just taken it (the collector, which
    checks the file it keeps open on each scan); `memo`: see `ParseMemo`. `ahead`: for a
    proc_num, the slot up to which to read along past it (the writer-fault checks look there;
    reading them with the slots saves those reads), left in `memo.past`."""
    if memo is not None:
        memo.past = None  # until this snapshot reads them along
    if st is None:
        try:
            st = os.fstat(fd)
        except OSError as exc:
            detail = f"fstat failed: {exc.strerror}"
            return empty_snapshot(path, 0, [Anomaly("unreadable", detail)])
    if not stat.S_ISREG(st.st_mode):
        return empty_snapshot(path, 0, [Anomaly("unreadable", "not a regular file")])
    size = st.st_size
    known = memo.header if memo is not None else None
    if known is not None and known.size == size:
        assert memo is not None
        snap = _snapshot_known(fd, path, size, memo, known, ahead, counted)
        if snap is not None:
            return snap
        memo.past = None  # (the attempt may have read them; the general path reads afresh)
    f = _File(fd, retries)
    header = f.read_at(0, HEADER_BYTES)
    header_hit = (
        known is not None
        and known.size == size
        and header.startswith(known.below)
        and all(f.read_at(off, len(was)) == was for off, was in known.probes)
    )
    if header_hit:
        # The same size, header and probed bytes as last scan: detection and the device
        # table are pure functions of them.
        assert known is not None
        found, device_num, devices, device_anomalies = (
            known.found,
            known.device_num,
            known.devices,
            known.anomalies,
        )
        layout = found.layout
        assert layout is not None
        anomalies = list(found.anomalies)
    else:
        probes: list[tuple[int, bytes]] = []

        def read_at(offset: int, length: int) -> bytes:
            got = f.read_at(offset, length)
            probes.append((offset, got))
            return got

        found = detect(size, header, read_at)
        anomalies = list(found.anomalies)
        layout = found.layout
        if layout is None:
            if memo is not None:
                memo.header = memo.last = None
            return empty_snapshot(
                path,
                size,
                anomalies,
                initialized=found.initialized,
                major=found.major,
                minor=found.minor,
            )
        # Bytes a truncated file lacks read as zero; the `truncated` anomaly says so.
        padded = header.ljust(HEADER_BYTES, b"\0")
        device_num, devices, device_anomalies = _devices(_codec(layout), layout, padded)
        if memo is not None:
            # Detection and the device table read the header only below `procs` (the rest
            # of HEADER_BYTES is the first slot's, which changes all the time).
            memo.header = _header_memo(size, header[: layout.procs], tuple(probes), found,
                                       device_num, devices, device_anomalies)  # fmt: skip
    codec = _codec(layout)
    ndev = min(device_num, MAX_DEVICES)

    tail_len = layout.region_size - layout.proc_num
    tail = f.read_at(layout.proc_num, tail_len)
    at = len(anomalies)  # where `truncated` goes, once every read is in (`_cut`)
    anomalies += device_anomalies
    proc_num = 0
    priority = utilization_switch = recent_kernel = 0
    last_kernel_time: int | None = None
    tail_fields = (0, 0, 0)
    if len(tail) >= codec.tail.size:
        proc_num, utilization_switch, recent_kernel, priority = codec.tail.unpack_from(tail, 0)
        tail_fields = (priority, utilization_switch, recent_kernel)
        if (
            layout.last_kernel_time is not None
            and len(tail) >= layout.last_kernel_time - layout.proc_num + 8
        ):
            (last_kernel_time,) = codec.seqlock.unpack_from(
                tail, layout.last_kernel_time - layout.proc_num
            )
        if 0 <= proc_num <= MAX_PROCS:
            block = _read_clean(f, layout, proc_num) if memo is not None else None
            if block is not None:
                assert memo is not None
                counted = _bearing(counted, block, layout.slot_size)
                same = header_hit and memo.block is not None and memo.block[1:3] == (block, counted)
                procs, live_used = _parse_block(
                    memo, codec, layout, ndev, block, anomalies, counted
                )
                size = _cut(f, size, layout, anomalies, at)
                last = memo.last
                if same and last is not None and last[0] == tail and last[1].path == path:
                    # Every byte the snapshot is made of is as last scan: so is the snapshot.
                    return last[1]
                _check_limits(devices, live_used, anomalies)
                snap = _snapshot(path, size, layout, found, device_num, devices, proc_num,
                                 procs, tail_fields, last_kernel_time, anomalies)  # fmt: skip
                memo.last = (tail, snap, None)
                return snap
            slots = _read_slots(f, layout, proc_num, retries, anomalies)
            slots = _within_contents(slots, proc_num, anomalies, counted)
        else:
            detail = f"proc_num {proc_num} is outside 0..{MAX_PROCS}"
            anomalies.append(Anomaly("proc_num_out_of_range", detail, value=proc_num))
            slots = _scan_contiguous(f, layout, size, retries, anomalies)
    else:
        slots = _scan_contiguous(f, layout, size, retries, anomalies)

    if memo is not None:
        memo.block = memo.last = None  # read slot by slot: compared slot by slot next scan
    short = _short(layout, ndev)
    live_used = [0] * MAX_DEVICES  # sum of `total` over live processes, per device
    if memo is None:
        procs = [_parse_proc(codec, short, k, raw, ndev, live_used, anomalies) for k, raw in slots]
    else:
        procs = _parse_memo(memo, codec, short, slots, ndev, live_used, anomalies)
    _check_limits(devices, live_used, anomalies)
    size = _cut(f, size, layout, anomalies, at)
    return _snapshot(path, size, layout, found, device_num, devices, proc_num, procs,
                     tail_fields, last_kernel_time, anomalies)  # fmt: skip


def _pread(fd: int, length: int, offset: int) -> bytes:
    try:
        return os.pread(fd, length, offset)
    except OSError:
        return b""


_TAIL = struct.Struct("<iiii")  # proc_num, utilization_switch, recent_kernel, priority
_U64 = struct.Struct("<Q")


def _redetect(fd: int, size: int, known: _Header, window: bytes) -> _Header | None:
    """`known` with the probes detection makes now (served from `window`, the bytes at
    [known.lo, known.hi), where they lie in it), or None when detection answers otherwise."""
    probes: list[tuple[int, bytes]] = []

    def read_at(offset: int, length: int) -> bytes:
        at = offset - known.lo
        inside = at >= 0 and offset + length <= known.hi
        got = window[at : at + length] if inside else _pread(fd, length, offset)
        probes.append((offset, got))
        return got

    if detect(size, known.below, read_at) != known.found:
        return None
    return _header_memo(size, known.below, tuple(probes), known.found, known.device_num,
                        known.devices, known.anomalies)  # fmt: skip


def _snapshot_known(
    fd: int,
    path: str,
    size: int,
    memo: ParseMemo,
    known: _Header,
    ahead: Callable[[int], int] | None,
    counted: int | None,
) -> Snapshot | None:
    """The snapshot of a file whose size is last scan's, in four reads while its header and
    the bytes detection probed are last scan's too and its slots below proc_num read clean
    (else None, and the caller takes the general path, reading everything again); in two
    when the first read of the header and slots is the bytes of the last read that passed.

    The same protocol as the general path, in fewer reads: proc_num is read before the slots
    (a writer fills a slot before it counts it); the seqlock words are read before the slots
    and again after them, each in a read of its own (with the header in the first), so the
    three reads are ordered; the reads of the slots run on past proc_num to `ahead(proc_num)`
    for the writer-fault checks."""
    layout = known.found.layout
    assert layout is not None
    lo = known.lo
    window = _pread(fd, known.hi - lo, lo)
    probed_moved = False
    for off, was in known.probes:  # (a loop: this runs for every file on every scan)
        if window[off - lo : off - lo + len(was)] != was:
            probed_moved = True
            break
    if probed_moved:
        # What detection probed changed (it reads proc_num, which moves whenever a process
        # starts or ends): detect again from the header below the slots (all it reads there;
        # the header read below is checked against it) and these bytes.
        redone = _redetect(fd, size, known, window)
        if redone is None:
            return None
        if (redone.lo, redone.hi) != (known.lo, known.hi):
            lo = redone.lo
            window = _pread(fd, redone.hi - lo, lo)
        known = memo.header = redone
    at = layout.proc_num - lo
    tail = window[at : at + layout.region_size - layout.proc_num]
    if len(tail) < _TAIL.size:
        return None
    proc_num, utilization_switch, recent_kernel, priority = _TAIL.unpack_from(tail, 0)
    if not 0 <= proc_num <= MAX_PROCS:
        return None
    slot_size, start, seq = layout.slot_size, layout.procs, layout.slot_seqlock
    n = start + proc_num * slot_size
    end = proc_num if ahead is None else max(proc_num, min(ahead(proc_num), MAX_PROCS))
    m = start + end * slot_size
    # Each read takes the header and the slots from 0 to `end` whole, so that two of them
    # compare as one bytes object (a change anywhere in them, even where the protocol does not
    # need it, sends the file down the general path).
    last = memo.last
    held = None if last is None else last[2]
    first = _pread(fd, m, 0)
    if (
        held is not None
        and first == held
        and (seq is None or 1 not in first[start + seq : n : slot_size].translate(_LOW_BIT))
    ):
        # Every byte is as in the last read that passed the checks below, so this read holds
        # that consistent state: a read torn by a write holds at least one byte the write
        # changed (the seqlock word it made odd, or the data), and a write that changed
        # nothing left the state as it was. Most files on a node are unchanged each second.
        # The seqlock words below proc_num are checked again: that read checked those below
        # its own proc_num, and the count may have risen over a slot held odd since.
        data = after = held
    elif seq is not None:
        # seq (read r0) -> slots (r1) -> seq (r2), each a separate read.
        data = _pread(fd, m, 0)
        after = _pread(fd, m, 0)
        if first != after or 1 in first[start + seq : n : slot_size].translate(_LOW_BIT):
            return None
    else:
        # Without a seqlock two reads of the slots must agree.
        data = first
        after = _pread(fd, m, 0)
        if data != after:
            return None
    if len(data) < n or len(after) < n:
        return None
    # Bytes equal to bytes already held are held as that one object: an unchanged file is
    # kept once (in `memo.last`, `memo.past` and the writer-fault checks' memo), not once a
    # scan and a read (at 5000 containers that was a third of the collector's memory).
    if held is not None and held == data:
        data = held
    if after == data:
        after = data
    memo.past = (proc_num, end, data, after, n)
    if (
        last is not None
        and last[2] is data  # (so the header starts with `known.below`, as it did then)
        and last[1].proc_num == proc_num
        and last[1].path == path
    ):
        # Header, size and slots as last scan: so is everything parsed from them (the procs,
        # the anomalies, the limit check), and only what the tail says can differ.
        if last[0] == tail:
            return last[1]  # every byte the snapshot is made of is as last scan
        snap = msgspec.structs.replace(
            last[1],
            priority=priority,
            utilization_switch=utilization_switch,
            recent_kernel=recent_kernel,
            last_kernel_time=_last_kernel_time(layout, tail),
        )
        memo.last = (tail, snap, data)
        return snap
    if not data.startswith(known.below):
        return None
    anomalies = list(known.found.anomalies)
    if size < layout.region_size:
        anomalies.append(
            Anomaly("truncated", f"{size} bytes, {layout.name} needs {layout.region_size}")
        )
    anomalies += known.anomalies
    ndev = min(known.device_num, MAX_DEVICES)
    procs, live_used = _parse_block(
        memo, _codec(layout), layout, ndev, data[start:n], anomalies, counted
    )
    _check_limits(known.devices, live_used, anomalies)
    snap = _snapshot(path, size, layout, known.found, known.device_num, known.devices, proc_num,
                     procs, (priority, utilization_switch, recent_kernel),
                     _last_kernel_time(layout, tail), anomalies)  # fmt: skip
    memo.last = (tail, snap, data)
    return snap


def _last_kernel_time(layout: Layout, tail: bytes) -> int | None:
    lkt = layout.last_kernel_time
    if lkt is None or len(tail) < lkt - layout.proc_num + 8:
        return None
    value: int = _U64.unpack_from(tail, lkt - layout.proc_num)[0]
    return value


def _snapshot(
    path: str,
    size: int,
    layout: Layout,
    found: Detection,
    device_num: int,
    devices: list[DeviceInfo],
    proc_num: int,
    procs: list[ProcSnapshot],
    tail_fields: tuple[int, int, int],
    last_kernel_time: int | None,
    anomalies: list[Anomaly],
) -> Snapshot:
    priority, utilization_switch, recent_kernel = tail_fields
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


def _read_clean(f: _File, layout: Layout, count: int) -> bytes | None:
    """Slots [0, count) in one piece when the usual case holds (`_read_slots`' fast path: the
    reads agree and no seqlock is odd); None otherwise, and the caller reads slot by slot."""
    size = layout.slot_size
    start = layout.slot_offset(0)
    seq = layout.slot_seqlock
    n = count * size
    # seqlock: seq (read r0) -> slot (read r1) -> seq (read r2); each a separate read.
    before = f.read_at(start, n) if seq is not None else b""
    data = f.read_at(start, n)
    after = f.read_at(start, n)
    if len(data) != n or len(after) != n:
        return None
    if seq is None:
        return data if data == after else None
    if before != after or 1 in before[seq:n:size].translate(_LOW_BIT):
        return None
    return data


def _parse_block(
    memo: ParseMemo,
    codec: _Codec,
    layout: Layout,
    ndev: int,
    block: bytes,
    anomalies: list[Anomaly],
    counted: int | None,
) -> tuple[list[ProcSnapshot], list[int]]:
    """Procs and per-device live totals of a consistent block of slots [0, count): last scan's
    when the block is the same bytes read with the same `counted`, else parsed (slot by slot
    through the memo)."""
    short = _short(layout, ndev)
    counted = _bearing(counted, block, layout.slot_size)
    last = memo.block
    if last is not None and last[0] is short and last[1] == block and last[2] == counted:
        anomalies += last[4]
        return last[3], list(last[5])
    size = layout.slot_size
    slot_anomalies: list[Anomaly] = []
    slots = [(k, block[k * size : k * size + size]) for k in range(len(block) // size)]
    slots = _within_contents(slots, len(slots), slot_anomalies, counted)
    live_used = [0] * MAX_DEVICES
    procs = _parse_memo(memo, codec, short, slots, ndev, live_used, slot_anomalies)
    memo.block = (short, block, counted, procs, slot_anomalies, tuple(live_used))
    anomalies += slot_anomalies
    return procs, live_used


def _devices(
    codec: _Codec, layout: Layout, header: bytes
) -> tuple[int, list[DeviceInfo], list[Anomaly]]:
    """device_num, the device table and what is wrong with it, from a (padded) header."""
    anomalies: list[Anomaly] = []
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
        raw = header[off : off + UUID_LEN]
        uuid, valid = _uuid(raw)
        if not valid:
            detail = f"uuid on device {d} is not an NVML UUID: {_uuid_fault(raw)}"
            anomalies.append(Anomaly("invalid_uuid", detail, device=d))
        devices.append(DeviceInfo(d, uuid, limits[d], sm_limits[d]))
    return device_num, devices, anomalies


def _parse_memo(
    memo: ParseMemo,
    codec: _Codec,
    short: _Short,
    slots: list[tuple[int, bytes]],
    ndev: int,
    live_used: list[int],
    anomalies: list[Anomaly],
) -> list[ProcSnapshot]:
    """_parse_proc of each slot, or last scan's result for a slot whose bytes are the same."""
    last = memo.slots
    now: dict[int, tuple[_Short, bytes, ProcSnapshot, list[Anomaly]]] = {}
    procs: list[ProcSnapshot] = []
    for k, raw in slots:
        hit = last.get(k)
        if hit is not None and hit[0] is short and hit[1] == raw:
            now[k] = hit
            proc, extra = hit[2], hit[3]
            if proc.pid != 0:
                for u in proc.devices:
                    live_used[u.index] += u.total
        else:
            extra = []
            proc = _parse_proc(codec, short, k, raw, ndev, live_used, extra)
            now[k] = (short, raw, proc, extra)
        anomalies += extra
        procs.append(proc)
    memo.slots = now
    return procs


def _u64_at(buf: bytes, off: int) -> int:
    return int.from_bytes(buf[off : off + 8], "little")


def _check_limits(
    devices: list[DeviceInfo], live_used: list[int], anomalies: list[Anomaly]
) -> None:
    # HAMi enforces the limit on the sum over the container's live processes.
    for dev in devices:
        used = live_used[dev.index]
        if dev.limit_bytes and used > dev.limit_bytes:
            detail = (
                f"live processes use {used} bytes on device {dev.index}, limit {dev.limit_bytes}"
            )
            # The sum of u64 counters can pass 2**64; `value` stays a u64 so msgpack can carry it.
            value = min(used, U64_MASK)
            anomalies.append(Anomaly("over_limit", detail, device=dev.index, value=value))


def read_snapshot(path: str | os.PathLike[str], *, retries: int = DEFAULT_RETRIES) -> Snapshot:
    """Snapshot of the file at `path`. Raises OSError only when it cannot be opened."""
    # O_NONBLOCK: a hostile FIFO named *.cache must not hang the open.
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        return snapshot_fd(fd, shown_path(os.fspath(path)), retries=retries)
    finally:
        os.close(fd)
