"""A lab for real container lifecycles: cache files written through the simulator's writer
(HAMi-core's protocol), a `Scanner` on an injected clock (one scan per second), and the exact
integral of what the files say is billable, per window.

Billable at second s, per (pod UID, container, device UUID): the sum of `used.total` over the
live slots of an initialised file whose process is really alive (a SIGKILLed process leaves a
live-looking slot: the lab remembers it as dead), on devices the file's table lists, held from
that second to the next. While a file is unusable (garbage) its last values hold for at most
`max_gap` after the last good scan, the documented unobserved lapse.
"""

from __future__ import annotations

import ctypes as C
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from collector.aggregate.records import BillingRecord
from collector.aggregate.windows import WindowSettings
from collector.events import Event
from collector.layout.declarations import MAGIC, V12, Layout
from collector.node.diff import Presence
from collector.node.hostpids import HostPidMemory
from collector.node.scan import Scanner
from collector.simulate import CacheWriter, GiB, MiB, SimDevice

# The review's settings: window 60 s, lateness 10 s, max_gap 90 s, heartbeat 30 s.
SETTINGS = WindowSettings(window_ms=60_000, lateness_ms=10_000, max_gap_ms=90_000)
SETTINGS_FLAGS = ["--window", "60", "--lateness", "10", "--max-gap", "90"]
HEARTBEAT_S = 30
T0_MS = 1_772_445_600_000  # 2026-03-02T10:00:00Z, a window edge
SECOND_NS = 1_000_000_000

TruthKey = tuple[str, str, str, int]  # (pod uid, container, device uuid, window start ms)
ProcKey = tuple[int, int]


def gpu(i: int) -> str:
    return f"GPU-{i:08d}-1111-4000-8000-000000000000"


class FakeClock:
    """The collector's two clocks: monotonic advances with the lab; the wall clock can step."""

    def __init__(self, wall0_ms: int) -> None:
        self.mono = 10 * SECOND_NS
        self.offset_ns = wall0_ms * 1_000_000 - self.mono

    def wall_ns(self) -> int:
        return self.mono + self.offset_ns

    def mono_ns(self) -> int:
        return self.mono

    def step_wall(self, seconds: float) -> None:
        self.offset_ns += int(seconds * SECOND_NS)


@dataclass
class Ctr:
    pod: str
    name: str
    folder: Path
    layout: Layout
    devices: list[SimDevice]
    writer: CacheWriter | None = None
    path: Path | None = None
    dead: set[ProcKey] = field(default_factory=set)  # SIGKILLed: slot live, process gone
    garbage: bool = False  # the file is unusable this second (scribbled version)
    real_count: int | None = None  # proc_num is garbled this second: the real count
    last_values: dict[str, int] = field(default_factory=dict)
    last_good: int = 0
    # A compaction stopped between two of its steps (the writer preempted), and what the
    # processes used when it began: it moves slots, not usage, so that is what they use until
    # it is done, whatever the slots read in between.
    compacting: Iterator[str] | None = None
    before_compaction: dict[str, int] | None = None

    @property
    def w(self) -> CacheWriter:
        assert self.writer is not None
        return self.writer

    def live(self) -> list[ProcKey]:
        """The processes really running: live slots, less the SIGKILLed."""
        w = self.writer
        if w is None or w.region.initialized_flag != MAGIC:
            return []
        n = w.region.proc_num if self.real_count is None else self.real_count
        slots = [w.region.procs[k] for k in range(n)]
        keys = [(s.pid, s.hostpid) for s in slots if s.pid != 0 and s.status != 0]
        return [k for k in keys if k not in self.dead]

    def running(self) -> bool:
        return bool(self.live())

    def limits(self) -> dict[str, int]:
        """device uuid -> memory limit, for the devices the file's table lists."""
        w = self.writer
        if w is None or w.region.initialized_flag != MAGIC:
            return {}
        r = w.region
        return {r.uuids[d].value.decode(): r.limit[d] for d in range(r.device_num)}

    def billable(self) -> dict[str, int]:
        """device uuid -> bytes the file bills now."""
        if self.before_compaction is not None:
            return dict(self.before_compaction)
        w = self.writer
        if w is None or w.region.initialized_flag != MAGIC:
            return {}
        r = w.region
        ndev = r.device_num
        n = r.proc_num if self.real_count is None else self.real_count
        out: dict[str, int] = {}
        for k in range(n):
            slot = r.procs[k]
            if slot.pid == 0 or slot.status == 0 or (slot.pid, slot.hostpid) in self.dead:
                continue
            for d in range(ndev):
                uuid = r.uuids[d].value.decode()
                out[uuid] = out.get(uuid, 0) + slot.used[d].total
        return out


class Lab:
    """One node: containers, an optional fake host /proc, a scanner, the truth."""

    def __init__(
        self,
        tmp: Path,
        name: str,
        *,
        host_proc: bool = False,
        presence: Presence = "folder",
        reuse: bool = True,
    ) -> None:
        self.name = name
        self.reuse = reuse
        self.presence: Presence = presence
        self.root = tmp / name / "containers"
        self.root.mkdir(parents=True)
        self.proc = tmp / name / "proc" if host_proc else None
        if self.proc is not None:
            self.proc.mkdir()
        self.log = tmp / name / "log"  # the collector's own folder (its host-pid judgements)
        self.log.mkdir()
        self.clock = FakeClock(T0_MS)
        self.inc = 1000
        self.scanner = self._scanner()
        self.ctrs: dict[str, Ctr] = {}
        self.truth: dict[TruthKey, int] = {}  # byte-milliseconds
        self.limit_truth: dict[TruthKey, int] = {}  # limit byte-milliseconds while present
        self.events: list[Event] = []
        self.s = 0

    def _scanner(self, after_ms: int | None = None) -> Scanner:
        return Scanner(
            self.root,
            heartbeat_s=HEARTBEAT_S,
            inc=self.inc,
            clock=self.clock,
            host_proc=None if self.proc is None else str(self.proc),
            host_pids=None if self.proc is None else HostPidMemory(self.log),
            after_ms=after_ms,
            presence_policy=self.presence,
            reuse=self.reuse,
        )

    # --- what containers do ----------------------------------------------------------------

    def container(
        self, name: str, devices: int = 2, *, layout: Layout = V12, register: bool = True
    ) -> Ctr:
        pod = f"{len(self.ctrs):08d}-0000-4000-8000-000000000000"
        folder = self.root / f"{pod}_{name}"
        folder.mkdir()
        devs = [SimDevice(gpu(d), (4 + d) * GiB, 50) for d in range(devices)]
        c = Ctr(pod, name, folder, layout, devs)
        self.ctrs[name] = c
        self.init_file(c, register=register)
        return c

    def init_file(self, c: Ctr, *, register: bool = True) -> None:
        """The first CUDA call of a container run: open (create), initialise if needed."""
        c.path = c.folder / "0.cache"
        c.writer = CacheWriter(c.path, c.layout, c.devices, register_devices=register)

    def spawn(self, c: Ctr, pid: int, hostpid: int) -> None:
        if self.proc is not None:
            (self.proc / str(hostpid)).mkdir()
        c.w.add_process(pid, hostpid)

    def kill(self, c: Ctr, pid: int) -> None:
        """SIGKILL: the slot stays live-looking; the host pid goes."""
        slot = c.w.region.procs[c.w.slot_of(pid)]
        c.dead.add((slot.pid, slot.hostpid))
        if self.proc is not None:
            (self.proc / str(slot.hostpid)).rmdir()

    def set_data(self, c: Ctr, pid: int, device: int, nbytes: int) -> None:
        slot = c.w.region.procs[c.w.slot_of(pid)]
        c.w.add_memory(pid, device, "data", nbytes - slot.used[device].data_size)

    def compact_until(self, c: Ctr, step: str) -> None:
        """A later process starts a compaction and is preempted right after `step` (one of
        `CacheWriter._removal`'s) of the first hole it fills."""
        c.before_compaction = c.billable()
        c.compacting = c.w.compaction()
        if step not in c.compacting:  # (runs the steps up to and including it)
            raise ValueError(f"no step {step!r}")

    def finish_compaction(self, c: Ctr) -> None:
        assert c.compacting is not None
        for _ in c.compacting:
            pass
        c.compacting = c.before_compaction = None

    def stop_run(self, c: Ctr) -> None:
        """The container's processes are gone with it (its writer unmaps)."""
        if c.writer is not None:
            c.writer.close()
            c.writer = None
        c.dead.clear()

    def remove(self, c: Ctr) -> None:
        self.stop_run(c)
        shutil.rmtree(c.folder)
        del self.ctrs[c.name]

    def restart_collector(self) -> None:
        """A new incarnation, which finds the last event time in its local log."""
        self.inc += 1
        self.scanner = self._scanner(self.events[-1].ts)

    # --- time ------------------------------------------------------------------------------

    def run(self, seconds: int, script: Callable[[Lab, int], None]) -> None:
        for s in range(seconds):
            self.s = s
            script(self, s)
            self.observe(s)
            self.events += self.scanner.scan()
            self.clock.mono += SECOND_NS
        self.s = seconds
        for c in list(self.ctrs.values()):
            self.remove(c)
        self.events += self.scanner.scan()  # every container gone: every key ends here

    def observe(self, s: int) -> None:
        window = T0_MS + s * 1000
        window -= (window - T0_MS) % SETTINGS.window_ms
        gap_s = SETTINGS.max_gap_ms // 1000
        for c in self.ctrs.values():
            if c.garbage:
                values = c.last_values if s < c.last_good + gap_s else {}
            else:
                values = c.last_values = c.billable()
                c.last_good = s
            for uuid, nbytes in values.items():
                key = (c.pod, c.name, uuid, window)
                self.truth[key] = self.truth.get(key, 0) + nbytes * 1000
            if self.presence == "folder" or c.running():
                for uuid, limit in c.limits().items():
                    key = (c.pod, c.name, uuid, window)
                    self.limit_truth[key] = self.limit_truth.get(key, 0) + limit * 1000


def billed(
    records: list[BillingRecord], node: str, field: str = "memory_byte_seconds"
) -> dict[TruthKey, int]:
    out: dict[TruthKey, int] = {}
    for r in records:
        if r.node != node or not r.pod_uid:
            continue
        key = (r.pod_uid, r.container, r.device_uuid, r.window_start_ms)
        out[key] = out.get(key, 0) + round(getattr(r, field) * 1000)
    return {k: v for k, v in out.items() if v}


def nonzero(truth: dict[TruthKey, int]) -> dict[TruthKey, int]:
    return {k: v for k, v in truth.items() if v}


def wave(s: int, p: int) -> int:
    """data bytes of process p at second s: a different value every second."""
    return ((s * 13 + p * 7) % 64 + 1) * MiB


# --- what happens to a file between two runs of its container -----------------------------


def zero_in_place(c: Ctr) -> None:
    """The restarted container's set-up zeroes the file (same inode, same size)."""
    w = c.w
    C.memset(C.addressof(w.region), 0, w.layout.region_size)


def truncate(c: Ctr) -> None:
    assert c.path is not None
    os.truncate(c.path, 0)
