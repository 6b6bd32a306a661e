"""The real HAMi-core writer's failure modes, injected into simulated cache files.

Read from HAMi-core's sources; each is what a deployed library does, not a hostile tenant:

* `killed-mid-update`: a process killed between its two seqlock increments leaves its slot's
  seqlock odd forever (its counters as they were); the slot stays until a later process
  compacts it away.
* `stale-pointer`: since the slot-pointer cache, compaction moves the last slot into a hole
  without fixing the moved process's cached pointer, so that process keeps writing its old
  index, at or beyond `proc_num` where no reader looks, while a frozen copy of it sits in the
  hole: two slots with one pid (fixed upstream later; deployed versions have it).
* `stale-util`: from early 2025 to mid 2026 the utilization watcher reset `monitorused` and
  `sm_util` of vanished processes only on device 0; devices 1-15 keep their last value.
* `real-semaphores`: the library initialises its semaphores with value 1 (`sem_init(&sem, 1,
  1)`); the plain simulator leaves 0.

Python API: `FaultyWriter` (a `CacheWriter` with the primitives), `FaultyNode` (a
`NodeSimulator` that injects the chosen faults as it steps), `parse_faults` for the flag.
`hami-usage simulate --faults killed-mid-update,stale-pointer,...` runs the latter.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Set
from pathlib import Path
from typing import Any

from .layout.declarations import MAX_DEVICES, MAX_PROCS, Layout
from .simulate import CacheWriter, MiB, NodeSimulator, SimDevice, billed

FAULTS = ("killed-mid-update", "stale-pointer", "stale-util", "real-semaphores")


def parse_faults(text: str) -> frozenset[str]:
    """`a,b,c` -> the set; ValueError naming an unknown one."""
    names = frozenset(n.strip() for n in text.split(",") if n.strip())
    unknown = sorted(names - set(FAULTS))
    if unknown or not names:
        raise ValueError(
            f"unknown fault {', '.join(unknown) or repr(text)}; known: {', '.join(FAULTS)}"
        )
    return names


class FaultyWriter(CacheWriter):
    """A CacheWriter that can fail the way HAMi-core's library does."""

    def __init__(
        self,
        path: Path,
        layout: Layout,
        devices: list[SimDevice],
        *,
        faults: Iterable[str] = (),
        **kw: Any,
    ) -> None:
        self.faults = frozenset(faults)
        self.real_semaphores = "real-semaphores" in self.faults
        self.pointer: dict[int, int] = {}  # pid -> the slot index its stale pointer writes
        super().__init__(path, layout, devices, **kw)

    def _initialise(self, priority: int, register_devices: bool) -> None:
        if self.real_semaphores:
            self.region.sem.value = 1
            if hasattr(self.region, "sem_postinit"):
                self.region.sem_postinit.value = 1
        super()._initialise(priority, register_devices)

    def _slot(self, pid: int) -> Any:
        k = self.pointer.get(pid)
        return self.region.procs[k] if k is not None else super()._slot(pid)

    # --- killed between the two seqlock increments ---------------------------------------

    def kill_mid_update(self, pid: int, device: int, kind: str, nbytes: int) -> None:
        """The first increment and the update happen; the process dies before the second."""
        slot = self._slot(pid)
        used = slot.used[device]
        mask = (1 << 64) - 1
        if self.layout.slot_seqlock is not None:
            slot.seqlock += 1  # odd, and nobody will make it even again
        name = f"{kind}_size"
        setattr(used, name, (getattr(used, name) + nbytes) & mask)
        used.total = (used.total + nbytes) & mask

    # --- compaction that leaves a moved process's pointer stale ---------------------------

    def compact_stale(self, dead_pids: Set[int] = frozenset()) -> list[int]:
        """Compaction as the library with the slot-pointer cache does it: the last slot is
        copied into each hole, but the moved process keeps writing its old index. Returns the
        pids left writing at or beyond proc_num. A dead process's stale pointer dies with it:
        what it left past proc_num is nobody's once its copy below is compacted away."""
        for pid in dead_pids:
            self.pointer.pop(pid, None)
        moved: list[int] = []
        k = 0
        while k < self.proc_num:
            pid = self.region.procs[k].pid
            if pid == 0 or pid in dead_pids:
                last = self.proc_num - 1
                mover = self.region.procs[last].pid
                # Copies procs[last] into k and drops proc_num, leaving procs[last] as it was:
                # the moved process's stale pointer keeps writing it.
                self._remove(k, clear=False)
                if last != k and mover != 0 and mover not in dead_pids:
                    # A process stranded before keeps its cached pointer: what moved now is
                    # its frozen copy, not where it writes.
                    self.pointer.setdefault(mover, last)
                    moved.append(mover)
            else:
                k += 1
        return moved

    def compact(self, dead_pids: Set[int] = frozenset(), *, clear: bool | None = None) -> None:
        if "stale-pointer" in self.faults:
            self.compact_stale(dead_pids)
        else:
            super().compact(dead_pids, clear=clear)

    def exit(self, pid: int) -> None:
        if pid in self.pointer:
            slot = self.region.procs[self.pointer.pop(pid)]
            if slot.pid == pid:  # not since given to a new process (see add_process)
                slot.pid = 0
                slot.status = 0
            return
        super().exit(pid)

    def add_process(self, pid: int, hostpid: int = 0) -> int:
        """As the library: a new process takes slot proc_num even when a stale pointer still
        writes there; both then count in that one slot (not separable from the file)."""
        return super().add_process(pid, hostpid)

    def live_totals(self) -> dict[int, tuple[int, int]]:
        """What the writers meant: a process with a stale pointer counts its memory from where
        it writes, not from its frozen copy below proc_num; its SM use from that copy, where
        the watcher (which matches slots below proc_num by host pid) keeps writing it."""
        out: dict[int, tuple[int, int]] = {}
        has_util = self.layout.device_util is not None
        below = [self.region.procs[k] for k in range(min(max(self.proc_num, 0), MAX_PROCS))]
        copies = {slot.pid: slot for slot in below}
        seen: set[int] = set()
        for slot in [self.region.procs[k] for k in self.pointer.values()] + below:
            if slot.pid == 0 or slot.status == 0 or slot.pid in seen:
                continue
            seen.add(slot.pid)
            watched = copies.get(slot.pid, slot)
            for d in range(len(self.devices)):
                util = watched.device_util[d].sm_util if has_util else 0
                if billed(slot, d, util):
                    mem, sm = out.get(d, (0, 0))
                    out[d] = (mem + slot.used[d].total, sm + util)
        return out

    # --- the watcher that forgets devices >= 1 --------------------------------------------

    def _devices_reset(self, hostpid: int, samples: dict[int, dict[int, tuple[int, int]]]) -> int:
        """The 2025-2026 bug: a process NVML no longer lists (vanished) has only device 0
        reset; its other devices keep their last monitorused/sm_util."""
        if "stale-util" in self.faults and hostpid not in samples:
            return 1
        return MAX_DEVICES


class FaultyNode(NodeSimulator):
    """A NodeSimulator whose containers' libraries have the chosen faults: its compactions,
    watcher cycles and file creation are the faulty library's, and now and then a process is
    killed between its seqlock increments."""

    def __init__(
        self,
        root: Path,
        containers: int,
        layout: str,
        *,
        faults: Iterable[str],
        seed: int = 1,
        **kw: Any,
    ) -> None:
        self.faults = frozenset(faults)
        super().__init__(root, containers, layout, seed=seed, **kw)
        self.fault_rng = random.Random(seed + 1)
        for c in self.containers:  # the same files, made again by the faulty library
            w = c.writer
            w.close()
            w.path.unlink()
            c.writer = FaultyWriter(w.path, w.layout, w.devices, faults=self.faults)

    def step(self, now: float) -> None:
        super().step(now)
        if "killed-mid-update" not in self.faults:
            return
        for c in self.containers:
            if c.procs and self.fault_rng.random() < 0.02:
                pid = self.fault_rng.choice(sorted(c.procs))
                assert isinstance(c.writer, FaultyWriter)
                c.writer.kill_mid_update(pid, 0, "data", self.fault_rng.randrange(1, 64) * MiB)
                c.killed.add(pid)  # its slot stays until a later process compacts
                del c.procs[pid]


__all__ = ["FAULTS", "FaultyNode", "FaultyWriter", "parse_faults"]
