"""discover -> snapshot -> diff -> events, on real cache files written by the simulator.

Each test drives files with `CacheWriter` (HAMi-core's protocol) and asserts the exact event
sequence a `Scanner` with a fixed incarnation and explicit sample times produces.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from collector.events import (
    SCHEMA_VERSION,
    ContainerAppeared,
    ContainerGone,
    DeviceLimit,
    Event,
    Heartbeat,
    LayoutAnomaly,
    LimitsChanged,
    ProcessExited,
    ProcessStarted,
    UsageRow,
    UsageSample,
    encode,
)
from collector.layout.declarations import (
    LAYOUTS,
    MAGIC,
    MAX_PROCS,
    V0A,
    V11,
    V11_INTERIM,
    V12,
    Layout,
)
from collector.layout.reader import read_snapshot
from collector.node.scan import HEARTBEAT_PART, HEARTBEAT_PART_BYTES, Scanner
from collector.simulate import CacheWriter, GiB, MiB, SimDevice, new_cache_file

INC = 77
T0 = 1_700_000_000_000
POD = "6f1c2a3b-4d5e-4f60-8a7b-9c0d1e2f3a4b"
GPU0 = "GPU-11111111-2222-4333-8444-555555555555"
GPU1 = "GPU-66666666-7777-4888-9999-aaaaaaaaaaaa"
DEVICES = [SimDevice(GPU0, 4 * GiB, 50), SimDevice(GPU1, 8 * GiB, 100)]
LIMITS = [DeviceLimit(0, GPU0, 4 * GiB, 50), DeviceLimit(1, GPU1, 8 * GiB, 100)]
SEQLOCK_LAYOUTS = [name for name, lay in LAYOUTS.items() if lay.slot_seqlock is not None]
COMPACTING_LAYOUTS = [name for name, lay in LAYOUTS.items() if lay.slot_seqlock is None]
MISLABELLED = "says 1.1 but has the v1.1-interim layout (HAMi v2.8.1)"

Body = tuple[str, dict[str, Any]]
_BASE = ("v", "inc", "seq", "ts")


def body(e: Any) -> Body:
    """An event without its envelope (v, inc, seq, ts), which Harness checks separately."""
    return type(e).__name__, {f: getattr(e, f) for f in e.__struct_fields__ if f not in _BASE}


def ev(cls: type[Any], **fields: Any) -> Body:
    return body(cls(v=0, inc=0, seq=0, ts=0, **fields))


def row(
    pid: int,
    hostpid: int,
    device: int,
    *,
    data: int = 0,
    context: int = 0,
    module: int = 0,
    monitor: int = 0,
    sm: int = 0,
) -> UsageRow:
    return UsageRow(
        pid, hostpid, device, context + module + data, context, module, data, monitor, sm
    )


class Harness:
    """A Scanner with a fixed inc whose every event is checked for its envelope."""

    def __init__(
        self, root: Path, *, host_proc: Path | None = None, heartbeat_s: float = 3600
    ) -> None:
        self.scanner = Scanner(
            root,
            heartbeat_s=heartbeat_s,
            host_proc=None if host_proc is None else str(host_proc),
            inc=INC,
        )
        self.now = T0
        self.events: list[Event] = []

    def scan_all(self, step_ms: int = 1000) -> list[Event]:
        self.now += step_ms
        events = self.scanner.scan(now_ms=self.now)
        for i, e in enumerate(events):
            assert e.v == SCHEMA_VERSION
            assert e.inc == INC
            assert e.seq == len(self.events) + i  # dense from 0 across scans
            assert e.ts == self.now
        self.events += events
        return events

    def scan(self, step_ms: int = 1000) -> list[Body]:
        """Bodies of the events of one scan, heartbeats left out."""
        return [body(e) for e in self.scan_all(step_ms) if not isinstance(e, Heartbeat)]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "containers"
    r.mkdir()
    return r


@pytest.fixture
def writers() -> Iterator[list[CacheWriter]]:
    opened: list[CacheWriter] = []
    yield opened
    for w in opened:
        w.close()


def make(
    writers: list[CacheWriter],
    root: Path,
    layout: Layout,
    container: str = "main",
    devices: list[SimDevice] = DEVICES,
    pod: str = POD,
) -> CacheWriter:
    w = new_cache_file(root, pod, container, layout, devices)
    writers.append(w)
    return w


def appeared(w: CacheWriter, cid: int = 0, container: str = "main", pod: str = POD) -> list[Body]:
    out = [
        ev(
            ContainerAppeared,
            cid=cid,
            pod_uid=pod,
            container=container,
            path=str(w.path),
            layout=w.layout.name,
            devices=LIMITS[: len(w.devices)],
        )
    ]
    if w.layout is V11_INTERIM:
        out.append(anomaly(w, "mislabelled_layout", MISLABELLED, cid=cid))
    return out


def anomaly(w: CacheWriter | Path, kind: str, detail: str, cid: int = 0, **kw: Any) -> Body:
    path = str(w.path if isinstance(w, CacheWriter) else w)
    return ev(LayoutAnomaly, cid=cid, path=path, anomaly=kind, detail=detail, **kw)


# --- containers -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_container_appears_with_its_devices_and_limits(
    root: Path, writers: list[CacheWriter], name: str
) -> None:
    w = make(writers, root, LAYOUTS[name], container="side_car")
    h = Harness(root)
    assert h.scan() == appeared(w, container="side_car")
    assert h.scan() == []


def test_heartbeat_only_on_the_first_scan_and_each_period(
    root: Path, writers: list[CacheWriter]
) -> None:
    make(writers, root, V12)
    h = Harness(root, heartbeat_s=10)
    kinds = [type(e).__name__ for e in h.scan_all(0)]
    assert kinds == ["ContainerAppeared", "Heartbeat"]
    assert not any(isinstance(e, Heartbeat) for e in h.scan_all(5000))
    assert not any(isinstance(e, Heartbeat) for e in h.scan_all(4999))
    (hb,) = h.scan_all(1)
    assert isinstance(hb, Heartbeat) and hb.interval_ms == 10_000
    assert (hb.part, hb.parts, hb.files) == (0, 1, 1)


def test_container_gone_when_file_or_directory_disappears(
    root: Path, writers: list[CacheWriter]
) -> None:
    a = make(writers, root, V12, container="a")
    b = make(writers, root, V0A, container="b")
    h = Harness(root)
    assert h.scan() == appeared(a, 0, "a") + appeared(b, 1, "b")
    a.path.unlink()
    assert h.scan() == [ev(ContainerGone, cid=0)]
    shutil.rmtree(b.path.parent)
    assert h.scan() == [ev(ContainerGone, cid=1)]
    assert h.scan() == []


def test_replaced_file_is_a_new_container(root: Path, writers: list[CacheWriter]) -> None:
    old = make(writers, root, V12)
    h = Harness(root)
    assert h.scan() == appeared(old)
    old.path.unlink()
    new = make(writers, root, V12)  # same directory, a new uuid name
    assert h.scan() == appeared(new, cid=1) + [ev(ContainerGone, cid=0)]


def test_vanishing_between_discovery_and_read(
    root: Path, writers: list[CacheWriter], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = make(writers, root, V12, container="seen")
    h = Harness(root)
    assert h.scan() == appeared(seen, container="seen")
    fresh = make(writers, root, V12, container="fresh")
    real = h.scanner.discovery.scan

    def discover_then_delete() -> Any:
        found = real()
        seen.path.unlink()
        fresh.path.unlink()
        return found

    monkeypatch.setattr(h.scanner.discovery, "scan", discover_then_delete)
    # The known one is gone (no spurious exits or limit changes); the new one never existed.
    assert h.scan() == [ev(ContainerGone, cid=0)]
    monkeypatch.undo()
    assert h.scan() == []


def test_open_error_is_an_unreadable_anomaly(
    root: Path, writers: list[CacheWriter], monkeypatch: pytest.MonkeyPatch
) -> None:
    w = make(writers, root, V12)

    h = Harness(root)

    def denied(f: Any) -> Any:
        raise PermissionError(13, "Permission denied", f.path)

    monkeypatch.setattr(h.scanner.discovery, "open", denied)
    assert h.scan() == [
        ev(
            ContainerAppeared,
            cid=0,
            pod_uid=POD,
            container="main",
            path=str(w.path),
            layout="",
            devices=[],
        ),
        anomaly(w, "unreadable", "open: Permission denied"),
    ]
    assert h.scan() == []


def two_running(writers: list[CacheWriter], root: Path) -> tuple[CacheWriter, CacheWriter]:
    """Containers "a" and "b", each with process 1 holding 1 GiB on device 0."""
    a, b = make(writers, root, V12, container="a"), make(writers, root, V12, container="b")
    for w in (a, b):
        w.add_process(1, 4001)
        w.add_memory(1, 0, "data", GiB)
    return a, b


@pytest.mark.parametrize("errno_", [errno.EMFILE, errno.EIO])
def test_a_failed_listing_of_the_root_ends_nothing(
    root: Path, writers: list[CacheWriter], monkeypatch: pytest.MonkeyPatch, errno_: int
) -> None:
    a, b = two_running(writers, root)
    h = Harness(root)
    h.scan()
    real = os.scandir

    def failing(path: Any) -> Any:
        if path == h.scanner.discovery._root_fd:
            raise OSError(errno_, os.strerror(errno_))
        return real(path)

    monkeypatch.setattr(os, "scandir", failing)
    # Unusable for this scan, like a file that cannot be opened: no ContainerGone, no exits.
    assert h.scan() == [
        ev(LayoutAnomaly, cid=-1, path=str(root), anomaly="skipped_path",
           detail=f"cannot list the root: {os.strerror(errno_)}"),
        anomaly(a, "unreadable", f"{a.path.parent}: not listed", cid=0),
        anomaly(b, "unreadable", f"{b.path.parent}: not listed", cid=1),
    ]  # fmt: skip
    monkeypatch.undo()
    a.add_memory(1, 0, "data", MiB)
    # The same containers (cids 0 and 1), announced again (the aggregator may have forgotten
    # them) and restated whole: nothing starts again.
    assert h.scan() == [
        *appeared(a, cid=0, container="a"),
        ev(UsageSample, cid=0, rows=[row(1, 4001, 0, data=GiB + MiB), row(1, 4001, 1)]),
        *appeared(b, cid=1, container="b"),
        ev(UsageSample, cid=1, rows=[row(1, 4001, 0, data=GiB), row(1, 4001, 1)]),
    ]
    assert h.scan() == []


def test_a_failed_listing_of_a_container_folder_ends_nothing(
    root: Path, writers: list[CacheWriter], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = two_running(writers, root)
    h = Harness(root)
    h.scan()
    discovery = h.scanner.discovery
    real = discovery._open_dir

    def failing(name: str) -> Any:
        if name == a.path.parent.name:
            raise OSError(errno.EIO, "Input/output error")
        return real(name)

    monkeypatch.setattr(discovery, "_open_dir", failing)
    os.utime(a.path.parent, ns=(T0 * 10**6, T0 * 10**6))  # listed again: its mtime moved
    b.exit(1)
    assert h.scan() == [
        ev(LayoutAnomaly, cid=-1, path=str(a.path.parent), anomaly="skipped_path",
           detail="cannot list: Input/output error"),
        ev(ProcessExited, cid=1, pid=1, hostpid=4001),
        anomaly(a, "unreadable", f"{a.path.parent}: not listed", cid=0),
    ]  # fmt: skip
    monkeypatch.undo()
    # Listable again, but the scan's listing budget is spent before it (as on a node where
    # other folders list slowly): its failed listing is kept, still unknown, not empty.
    limits = discovery.limits
    discovery.limits = dataclasses.replace(limits, budget_s=0.0)
    assert h.scan() == []
    assert discovery.stats.deferred >= 1
    discovery.limits = limits
    assert h.scan() == [
        *appeared(a, cid=0, container="a"),
        ev(UsageSample, cid=0, rows=[row(1, 4001, 0, data=GiB), row(1, 4001, 1)]),
    ]


def test_a_container_folder_that_cannot_be_stat_ed_ends_nothing(
    root: Path, writers: list[CacheWriter], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error other than ENOENT from the folder's stat (EIO, a remount) took it for gone:
    ContainerGone, then the same container again under a new cid."""
    a, b = two_running(writers, root)
    h = Harness(root)
    h.scan()
    discovery = h.scanner.discovery
    kept = [discovery._held[a.path.parent.name].fd]
    real = os.fstat

    def failing(fd: int) -> os.stat_result:
        if fd in kept:
            kept.clear()  # (once: the number is free for the next descriptor when it closes)
            raise OSError(errno.EIO, "Input/output error")
        return real(fd)

    monkeypatch.setattr(os, "fstat", failing)
    assert h.scan() == [
        ev(LayoutAnomaly, cid=-1, path=str(a.path.parent), anomaly="skipped_path",
           detail="cannot stat: Input/output error"),
        anomaly(a, "unreadable", f"{a.path.parent}: not listed", cid=0),
    ]  # fmt: skip
    monkeypatch.undo()
    assert h.scan() == [
        *appeared(a, cid=0, container="a"),
        ev(UsageSample, cid=0, rows=[row(1, 4001, 0, data=GiB), row(1, 4001, 1)]),
    ]
    assert h.scan() == []


def test_a_heartbeat_part_stays_under_a_kafka_request(
    root: Path, writers: list[CacheWriter]
) -> None:
    """A tenant can fill every slot of its file on 16 devices: its state is about 1 MB, and
    two of them in one part would be more than a Kafka request carries (1 MiB by default)."""
    sixteen = [SimDevice(f"GPU-{i:08x}-2222-4333-8444-5555", 80 * GiB, 100) for i in range(16)]
    big = [make(writers, root, V12, container=f"big{i}", devices=sixteen) for i in range(2)]
    small = [make(writers, root, V12, container=f"small{i}") for i in range(3)]
    for w in big:
        for k in range(MAX_PROCS):
            w.add_process(1_000_000 + k, 2_000_000 + k)
            for d in range(16):
                w.add_memory(1_000_000 + k, d, "data", 4 * GiB + k)  # 9 bytes each, and total
    for w in small:
        w.add_process(1, 4001)
        w.add_memory(1, 0, "data", GiB)
    h = Harness(root, heartbeat_s=5)
    hbs = [e for e in h.scan_all(0) if isinstance(e, Heartbeat)]
    assert [(hb.part, hb.parts, [c.container for c in hb.containers]) for hb in hbs] == [
        (0, 3, ["big0"]),
        (1, 3, ["big1"]),
        (2, 3, ["small0", "small1", "small2"]),
    ]
    sizes = [len(encode(hb)) for hb in hbs]
    assert sizes[0] < 1 << 20 and sizes[1] < 1 << 20 < sizes[0] + sizes[1]
    assert sizes[2] < HEARTBEAT_PART_BYTES
    assert [len(hb.containers[0].rows) for hb in hbs[:2]] == [MAX_PROCS * 16] * 2


# --- processes ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_process_started_and_exited(root: Path, writers: list[CacheWriter], name: str) -> None:
    w = make(writers, root, LAYOUTS[name])
    h = Harness(root)
    h.scan()
    w.add_process(10, 1010)
    w.add_memory(10, 0, "context", 300 * MiB)
    w.add_memory(10, 0, "data", GiB)
    assert h.scan() == [
        ev(ProcessStarted, cid=0, pid=10, hostpid=1010),
        ev(
            UsageSample,
            cid=0,
            rows=[row(10, 1010, 0, context=300 * MiB, data=GiB), row(10, 1010, 1)],
        ),
    ]
    w.add_process(20, 1020)
    w.add_memory(20, 1, "module", 5 * MiB)
    assert h.scan() == [
        ev(ProcessStarted, cid=0, pid=20, hostpid=1020),
        ev(UsageSample, cid=0, rows=[row(20, 1020, 0), row(20, 1020, 1, module=5 * MiB)]),
    ]
    # pid 10 leaves: an exit marker (seqlock layouts) or compaction that moves pid 20 into
    # slot 0 (older layouts). Either way exactly one exit, and pid 20 is untouched.
    w.exit(10)
    assert w.slot_of(20) == (1 if w.layout.slot_seqlock is not None else 0)
    assert h.scan() == [ev(ProcessExited, cid=0, pid=10, hostpid=1010)]
    assert h.scan() == []


@pytest.mark.parametrize("name", SEQLOCK_LAYOUTS)
def test_exit_marker_stops_reporting_although_counters_stay(
    root: Path, writers: list[CacheWriter], name: str
) -> None:
    w = make(writers, root, LAYOUTS[name])
    h = Harness(root)
    h.scan()
    w.add_process(10, 1010)
    w.add_memory(10, 0, "data", GiB)
    h.scan()
    w.exit(10)
    (slot,) = read_snapshot(w.path).procs
    assert (slot.pid, slot.status, slot.devices[0].total) == (0, 0, GiB)  # counters stay
    assert h.scan() == [ev(ProcessExited, cid=0, pid=10, hostpid=1010)]
    assert h.scan() == []
    (hb,) = [e for e in h.scan_all(3600_000) if isinstance(e, Heartbeat)]
    assert hb.containers[0].rows == []


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_compaction_moving_a_live_process_is_not_an_exit(
    root: Path, writers: list[CacheWriter], name: str
) -> None:
    w = make(writers, root, LAYOUTS[name])
    for pid in (1, 2, 3):
        w.add_process(pid, 500 + pid)
        w.add_memory(pid, 0, "data", pid * GiB)
    h = Harness(root)
    h.scan()
    w.exit(1)
    assert h.scan() == [ev(ProcessExited, cid=0, pid=1, hostpid=501)]
    w.compact()  # removes the exit marker, if any: pid 3 moves into slot 0
    assert w.slot_of(3) == 0 and w.proc_num == 2
    assert h.scan() == []
    # Moved and then changed: a sample for the same key, nothing else.
    w.add_memory(3, 0, "data", MiB)
    assert h.scan() == [ev(UsageSample, cid=0, rows=[row(3, 503, 0, data=3 * GiB + MiB)])]


def test_same_pid_with_another_hostpid_is_another_process(
    root: Path, writers: list[CacheWriter]
) -> None:
    # The key is (pid, hostpid): a host pid filled in later is a new process.
    w = make(writers, root, V12, devices=DEVICES[:1])
    w.add_process(10, 0)
    h = Harness(root)
    assert h.scan()[1:] == [
        ev(ProcessStarted, cid=0, pid=10, hostpid=0),
        ev(UsageSample, cid=0, rows=[row(10, 0, 0)]),
    ]
    w.set_hostpid(10, 4242)
    assert h.scan() == [
        ev(ProcessExited, cid=0, pid=10, hostpid=0),
        ev(ProcessStarted, cid=0, pid=10, hostpid=4242),
        ev(UsageSample, cid=0, rows=[row(10, 4242, 0)]),
    ]


@pytest.fixture
def host_proc(tmp_path: Path) -> Path:
    p = tmp_path / "proc"
    p.mkdir()
    (p / "self").mkdir()  # non-numeric entries like a real /proc
    return p


def stale(w: CacheWriter, pid: int, hostpid: int) -> Body:
    detail = f"pid {pid} (host pid {hostpid}) has a slot but no process"
    return anomaly(w, "stale_process", detail, value=hostpid)


@pytest.mark.parametrize("name", ["v1.2", "v0b"])
def test_sigkilled_slot_is_a_stale_process_once_and_an_exit(
    root: Path, writers: list[CacheWriter], host_proc: Path, name: str
) -> None:
    w = make(writers, root, LAYOUTS[name], devices=DEVICES[:1])
    for pid in (1, 2):
        (host_proc / str(500 + pid)).mkdir()
        w.add_process(pid, 500 + pid)
        w.add_memory(pid, 0, "data", GiB)
    h = Harness(root, host_proc=host_proc)
    assert h.scan()[1:] == [
        ev(ProcessStarted, cid=0, pid=1, hostpid=501),
        ev(ProcessStarted, cid=0, pid=2, hostpid=502),
        ev(UsageSample, cid=0, rows=[row(1, 501, 0, data=GiB), row(2, 502, 0, data=GiB)]),
    ]
    (host_proc / "501").rmdir()  # SIGKILL: the slot stays, the host process is gone
    assert h.scan() == [stale(w, 1, 501), ev(ProcessExited, cid=0, pid=1, hostpid=501)]
    assert h.scan() == []  # reported once while it persists
    (hb,) = [e for e in h.scan_all(3600_000) if isinstance(e, Heartbeat)]
    assert hb.containers[0].rows == [row(2, 502, 0, data=GiB)]
    w.compact({1})  # a later process cleans up: pid 2 moves to slot 0, no events
    assert h.scan() == []
    # Two at once are two anomalies (each its own host pid).
    for pid in (3, 4):
        w.add_process(pid, 500 + pid)
    assert h.scan() == [stale(w, 3, 503), stale(w, 4, 504)]
    (host_proc / "503").mkdir()  # (a pid namespace lookup raced; it is alive after all)
    assert h.scan() == [ev(ProcessStarted, cid=0, pid=3, hostpid=503)] + [
        ev(UsageSample, cid=0, rows=[row(3, 503, 0)])
    ]
    (host_proc / "503").rmdir()
    assert h.scan() == [stale(w, 3, 503), ev(ProcessExited, cid=0, pid=3, hostpid=503)]


def test_a_slot_found_dead_stays_dead_from_the_second_scan_on(
    root: Path, writers: list[CacheWriter], host_proc: Path
) -> None:
    """A slot first seen with its host pid gone (a collector restarted, or a container
    restarted under a new cid, after the SIGKILL) was never judged dead: once the host gave
    that pid to an unrelated process, its last counters were billed as a live process."""
    w = make(writers, root, V12, devices=DEVICES[:1])
    w.add_process(1, 501)
    w.add_memory(1, 0, "data", GiB)  # SIGKILLed: its host pid 501 is gone
    h = Harness(root, host_proc=host_proc)
    assert h.scan()[1:] == [stale(w, 1, 501)]
    assert h.scan() == []  # gone at a second scan, counters as they were: dead
    (host_proc / "501").mkdir()  # the host reuses the pid for an unrelated process
    assert h.scan() == []
    w.add_memory(1, 0, "data", MiB)  # only the slot's own process writes its counters
    assert h.scan() == [
        ev(ProcessStarted, cid=0, pid=1, hostpid=501),
        ev(UsageSample, cid=0, rows=[row(1, 501, 0, data=GiB + MiB)]),
    ]


def test_a_dead_slot_the_snapshot_hides_for_a_scan_stays_dead(
    root: Path, writers: list[CacheWriter], host_proc: Path
) -> None:
    """Dead slots were remembered from the current snapshot only: hidden for one scan (here
    past a lowered count, as compaction's first store leaves it), a dead slot came back
    undecided, and live once the host reused its pid."""
    w = make(writers, root, V12, devices=DEVICES[:1])
    for pid in (1, 2):
        (host_proc / str(500 + pid)).mkdir()
        w.add_process(pid, 500 + pid)
        w.add_memory(pid, 0, "data", pid * GiB)
    h = Harness(root, host_proc=host_proc)
    h.scan()
    (host_proc / "502").rmdir()  # SIGKILL
    assert h.scan() == [stale(w, 2, 502), ev(ProcessExited, cid=0, pid=2, hostpid=502)]
    w.region.proc_num = 1  # slot 1 past the count for a scan
    assert h.scan() == []
    w.region.proc_num = 2
    (host_proc / "502").mkdir()  # the host reuses the pid
    assert h.scan() == [stale(w, 2, 502)]  # (it shows again: reported again, and not billed)
    assert h.scan() == []


@pytest.mark.parametrize("layout", [V12, V11], ids=["v1.2", "v1.1"])
def test_a_dead_slot_stays_dead_when_the_device_table_fills_in(
    root: Path, host_proc: Path, layout: Layout
) -> None:
    """The reader gives a slot a row for each device the table lists: when a later process's
    first NVML call registered the devices, the dead slot's rows gained zero rows, which
    counted as its counters moving, and it was started and billed again (2 GiB) for good."""
    d = root / f"{POD}_main"
    d.mkdir()
    w = CacheWriter(d / "late.cache", layout, DEVICES, register_devices=False)
    try:
        for pid in (1, 2):
            (host_proc / str(500 + pid)).mkdir()
        w.add_process(1, 501)
        w.add_memory(1, 0, "data", 2 * GiB)
        w.add_process(2, 502)
        h = Harness(root, host_proc=host_proc)
        h.scan()
        (host_proc / "501").rmdir()  # SIGKILL: the slot stays
        assert [b[0] for b in h.scan()] == ["LayoutAnomaly", "ProcessExited"]
        w.register_devices()
        later = [b[0] for _ in range(3) for b in h.scan()]
        assert later == ["LimitsChanged", "UsageSample"]  # 2's rows, restated with the table
        st = h.scanner._files[next(iter(h.scanner._files))]
        assert sorted(st.procs) == [(2, 502)]
        assert sorted(st.rows) == [(2, 502, 0), (2, 502, 1)]
    finally:
        w.close()


def test_a_live_slot_under_a_stale_host_pid_the_snapshot_hides_for_a_scan_stays_live(
    root: Path, writers: list[CacheWriter], host_proc: Path
) -> None:
    """A slot whose host pid is not there but whose counters moved is a live process (HAMi-core
    has not written its host pid yet). It was vouched for from the current snapshot only:
    torn for one scan, it came back judged dead, an exit, and was billed again only once its
    counters moved again."""
    w = make(writers, root, V12, devices=DEVICES[:1])
    (host_proc / "501").mkdir()
    for pid in (1, 2):  # pid 2's host pid 502 is not (yet) in /proc
        w.add_process(pid, 500 + pid)
        w.add_memory(pid, 0, "data", pid * GiB)
    h = Harness(root, host_proc=host_proc)
    h.scan()
    w.add_memory(2, 0, "data", MiB)  # its counters move: a live process
    assert h.scan() == [
        ev(ProcessStarted, cid=0, pid=2, hostpid=502),
        ev(UsageSample, cid=0, rows=[row(2, 502, 0, data=2 * GiB + MiB)]),
    ]
    w.region.procs[1].seqlock += 1  # torn for a scan: left out
    assert [b[1]["anomaly"] for b in h.scan()] == ["torn_read"]
    w.region.procs[1].seqlock += 1  # read again: every row restated, no exit, no start
    restated = [row(1, 501, 0, data=GiB), row(2, 502, 0, data=2 * GiB + MiB)]
    assert h.scan() == [ev(UsageSample, cid=0, rows=restated)]
    assert h.scan() == []


def test_one_read_of_a_slot_half_moved_by_compaction_does_not_revive_a_dead_one(
    root: Path, writers: list[CacheWriter], host_proc: Path
) -> None:
    """v1.1 has no slot seqlock: a read while compaction copies a dead slot into a hole shows
    its pid with the hole's counters. That looked like its counters moving (a live process
    under a stale host pid), and the dead slot was billed as live from then on."""
    w = make(writers, root, LAYOUTS["v1.1"], devices=DEVICES[:1])
    for pid in (1, 2, 3):
        (host_proc / str(500 + pid)).mkdir()
        w.add_process(pid, 500 + pid)
        w.add_memory(pid, 0, "data", pid * 512 * MiB)
    h = Harness(root, host_proc=host_proc)
    h.scan()
    (host_proc / "501").rmdir()  # both SIGKILLed
    (host_proc / "503").rmdir()
    assert h.scan() == [
        stale(w, 1, 501), stale(w, 3, 503),
        ev(ProcessExited, cid=0, pid=1, hostpid=501), ev(ProcessExited, cid=0, pid=3, hostpid=503),
    ]  # fmt: skip
    steps = w.compaction({1})  # pid 2 removes pid 1: the last slot (pid 3) moves into slot 0
    assert [next(steps), next(steps)] == ["count", "identity"]
    assert h.scan() == []  # pid 3 in slot 0, with pid 1's counters
    for _ in steps:
        pass
    assert h.scan() == []
    assert h.scan() == []


def test_without_host_proc_a_killed_slot_stays_live(
    root: Path, writers: list[CacheWriter], host_proc: Path
) -> None:
    w = make(writers, root, V12, devices=DEVICES[:1])
    w.add_process(1, 501)
    h = Harness(root)
    assert h.scan()[1:] == [
        ev(ProcessStarted, cid=0, pid=1, hostpid=501),
        ev(UsageSample, cid=0, rows=[row(1, 501, 0)]),
    ]
    assert h.scan() == []


# --- usage and limits -----------------------------------------------------------------------


def test_usage_samples_only_on_change_with_absolute_values(
    root: Path, writers: list[CacheWriter]
) -> None:
    w = make(writers, root, V12)
    w.add_process(1, 501)
    w.add_process(2, 502)
    h = Harness(root)
    h.scan()
    assert h.scan() == []
    w.add_memory(1, 0, "data", 2 * GiB)
    assert h.scan() == [ev(UsageSample, cid=0, rows=[row(1, 501, 0, data=2 * GiB)])]
    w.add_memory(1, 0, "data", GiB)  # the row says 3 GiB, not +1 GiB
    assert h.scan() == [ev(UsageSample, cid=0, rows=[row(1, 501, 0, data=3 * GiB)])]
    w.add_memory(1, 0, "data", -3 * GiB)
    assert h.scan() == [ev(UsageSample, cid=0, rows=[row(1, 501, 0)])]
    # The utilization watcher: NVML memory and SM % of each process, matched by host pid.
    w.watch({502: {1: (700 * MiB, 35)}})
    assert h.scan() == [ev(UsageSample, cid=0, rows=[row(2, 502, 1, monitor=700 * MiB, sm=35)])]
    w.watch({502: {1: (700 * MiB, 35)}})
    assert h.scan() == []
    w.kernel_launched(1234)  # header changes alone are no sample
    assert h.scan() == []


def test_device_dropping_out_of_a_slot_is_stated_as_zero(
    root: Path, writers: list[CacheWriter]
) -> None:
    w = make(writers, root, V12, devices=DEVICES[:2])
    w.add_process(1, 501)
    w.add_memory(1, 1, "data", GiB)
    h = Harness(root)
    assert h.scan()[-1] == ev(UsageSample, cid=0, rows=[row(1, 501, 0), row(1, 501, 1, data=GiB)])
    w.add_memory(1, 1, "data", -GiB)  # counters back to zero: still listed below device_num
    assert h.scan() == [ev(UsageSample, cid=0, rows=[row(1, 501, 1)])]
    w._set_device_num(1)  # the device leaves the table: its row is stated as zero
    assert h.scan() == [
        ev(LimitsChanged, cid=0, devices=LIMITS[:1]),
        ev(UsageSample, cid=0, rows=[row(1, 501, 0), row(1, 501, 1)]),  # a new table: restated
    ]
    (hb,) = [e for e in h.scan_all(3600_000) if isinstance(e, Heartbeat)]
    assert hb.containers[0].rows == [row(1, 501, 0)]


def test_rows_of_a_device_not_yet_registered_go_out_once_it_is(
    root: Path, writers: list[CacheWriter]
) -> None:
    """HAMi-core fills the device table lazily: usage on device 1 while device_num is 1 has no
    UUID to be billed under. It is not sent (nor restated), and goes out, unchanged since, in
    the scan that sees the device registered."""
    w = make(writers, root, V12, devices=DEVICES[:2])
    w._set_device_num(1)
    w.add_process(1, 501)
    w.add_memory(1, 1, "data", GiB)
    h = Harness(root)
    assert h.scan()[-1] == ev(UsageSample, cid=0, rows=[row(1, 501, 0)])
    assert h.scan() == []
    (hb,) = [e for e in h.scan_all(3600_000) if isinstance(e, Heartbeat)]
    assert hb.containers[0].rows == [row(1, 501, 0)]
    w._set_device_num(2)
    assert h.scan() == [
        ev(LimitsChanged, cid=0, devices=LIMITS[:2]),
        ev(UsageSample, cid=0, rows=[row(1, 501, 0), row(1, 501, 1, data=GiB)]),
    ]
    assert h.scan() == []


def test_limits_changed(root: Path, writers: list[CacheWriter]) -> None:
    w = make(writers, root, V11)
    h = Harness(root)
    h.scan()
    w.region.limit[1] = 2 * GiB
    w.region.sm_limit[0] = 30
    expected = [DeviceLimit(0, GPU0, 4 * GiB, 30), DeviceLimit(1, GPU1, 2 * GiB, 100)]
    assert h.scan() == [ev(LimitsChanged, cid=0, devices=expected)]
    assert h.scan() == []


def test_devices_registered_later_are_a_limits_change(root: Path, tmp_path: Path) -> None:
    # The file is initialised before the first NVML call registers device_num and uuids.
    d = root / f"{POD}_main"
    d.mkdir()
    w = CacheWriter(d / "late.cache", V12, DEVICES, register_devices=False)
    try:
        h = Harness(root)
        assert h.scan()[0] == ev(
            ContainerAppeared,
            cid=0,
            pod_uid=POD,
            container="main",
            path=str(w.path),
            layout="v1.2",
            devices=[],
        )
        w.register_devices()
        assert h.scan() == [ev(LimitsChanged, cid=0, devices=LIMITS)]
    finally:
        w.close()


# --- anomalies ------------------------------------------------------------------------------


def test_anomaly_once_while_it_persists_and_again_when_it_returns(
    root: Path, writers: list[CacheWriter]
) -> None:
    w = make(writers, root, V12, devices=[SimDevice(GPU0, GiB, 100)])
    w.add_process(1, 501)
    h = Harness(root)
    h.scan()

    def over(used: int) -> Body:
        detail = f"live processes use {used} bytes on device 0, limit {GiB}"
        return anomaly(w, "over_limit", detail, device=0, value=used)

    w.add_memory(1, 0, "data", GiB + MiB)
    assert h.scan() == [
        over(GiB + MiB),
        ev(UsageSample, cid=0, rows=[row(1, 501, 0, data=GiB + MiB)]),
    ]
    w.add_memory(1, 0, "data", MiB)  # still over, by another amount: not reported again
    assert h.scan() == [ev(UsageSample, cid=0, rows=[row(1, 501, 0, data=GiB + 2 * MiB)])]
    w.add_memory(1, 0, "data", -2 * MiB)  # exactly at the limit: gone, silently
    assert h.scan() == [ev(UsageSample, cid=0, rows=[row(1, 501, 0, data=GiB)])]
    w.add_memory(1, 0, "data", 5 * MiB)
    assert h.scan() == [
        over(GiB + 5 * MiB),
        ev(UsageSample, cid=0, rows=[row(1, 501, 0, data=GiB + 5 * MiB)]),
    ]


def test_anomalies_are_per_file(root: Path, writers: list[CacheWriter]) -> None:
    a = make(writers, root, V11_INTERIM, container="a")
    b = make(writers, root, V11_INTERIM, container="b")
    h = Harness(root)
    assert h.scan() == appeared(a, 0, "a") + appeared(b, 1, "b")
    assert [x for x in h.scan() if x[0] == "LayoutAnomaly"] == []


def write_header(path: Path, major: int, minor: int, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = bytearray(size)
    data[0:12] = b"".join(x.to_bytes(4, "little") for x in (MAGIC, major, minor))
    path.write_bytes(bytes(data))


def test_garbage_files_are_anomalies_not_crashes(root: Path) -> None:
    rng = random.Random(5)
    d = root / f"{POD}_junk"
    d.mkdir()
    noise = d / "1-noise.cache"
    noise.write_bytes(bytes(rng.getrandbits(8) for _ in range(4096)))
    empty = d / "2-empty.cache"
    empty.write_bytes(b"")
    future = d / "3-future.cache"
    write_header(future, 7, 0, 4096)
    short = d / "4-short.cache"
    write_header(short, 1, 2, 5000)
    os.mkfifo(d / "5-fifo.cache")

    h = Harness(root)

    def garbage(cid: int, path: Path, layout: str = "") -> Body:
        return ev(
            ContainerAppeared,
            cid=cid,
            pod_uid=POD,
            container="junk",
            path=str(path),
            layout=layout,
            devices=[],
        )

    assert h.scan() == [
        anomaly(d / "5-fifo.cache", "skipped_path", "not a regular file", cid=-1),
        garbage(0, noise),
        anomaly(noise, "not_initialized", f"initialized_flag is not {MAGIC}", cid=0),
        garbage(1, empty),
        anomaly(empty, "not_initialized", "empty", cid=1),
        garbage(2, future),
        anomaly(future, "unknown_version", "version 7.0 is not a known layout", cid=2),
        garbage(3, short, "v1.2"),
        anomaly(short, "truncated", f"5000 bytes, v1.2 needs {V12.region_size}", cid=3),
    ]
    assert h.scan() == []  # all persist: nothing new
    # The short one is grown to its full size (as HAMi-core does): the anomaly goes away.
    with short.open("r+b") as f:
        f.truncate(V12.file_size)
    assert h.scan() == []
    with short.open("r+b") as f:
        f.truncate(5000)
    assert h.scan() == [
        anomaly(short, "truncated", f"5000 bytes, v1.2 needs {V12.region_size}", cid=3)
    ]


def test_a_file_unusable_then_back_uninitialised_is_announced_again_and_ends_its_processes(
    root: Path, writers: list[CacheWriter], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The container stays with its device table (billed as present): after a spell in which
    heartbeats left it out, it is announced again with that table."""
    w = make(writers, root, V12)
    w.add_process(10, 1010)
    h = Harness(root)
    h.scan()

    def denied(f: Any) -> Any:
        raise PermissionError(13, "Permission denied", f.path)

    monkeypatch.setattr(h.scanner.discovery, "open", denied)
    assert h.scan() == [anomaly(w, "unreadable", "open: Permission denied")]
    monkeypatch.undo()
    with w.path.open("r+b") as f:
        f.write(bytes(V12.file_size))  # zeroed in place by the restarted container
    assert h.scan() == [
        anomaly(w, "not_initialized", f"initialized_flag is not {MAGIC}"),
        *appeared(w),
        ev(ProcessExited, cid=0, pid=10, hostpid=1010),
    ]
    assert h.scan() == []


def test_file_initialised_after_it_appeared(root: Path, writers: list[CacheWriter]) -> None:
    d = root / f"{POD}_main"
    d.mkdir()
    path = d / "x.cache"
    path.write_bytes(bytes(V12.file_size))  # created, not yet initialised
    h = Harness(root)
    assert h.scan() == [
        ev(
            ContainerAppeared,
            cid=0,
            pod_uid=POD,
            container="main",
            path=str(path),
            layout="",
            devices=[],
        ),
        anomaly(path, "not_initialized", f"initialized_flag is not {MAGIC}"),
    ]
    w = CacheWriter(path, V12, DEVICES)
    writers.append(w)
    assert h.scan() == [ev(LimitsChanged, cid=0, devices=LIMITS)]


# --- every layout on one node, heartbeats ---------------------------------------------------


def fold(events: list[Event]) -> dict[int, dict[tuple[int, int, int], UsageRow]]:
    """What a consumer knows from the change events alone: latest rows per live container."""
    live: dict[int, dict[tuple[int, int, int], UsageRow]] = {}
    for e in events:
        if isinstance(e, ContainerAppeared):
            live[e.cid] = {}
        elif isinstance(e, ContainerGone):
            del live[e.cid]
        elif isinstance(e, ProcessExited):
            rows = live[e.cid]
            for k in [k for k in rows if k[:2] == (e.pid, e.hostpid)]:
                del rows[k]
        elif isinstance(e, UsageSample):
            for r in e.rows:
                live[e.cid][(r.pid, r.hostpid, r.device)] = r
    return live


def test_heartbeat_restates_every_live_key_in_parts_of_64(
    root: Path, writers: list[CacheWriter]
) -> None:
    n = 2 * HEARTBEAT_PART + 3
    layouts = list(LAYOUTS.values())
    ws = [make(writers, root, layouts[i % len(layouts)], container=f"c{i:03d}") for i in range(n)]
    h = Harness(root, heartbeat_s=5)
    for i, w in enumerate(ws):
        w.add_process(1, 1000 + i)
        w.add_memory(1, 0, "data", (i + 1) * MiB)
    h.scan_all(0)
    for i, w in enumerate(ws[::3]):
        w.add_process(2, 5000 + i)
        w.add_memory(2, 1, "module", GiB)
        w.exit(1)
    for w in ws[1::3]:
        w.add_memory(1, 1, "context", 2 * GiB)
    ws[-1].path.unlink()
    h.scan_all(1000)
    events = h.scan_all(4000)
    hbs = [e for e in events if isinstance(e, Heartbeat)]
    assert [type(e) for e in events] == [Heartbeat] * 3  # nothing changed, only the heartbeat
    assert [(hb.part, hb.parts, len(hb.containers)) for hb in hbs] == [
        (0, 3, HEARTBEAT_PART),
        (1, 3, HEARTBEAT_PART),
        (2, 3, n - 1 - 2 * HEARTBEAT_PART),
    ]
    assert {hb.interval_ms for hb in hbs} == {5000}
    assert {hb.files for hb in hbs} == {n - 1}
    states = [c for hb in hbs for c in hb.containers]
    assert sorted(c.cid for c in states) == list(range(n - 1))
    known = fold(h.events)
    assert {c.cid: {(r.pid, r.hostpid, r.device): r for r in c.rows} for c in states} == known
    by_cid = {c.cid: c for c in states}
    for cid, w in enumerate(ws[:-1]):
        c = by_cid[cid]
        assert (c.pod_uid, c.container, c.layout) == (POD, f"c{cid:03d}", w.layout.name)
        assert c.devices == LIMITS
        assert c.rows == sorted(c.rows, key=lambda r: (r.pid, r.hostpid, r.device))
    # A state row restates the latest absolute values, e.g. container 1 (context added).
    assert by_cid[1].rows == [row(1, 1001, 0, data=2 * MiB), row(1, 1001, 1, context=2 * GiB)]
    # The next heartbeat is due a period after this one.
    assert not any(isinstance(e, Heartbeat) for e in h.scan_all(4999))
    assert sum(isinstance(e, Heartbeat) for e in h.scan_all(1)) == 3


def test_empty_node_heartbeat_is_one_empty_part(root: Path) -> None:
    h = Harness(root)
    (hb,) = h.scan_all()
    assert isinstance(hb, Heartbeat)
    assert (hb.part, hb.parts, hb.containers, hb.files) == (0, 1, [], 0)


def test_every_layout_side_by_side(root: Path, writers: list[CacheWriter]) -> None:
    ws = [make(writers, root, lay, container=f"c{i}") for i, lay in enumerate(LAYOUTS.values())]
    for i, w in enumerate(ws):
        w.add_process(1, 100 + i)
        w.add_memory(1, 0, "data", (i + 1) * 256 * MiB)
        w.watch({100 + i: {0: ((i + 1) * 256 * MiB + 300 * MiB, 10 * i)}})
    h = Harness(root)
    expected: list[Body] = []
    for i, w in enumerate(ws):
        sm = 0 if w.layout is V0A else 10 * i  # v0a has no utilization fields
        used = (i + 1) * 256 * MiB
        expected += appeared(w, i, f"c{i}")
        expected += [
            ev(ProcessStarted, cid=i, pid=1, hostpid=100 + i),
            ev(
                UsageSample,
                cid=i,
                rows=[
                    row(1, 100 + i, 0, data=used, monitor=used + 300 * MiB, sm=sm),
                    row(1, 100 + i, 1),
                ],
            ),
        ]
    assert h.scan() == expected


# --- reads that fail part-way ----------------------------------------------------------------


def test_a_torn_slot_is_not_an_exit(root: Path, writers: list[CacheWriter]) -> None:
    w = make(writers, root, V12)
    h = Harness(root, heartbeat_s=0.001)  # a heartbeat every scan
    h.scan()
    w.add_process(10, 1010)
    w.add_memory(10, 0, "data", GiB)
    h.scan()
    # A writer dies inside its seqlock bracket: the seqlock stays odd and the slot is left out.
    w.region.procs[0].seqlock += 1
    torn = h.scan()
    assert [b for b in torn if b[0] != "LayoutAnomaly"] == []
    assert [b[1]["anomaly"] for b in torn] == ["torn_read"]
    heartbeat = h.events[-1]
    assert isinstance(heartbeat, Heartbeat)
    assert heartbeat.containers[0].rows == [row(10, 1010, 0, data=GiB), row(10, 1010, 1)]
    # The bracket closes: the process is read again, with no start event, and every row is
    # restated (what changed while the slot was torn was not seen).
    w.region.procs[0].seqlock += 1
    assert h.scan() == [
        ev(UsageSample, cid=0, rows=[row(10, 1010, 0, data=GiB), row(10, 1010, 1)]),
    ]
    assert h.scan() == []


def test_the_exit_of_a_process_that_never_had_a_host_pid_is_an_exit(
    root: Path, writers: list[CacheWriter]
) -> None:
    """101 never got a host pid nor memory, and exits: its slot is all zero (pid, status and
    untouched counters), below a `proc_num` whose last slot is live. That is an exit marker,
    not a garbled count: 101 exits, and 102 after it goes on being read."""
    w = make(writers, root, V12)
    w.add_process(100, 5100)
    w.add_memory(100, 0, "data", GiB)
    w.add_process(101, 0)
    w.add_process(102, 5102)
    w.add_memory(102, 0, "data", 2 * GiB)
    h = Harness(root)
    h.scan()
    w.exit(101)
    assert h.scan() == [ev(ProcessExited, cid=0, pid=101, hostpid=0)]
    w.add_memory(102, 0, "data", GiB)
    assert h.scan() == [ev(UsageSample, cid=0, rows=[row(102, 5102, 0, data=3 * GiB)])]


@pytest.mark.parametrize("layout", [V12, V11], ids=["v1.2", "v1.1"])
def test_a_torn_slot_holds_back_only_the_process_now_in_it(
    root: Path, writers: list[CacheWriter], monkeypatch: pytest.MonkeyPatch, layout: Layout
) -> None:
    """101 exits and compaction moves 102 into its slot, which is then being written all
    through the scan (a torn read, with a seqlock or without one): 101's exit goes out, and
    only 102 (the pid read in the slot) is held back, not the process last seen there."""
    w = make(writers, root, layout)
    for pid in (100, 101, 102):
        w.add_process(pid, 5000 + pid)
        w.add_memory(pid, 0, "data", (pid - 99) * GiB)
    h = Harness(root)
    h.scan()
    w.exit(101)
    if layout.slot_seqlock is not None:
        w.compact()
    assert w.slot_of(102) == 1
    real = os.pread
    moving = w.region.procs[1]

    def writing(fd: int, n: int, offset: int) -> bytes:
        moving.monitorused[0] += 1  # the watcher writes the slot between any two reads
        if layout.slot_seqlock is not None:
            moving.seqlock += 2
        return real(fd, n, offset)

    monkeypatch.setattr(os, "pread", writing)
    events = h.scan()
    monkeypatch.undo()
    assert [b for b in events if b[0] != "LayoutAnomaly"] == [
        ev(ProcessExited, cid=0, pid=101, hostpid=5101)
    ]
    assert [(b[1]["anomaly"], b[1]["slot"], b[1]["value"]) for b in events
            if b[0] == "LayoutAnomaly"] == [("torn_read", 1, 102)]  # fmt: skip
    assert sorted({pk[:2] for pk in h.scanner._files[next(iter(h.scanner._files))].rows}) == [
        (100, 5100),
        (102, 5102),
    ]


def test_a_slot_kept_torn_holds_back_one_process_not_every_one_of_its_pid(
    root: Path, writers: list[CacheWriter]
) -> None:
    """Slot 0 is kept torn (odd at another count each scan) with pid 7, and the tenant writes
    pid 7 under new host pids into its other slots every scan: every process ever seen with
    pid 7 was held back, so none exited and the state (stated, billed and restated in every
    heartbeat) grew by four processes a scan. Only the one last seen in slot 0 is held."""
    w = make(writers, root, V12)
    w.add_process(7, 1)
    for k in range(1, 5):
        w.add_process(7, 100 + k)
        w.region.procs[k].used[0].data_size = w.region.procs[k].used[0].total = GiB
    h = Harness(root)
    h.scan()
    for scan in range(1, 4):
        w.region.procs[0].seqlock = 2 * scan + 1
        for k in range(1, 5):
            w.region.procs[k].hostpid = 100 * (scan + 1) + k
        events = h.scan()
        exited = sorted(b[1]["hostpid"] for b in events if b[0] == "ProcessExited")
        started = sorted(b[1]["hostpid"] for b in events if b[0] == "ProcessStarted")
        assert exited == [100 * scan + k for k in range(1, 5)]
        assert started == [100 * (scan + 1) + k for k in range(1, 5)]
        st = h.scanner._files[next(iter(h.scanner._files))]
        assert sorted(st.procs) == [(7, 1)] + [(7, 100 * (scan + 1) + k) for k in range(1, 5)]


def test_a_file_that_turns_unreadable_keeps_its_processes_and_is_restated_after(
    root: Path, writers: list[CacheWriter], monkeypatch: pytest.MonkeyPatch
) -> None:
    w = make(writers, root, V12)
    w.add_process(10, 1010)
    w.add_memory(10, 0, "data", GiB)
    h = Harness(root, heartbeat_s=0.001)
    h.scan()
    real = h.scanner.discovery.open

    def denied(f: Any) -> Any:
        raise PermissionError(13, "Permission denied", f.path)

    monkeypatch.setattr(h.scanner.discovery, "open", denied)
    assert h.scan() == [anomaly(w, "unreadable", "open: Permission denied")]
    heartbeat = h.events[-1]
    assert isinstance(heartbeat, Heartbeat)
    assert heartbeat.containers == []  # values lapse after max_gap instead of being restated
    monkeypatch.setattr(h.scanner.discovery, "open", real)
    w.add_memory(10, 0, "data", GiB)
    # Announced again (heartbeats left it out: the aggregator may have forgotten its name) with
    # every row, not only the changed one: the values had lapsed.
    assert h.scan() == [
        *appeared(w),
        ev(UsageSample, cid=0, rows=[row(10, 1010, 0, data=2 * GiB), row(10, 1010, 1)]),
    ]
    heartbeat = h.events[-1]
    assert isinstance(heartbeat, Heartbeat)
    assert [c.rows for c in heartbeat.containers] == [
        [row(10, 1010, 0, data=2 * GiB), row(10, 1010, 1)]
    ]
