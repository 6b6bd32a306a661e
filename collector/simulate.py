"""A writer that follows HAMi-core's protocol, for every layout (tests, benchmarks, demo).

It maps the file MAP_SHARED and writes through the same ctypes declarations the reader derives
its offsets from, so a layout is described exactly once.
"""

from __future__ import annotations

import ctypes as C
import errno
import mmap
import os
import random
import time
import uuid as uuidlib
from collections.abc import Iterator, Set
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .layout.declarations import LAYOUTS, MAGIC, MAX_DEVICES, MAX_PROCS, Layout
from .layout.reader import unbillable

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class SimDevice:
    uuid: str
    limit_bytes: int = 0
    sm_limit: int = 100


class CacheWriter:
    """One container's cache file, written the way libvgpu.so writes it."""

    def __init__(
        self,
        path: Path,
        layout: Layout,
        devices: list[SimDevice],
        *,
        priority: int = 1,
        register_devices: bool = True,
    ) -> None:
        self.path = path
        self.layout = layout
        self.devices = devices
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            if os.fstat(fd).st_size < layout.region_size:
                # Like the library: seek to sizeof(region) and write one zero byte.
                os.pwrite(fd, b"\0", layout.region_size)
            self._mm = mmap.mmap(fd, layout.region_size, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.region: Any = layout.region.from_buffer(self._mm)
        if self.region.initialized_flag != MAGIC:
            self._initialise(priority, register_devices)

    def _initialise(self, priority: int, register_devices: bool) -> None:
        r = self.region
        if self.layout.version is not None:
            r.major_version, r.minor_version = self.layout.version
        for d, dev in enumerate(self.devices):
            r.limit[d] = dev.limit_bytes
            r.sm_limit[d] = dev.sm_limit
        for d in range(len(self.devices), MAX_DEVICES):
            r.sm_limit[d] = 100
        r.utilization_switch = 1
        r.recent_kernel = 2
        r.priority = priority
        r.owner_pid = os.getpid()
        if register_devices:
            self.register_devices()
        r.initialized_flag = MAGIC  # stored last: readers treat the file as empty until then

    def register_devices(self) -> None:
        """What the first NVML call of a process does: device_num and uuids."""
        r = self.region
        for d, dev in enumerate(self.devices):
            r.uuids[d].value = dev.uuid.encode()
        self._set_device_num(len(self.devices))

    def _set_device_num(self, n: int) -> None:
        if hasattr(self.region, "device_num"):
            self.region.device_num = n
        else:
            self.region.num = n

    def close(self) -> None:
        del self.region
        self._mm.close()

    # --- processes ------------------------------------------------------------------------

    @property
    def proc_num(self) -> int:
        return int(self.region.proc_num)

    def slot_of(self, pid: int) -> int | None:
        for k in range(min(max(self.proc_num, 0), MAX_PROCS)):
            if self.region.procs[k].pid == pid:
                return k
        return None

    def _slot(self, pid: int) -> Any:
        k = self.slot_of(pid)
        if k is None:
            raise KeyError(f"no live slot for pid {pid}")
        return self.region.procs[k]

    def add_process(self, pid: int, hostpid: int = 0) -> int:
        k = self.proc_num
        if k >= MAX_PROCS:
            raise RuntimeError("all process slots are taken")
        C.memset(C.addressof(self.region.procs[k]), 0, self.layout.slot_size)
        slot = self.region.procs[k]
        slot.pid = pid
        slot.hostpid = hostpid
        slot.status = 1
        self.region.proc_num = k + 1
        return k

    def reuse_slot(self, pid: int) -> int:
        """A process finds a live slot with its own pid (a restarted container's process with
        the pid of one that was killed): HAMi-core takes that slot over, zeroes its counters
        and keeps its host pid until its host-pid lookup replaces it (or times out)."""
        k = self.slot_of(pid)
        if k is None:
            raise KeyError(f"no slot for pid {pid}")
        slot = self.region.procs[k]
        slot.status = 1
        C.memset(C.addressof(slot.used), 0, C.sizeof(slot.used))
        if self.layout.device_util is not None:
            C.memset(C.addressof(slot.device_util), 0, C.sizeof(slot.device_util))
        return k

    def set_hostpid(self, pid: int, hostpid: int) -> None:
        self._slot(pid).hostpid = hostpid

    def exit(self, pid: int) -> None:
        """Clean exit. Since the seqlock layouts the process only marks its slot (pid=0,
        status=0) and leaves its counters; before that it compacted itself away at once."""
        k = self.slot_of(pid)
        if k is None:
            raise KeyError(f"no live slot for pid {pid}")
        if self.layout.slot_seqlock is not None:
            slot = self.region.procs[k]
            slot.pid = 0
            slot.status = 0
        else:
            self._remove(k)

    def _remove(self, k: int, *, clear: bool | None = None) -> None:
        for _ in self._removal(k, clear=clear):
            pass

    def _removal(self, k: int, *, clear: bool | None = None) -> Iterator[str]:
        """Slot k's removal in HAMi-core's order (`clear_proc_slot_nolock` ->
        `copy_proc_slot_atomic`), yielding after each store a reader can see on its own:
        "count" (`proc_num` lowered, the last slot not yet moved: it is at `proc_num`, past
        the count, with the hole still below), "identity" (pid, hostpid, seqlock, status
        copied into the hole), "used[d]" per registered device (the hole's other devices still
        hold what the removed process left), "copied" (the whole slot), "cleared" (the old
        last slot zeroed). `clear`: whether the old last slot is zeroed; by default only in the
        seqlock layouts, whose library copies and clears slots one field at a time (the older
        `procs[k] = procs[--proc_num]` leaves a copy of the mover past the count)."""
        if clear is None:
            clear = self.layout.slot_seqlock is not None
        r = self.region
        last = self.proc_num - 1
        r.proc_num = last
        yield "count"
        if k != last:
            dst, src = r.procs[k], r.procs[last]
            dst.pid, dst.hostpid = src.pid, src.hostpid
            if self.layout.slot_seqlock is not None:
                dst.seqlock = src.seqlock
            dst.status = src.status
            yield "identity"
            for d in range(len(self.devices)):
                C.memmove(C.addressof(dst.used[d]), C.addressof(src.used[d]), C.sizeof(src.used[d]))
                yield f"used[{d}]"
            C.memmove(C.addressof(dst), C.addressof(src), self.layout.slot_size)
            yield "copied"
        if clear:
            C.memset(C.addressof(r.procs[last]), 0, self.layout.slot_size)
            yield "cleared"

    def compaction(
        self, dead_pids: Set[int] = frozenset(), *, clear: bool | None = None
    ) -> Iterator[str]:
        """A later process removes exit markers and slots of pids it found dead, moving the
        last slot into each hole (so live processes can change slot index). A generator of
        `_removal`'s steps, so a test can scan between any two of them (the writer preempted
        mid-compaction); `compact` runs it through. `clear` as for `_removal`."""
        k = 0
        while k < self.proc_num:
            pid = self.region.procs[k].pid
            if pid == 0 or pid in dead_pids:
                yield from self._removal(k, clear=clear)
            else:
                k += 1

    def compact(self, dead_pids: Set[int] = frozenset(), *, clear: bool | None = None) -> None:
        for _ in self.compaction(dead_pids, clear=clear):
            pass

    # --- accounting -----------------------------------------------------------------------

    @contextmanager
    def _bracket(self, slot: Any) -> Iterator[None]:
        seq = self.layout.slot_seqlock is not None
        if seq:
            slot.seqlock += 1  # odd: update in progress
        yield
        if seq:
            slot.seqlock += 1

    def add_memory(self, pid: int, device: int, kind: str, nbytes: int) -> None:
        """Allocation (nbytes > 0) or free (nbytes < 0) of `context_size`/`module_size`/
        `data_size`, with `total` kept equal to their sum, inside a seqlock bracket."""
        slot = self._slot(pid)
        used = slot.used[device]
        mask = (1 << 64) - 1
        new = type(used).from_buffer_copy(used)
        field_name = f"{kind}_size"
        setattr(new, field_name, (getattr(new, field_name) + nbytes) & mask)
        new.total = (new.total + nbytes) & mask
        with self._bracket(slot):
            # One store of the whole entry. HAMi-core's stores of a field and of `total` are
            # instructions apart; two Python statements can be milliseconds apart (a thread
            # waits out the GIL's switch interval between them), a window in which two reads of
            # a layout without a seqlock can agree on a half-done update (README, Consistency).
            C.memmove(C.addressof(used), C.addressof(new), C.sizeof(new))

    def watch(self, samples: dict[int, dict[int, tuple[int, int]]]) -> None:
        """One utilization-watcher cycle: zero monitorused/sm_util of all live slots, then set
        them per process matched by hostpid. samples: hostpid -> device -> (bytes, sm %)."""
        has_util = self.layout.device_util is not None
        for k in range(min(max(self.proc_num, 0), MAX_PROCS)):
            slot = self.region.procs[k]
            if slot.pid == 0:
                continue
            for d in range(self._devices_reset(slot.hostpid, samples)):
                slot.monitorused[d] = 0
                if has_util:
                    slot.device_util[d].sm_util = 0
            for d, (mem, sm) in samples.get(slot.hostpid, {}).items():
                slot.monitorused[d] = mem
                if has_util:
                    slot.device_util[d].sm_util = sm

    def _devices_reset(self, hostpid: int, samples: dict[int, dict[int, tuple[int, int]]]) -> int:
        """How many devices (from 0) a watcher cycle resets for one live slot: all of them."""
        return MAX_DEVICES

    def live_totals(self) -> dict[int, tuple[int, int]]:
        """device -> (sum of used.total, sum of sm_util) over the live slots, as written."""
        out: dict[int, tuple[int, int]] = {}
        has_util = self.layout.device_util is not None
        for k in range(min(max(self.proc_num, 0), MAX_PROCS)):
            slot = self.region.procs[k]
            if slot.pid == 0 or slot.status == 0:
                continue
            for d in range(len(self.devices)):
                util = slot.device_util[d].sm_util if has_util else 0
                if billed(slot, d, util):
                    mem, sm = out.get(d, (0, 0))
                    out[d] = (mem + slot.used[d].total, sm + util)
        return out

    def kernel_launched(self, when: float) -> None:
        if hasattr(self.region, "last_kernel_time"):
            self.region.last_kernel_time = int(when)


# --- a node full of containers ------------------------------------------------------------


def billed(slot: Any, d: int, util: int) -> bool:
    """Whether a slot's row for device `d` is billed: not when any counter is beyond a device
    (wrapped below zero, HAMi #1181), which the reader flags and leaves out."""
    u = slot.used[d]
    return not unbillable(
        u.context_size, u.module_size, u.data_size, u.total, slot.monitorused[d], util
    )


def pod_dir(root: Path, pod_uid: str, container: str) -> Path:
    return root / f"{pod_uid}_{container}"


def new_cache_file(
    root: Path, pod_uid: str, container: str, layout: Layout, devices: list[SimDevice]
) -> CacheWriter:
    d = pod_dir(root, pod_uid, container)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # what exists is no folder
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(d)) from None
    return CacheWriter(d / f"{uuidlib.uuid4()}.cache", layout, devices)


def gpu_uuid(rng: random.Random) -> str:
    return "GPU-" + str(uuidlib.UUID(int=rng.getrandbits(128), version=4))


@dataclass
class SimProcess:
    pid: int
    hostpid: int
    memory: dict[int, int] = field(default_factory=dict)  # device -> data bytes


@dataclass
class SimContainer:
    pod_uid: str
    name: str
    writer: CacheWriter
    procs: dict[int, SimProcess] = field(default_factory=dict)
    killed: set[int] = field(default_factory=set)
    next_pid: int = 100


class NodeSimulator:
    """Drives several containers' files with random but protocol-following actions."""

    def __init__(
        self,
        root: Path,
        containers: int,
        layout: str,
        *,
        seed: int = 1,
        devices_per_container: int = 2,
        procs_per_container: int = 2,
    ) -> None:
        self.root = root
        self.rng = random.Random(seed)
        self.procs_per_container = procs_per_container
        self.hostpid = 40000
        names = list(LAYOUTS) if layout == "mixed" else [layout]
        node_gpus = [gpu_uuid(self.rng) for _ in range(max(devices_per_container, 1))]
        self.containers: list[SimContainer] = []
        for i in range(containers):
            lay = LAYOUTS[names[i % len(names)]]
            pod = str(uuidlib.UUID(int=self.rng.getrandbits(128), version=4))
            devs = [
                SimDevice(node_gpus[d], limit_bytes=(4 + d) * GiB, sm_limit=50)
                for d in range(devices_per_container)
            ]
            writer = new_cache_file(root, pod, f"ctr{i}", lay, devs)
            self.containers.append(SimContainer(pod, f"ctr{i}", writer))

    def _start(self, c: SimContainer) -> None:
        c.next_pid += 1
        self.hostpid += 1
        c.writer.add_process(c.next_pid, self.hostpid)
        c.procs[c.next_pid] = SimProcess(c.next_pid, self.hostpid)

    def step(self, now: float) -> None:
        rng = self.rng
        for c in self.containers:
            while len(c.procs) < self.procs_per_container:
                self._start(c)
            for p in list(c.procs.values()):
                d = rng.randrange(len(c.writer.devices))
                if rng.random() < 0.6:
                    n = rng.randrange(1, 64) * MiB
                    c.writer.add_memory(p.pid, d, "data", n)
                    p.memory[d] = p.memory.get(d, 0) + n
                elif p.memory.get(d):
                    n = rng.randrange(1, p.memory[d] // MiB + 1) * MiB
                    c.writer.add_memory(p.pid, d, "data", -n)
                    p.memory[d] -= n
            c.writer.watch(
                {
                    p.hostpid: {
                        d: (m + 300 * MiB, rng.randrange(0, 101)) for d, m in p.memory.items()
                    }
                    for p in c.procs.values()
                }
            )
            c.writer.kernel_launched(now)
            roll = rng.random()
            if roll < 0.05 and c.procs:
                pid = rng.choice(sorted(c.procs))
                c.writer.exit(pid)
                del c.procs[pid]
            elif roll < 0.07 and c.procs:
                pid = rng.choice(sorted(c.procs))
                c.killed.add(pid)  # SIGKILL: the slot stays until a later process notices
                del c.procs[pid]
            elif roll < 0.10:
                c.writer.compact(c.killed)
                c.killed.clear()

    def close(self) -> None:
        for c in self.containers:
            c.writer.close()


TruthKey = tuple[str, str, str]  # (pod_uid, container, device uuid)


class GroundTruth:
    """The exact integral of what the simulator wrote: per container and device, the sum of
    `total` (and of `sm_util`) over live slots, held from each write until the next."""

    def __init__(self) -> None:
        self.byte_ms: dict[TruthKey, int] = {}
        self.sm_ms: dict[TruthKey, int] = {}
        self.changes: dict[TruthKey, int] = {}
        self.abs_delta: dict[TruthKey, int] = {}  # sum of |change| of the memory sum
        self._last_ms: int | None = None
        self._values: dict[TruthKey, tuple[int, int]] = {}

    def observe(self, now_ms: int, containers: list[SimContainer]) -> None:
        """Call right after each step (and once when the files go away, with [])."""
        values: dict[TruthKey, tuple[int, int]] = {}
        for c in containers:
            for d, v in c.writer.live_totals().items():
                values[(c.pod_uid, c.name, c.writer.devices[d].uuid)] = v
        if self._last_ms is not None:
            dt = now_ms - self._last_ms
            for key, (mem, sm) in self._values.items():
                self.byte_ms[key] = self.byte_ms.get(key, 0) + mem * dt
                self.sm_ms[key] = self.sm_ms.get(key, 0) + sm * dt
        for key in values.keys() | self._values.keys():
            old = self._values.get(key, (0, 0))[0]
            new = values.get(key, (0, 0))[0]
            if old != new:
                self.changes[key] = self.changes.get(key, 0) + 1
                self.abs_delta[key] = self.abs_delta.get(key, 0) + abs(new - old)
        self._values = values
        self._last_ms = now_ms


def run(
    root: Path,
    containers: int,
    layout: str,
    duration: float,
    interval: float,
    seed: int,
    faults: frozenset[str] = frozenset(),
) -> int:
    """`hami-usage simulate`: drive files until duration is up; returns the number of steps.
    `faults`: the real library's failure modes to inject (see `simulate_faults`)."""
    root.mkdir(parents=True, exist_ok=True)
    if faults:
        from .simulate_faults import FaultyNode

        sim: NodeSimulator = FaultyNode(root, containers, layout, faults=faults, seed=seed)
    else:
        sim = NodeSimulator(root, containers, layout, seed=seed)
    steps = 0
    deadline = time.monotonic() + duration
    try:
        while True:
            sim.step(time.time())
            steps += 1
            if time.monotonic() + interval > deadline:
                break
            time.sleep(interval)
    finally:
        sim.close()
    return steps
