"""The collector's reads of a file it already knows: fewer system calls, the same answers.

* A snapshot through a `ParseMemo` whose header is last scan's takes four reads (three without
  a seqlock), reads the slots past proc_num along for the writer-fault checks, and still equals
  a fresh `read_snapshot` after any writer or hostile step (the property of test_parse_memo,
  with the slots past proc_num read along and compared with reads of their own).
* The writer-fault checks given those bytes answer as when they read them themselves: a
  Scanner that reuses and one that reads everything give the same events on a node with every
  writer fault, scan after scan.
* A kept file in a folder that has not changed is checked with `fstat` of its descriptor
  instead of a lookup of its name; a file replaced, relinked or swapped for a symlink there, or
  the folder replaced, is still caught.
"""

from __future__ import annotations

import contextlib
import os
import re
import struct
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from test_kept_descriptors import replaced
from test_parse_memo import GPUS, apply, steps

from collector.events import (
    ContainerAppeared,
    ContainerGone,
    Event,
    Heartbeat,
    LayoutAnomaly,
    LimitsChanged,
    UsageSample,
)
from collector.layout.declarations import LAYOUTS, V0A, V12
from collector.layout.reader import ParseMemo, read_snapshot, snapshot_fd
from collector.layout.snapshot import Snapshot
from collector.node import discover
from collector.node.scan import Scanner
from collector.simulate import CacheWriter, GiB, MiB, SimDevice
from collector.simulate_faults import FAULTS, FaultyNode

POD = "0f4e8a52-7d3c-4b8e-9a51-3c2d1e0f9a88"
GPU0 = "GPU-11111111-2222-4333-8444-555555555555"
OLD = 1_600_000_000
WINDOW_S = 0.2  # the timestamp window, shortened for these tests


def ahead(n: int) -> int:
    """As the writer-fault checks ask: at least two slots, up to the highest proc_num seen (so
    a proc_num that changes need not change how much is read)."""
    return max(n + 2, 8)


def check_past(memo: ParseMemo, snap: Snapshot, rfd: int) -> None:
    """`memo.past` holds what reads of the slots past proc_num give, in the layout detected
    (a poked header can turn the file into another)."""
    if memo.past is None:
        return
    n, end, first, second, offset = memo.past
    read = LAYOUTS[snap.layout or ""]
    assert n == snap.proc_num and end == min(ahead(n), 1024) and offset == read.slot_offset(n)
    want = os.pread(rfd, (end - n) * read.slot_size, offset)
    assert first[offset:] == want and second[offset:] == want


@pytest.mark.parametrize("name", list(LAYOUTS))
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(history=steps)
def test_the_known_file_path_equals_a_fresh_read(
    tmp_path: Path, name: str, history: list[tuple[object, ...]]
) -> None:
    path = tmp_path / f"{name}.cache"
    path.unlink(missing_ok=True)
    w = CacheWriter(path, LAYOUTS[name], GPUS)
    for pid in (100, 101, 102, 103):
        w.add_process(pid, 4000 + pid)
        w.add_memory(pid, 0, "context", 300 * MiB)
    memo = ParseMemo()
    with contextlib.ExitStack() as stack:
        stack.callback(w.close)
        fds = [os.open(path, flags) for flags in (os.O_RDWR, os.O_RDONLY)]
        for fd in fds:
            stack.callback(os.close, fd)
        wfd, rfd = fds
        for step in [None, *history]:
            if step is not None:
                with contextlib.suppress(IndexError, KeyError, RuntimeError, ValueError):
                    apply(w, LAYOUTS[name], step, wfd)
            for _ in range(2):  # the second read finds nothing changed
                snap = snapshot_fd(rfd, str(path), memo=memo, ahead=ahead)
                assert snap == read_snapshot(path), step
                check_past(memo, snap, rfd)


def count_reads(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    calls = {"pread": 0, "fstat": 0, "stat": 0}
    real_pread, real_fstat, real_stat = os.pread, os.fstat, os.stat

    def pread(fd: int, n: int, off: int) -> bytes:
        calls["pread"] += 1
        return real_pread(fd, n, off)

    def fstat(fd: int) -> Any:
        calls["fstat"] += 1
        return real_fstat(fd)

    def stat(*a: Any, **kw: Any) -> Any:
        calls["stat"] += 1
        return real_stat(*a, **kw)

    monkeypatch.setattr(os, "pread", pread)
    monkeypatch.setattr(os, "fstat", fstat)
    monkeypatch.setattr(os, "stat", stat)
    return calls


@pytest.mark.parametrize(("layout", "preads"), [(V12, 4), (V0A, 3)], ids=["v1.2", "v0a"])
def test_a_known_file_takes_two_fstats_and_two_reads_or_the_protocol_once_it_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: Any, preads: int
) -> None:
    monkeypatch.setattr(discover, "TIMESTAMP_WINDOW_NS", int(WINDOW_S * 1e9))
    d = tmp_path / f"{POD}_main"
    d.mkdir()
    w = CacheWriter(d / "a.cache", layout, [SimDevice(GPU0, GiB)])
    w.add_process(7, 4007)
    w.add_memory(7, 0, "data", 64 * MiB)
    os.utime(d, (OLD, OLD))
    s = Scanner(tmp_path, heartbeat_s=3600, inc=1)
    s.scan(now_ms=1000)
    time.sleep(WINDOW_S + 0.05)
    s.scan(now_ms=2000)  # the name checked once more, now that the folder is old enough
    calls = count_reads(monkeypatch)
    w.kernel_launched(time.time() + 5)  # the tail moves, as on a busy GPU
    assert s.scan(now_ms=3000) == []
    # The root (once a scan: is it still the same directory?), then the folder and the file
    # by their kept descriptors: no lookup by name. The tail (with what detection probed),
    # then the header with the slots once: every byte as in the last read that passed the
    # protocol, so that state is what it holds.
    assert calls == {"pread": 2, "fstat": 3, "stat": 0}
    # The slots changed: the first read differs from what is held, and the protocol's reads
    # follow it (the seqlock words before, the slots, the seqlock words after; without a
    # seqlock the slots twice).
    calls.update(pread=0)
    w.add_memory(7, 0, "data", MiB)
    (sample,) = s.scan(now_ms=4000)
    assert isinstance(sample, UsageSample) and sample.rows[0].data == 65 * MiB
    assert calls["pread"] == preads
    calls.update(pread=0)
    assert s.scan(now_ms=4500) == []
    assert calls["pread"] == 2  # settled again
    # A process starts: proc_num, which detection probes in layouts without version fields,
    # moves. Detection is redone from the bytes already read, not from everything read again.
    calls.update(pread=0)
    w.add_process(8, 4008)
    assert [type(e).__name__ for e in s.scan(now_ms=5000)] == ["ProcessStarted", "UsageSample"]
    assert calls["pread"] == preads
    w.close()


def test_a_read_that_differs_from_the_held_bytes_takes_the_protocol(tmp_path: Path) -> None:
    """The one-read path takes only bytes equal to a read that passed the protocol: a slot
    whose seqlock a writer holds odd (a torn read) is read again by the protocol, which does
    not take it, and the snapshot keeps last scan's consistent bytes out of it."""
    path = tmp_path / "a.cache"
    w = CacheWriter(path, V12, [SimDevice(GPU0, GiB)])
    w.add_process(7, 4007)
    w.add_memory(7, 0, "data", 64 * MiB)
    rfd = os.open(path, os.O_RDONLY)
    memo = ParseMemo()
    for _ in range(3):  # header memo, then the known path, then the one-read path
        first = snapshot_fd(rfd, str(path), memo=memo)
    assert first.procs[0].devices[0].data == 64 * MiB
    seq_at = V12.slot_offset(0) + V12.slot_seqlock
    (seq,) = struct.unpack_from("<Q", os.pread(rfd, 8, seq_at))
    with open(path, "r+b") as f:  # a write in progress: seqlock odd, data half written
        f.seek(seq_at)
        f.write(struct.pack("<Q", seq + 1))
    snap = snapshot_fd(rfd, str(path), memo=memo)
    assert snap.procs == [] and [a.kind for a in snap.anomalies] == ["torn_read"]
    assert snap == read_snapshot(path)
    os.close(rfd)
    w.close()


def test_a_count_that_rises_over_a_slot_held_odd_takes_the_protocol(tmp_path: Path) -> None:
    """The held bytes include the slots past proc_num read along for the checks, whose seqlock
    words that read did not check. Slot 1 is held odd with an update half done while proc_num
    is 1; the count then rises to 2 over it, no slot byte changing. Taken whole, the one read
    equal to the held bytes gave pid 8 with its data moved and its total not (96 and 32 MiB):
    the seqlock words below the count now are checked, and the slot is a torn read, as in a
    fresh read."""
    path = tmp_path / "a.cache"
    w = CacheWriter(path, V12, [SimDevice(GPU0, GiB)])
    w.add_process(7, 4007)
    w.add_memory(7, 0, "data", 64 * MiB)
    w.add_process(8, 4008)
    w.add_memory(8, 0, "data", 32 * MiB)
    w.region.procs[1].seqlock += 1
    w.region.procs[1].used[0].data_size = 96 * MiB
    w.region.proc_num = 1
    rfd = os.open(path, os.O_RDONLY)
    memo = ParseMemo()
    for _ in range(3):  # header memo, then the known path, then the one-read path
        before = snapshot_fd(rfd, str(path), memo=memo, ahead=ahead)
    assert [p.pid for p in before.procs] == [7] and before.anomalies == []
    w.region.proc_num = 2
    snap = snapshot_fd(rfd, str(path), memo=memo, ahead=ahead)
    assert [p.pid for p in snap.procs] == [7]
    assert [(a.kind, a.slot) for a in snap.anomalies] == [("torn_read", 1)]
    assert snap == read_snapshot(path)
    os.close(rfd)
    w.close()


def timeless(e: Event) -> Event:
    """Without the scan's duration and how long a stuck seqlock was seen (the two scanners read
    at different moments)."""
    if isinstance(e, Heartbeat):
        return msgspec.structs.replace(e, scan_ms=0.0)
    if isinstance(e, LayoutAnomaly) and e.anomaly == "stuck_seqlock":
        return msgspec.structs.replace(e, detail=re.sub(r"since \S+ s", "since - s", e.detail))
    return e


@pytest.mark.parametrize("seed", [1, 2])
def test_writer_fault_checks_on_bytes_read_along_give_the_same_events(
    tmp_path: Path, seed: int
) -> None:
    node = FaultyNode(tmp_path, 12, "mixed", faults=FAULTS, seed=seed, procs_per_container=3)
    reusing = Scanner(tmp_path, heartbeat_s=5, inc=1)
    fresh = Scanner(tmp_path, heartbeat_s=5, inc=1, reuse=False)
    try:
        for n in range(40):
            if n % 3 != 2:
                node.step(1_700_000_000 + n)
            now = 1_700_000_000_000 + n * 1000
            a = [timeless(e) for e in reusing.scan(now_ms=now)]
            b = [timeless(e) for e in fresh.scan(now_ms=now)]
            assert a == b, n
    finally:
        node.close()


def limits(events: list[Event]) -> list[int]:
    return [d.limit_bytes for e in events if isinstance(e, LimitsChanged) for d in e.devices]


def container(root: Path) -> tuple[Path, CacheWriter]:
    d = root / f"{POD}_main"
    d.mkdir()
    w = CacheWriter(d / "a.cache", V12, [SimDevice(GPU0, GiB)])
    w.add_process(7, 4007)
    os.utime(d, (OLD, OLD))
    return d / "a.cache", w


def settled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, CacheWriter, Scanner]:
    """A container whose folder is older than the timestamp window, scanned until its file is
    checked by descriptor only."""
    monkeypatch.setattr(discover, "TIMESTAMP_WINDOW_NS", int(WINDOW_S * 1e9))
    path, w = container(tmp_path)
    s = Scanner(tmp_path, heartbeat_s=3600, inc=1)
    s.scan(now_ms=1000)
    time.sleep(WINDOW_S + 0.05)
    s.scan(now_ms=2000)
    h = s.discovery._held[path.parent.name]
    assert h.stamp is not None and h.files[path.name][3] == h.stamp  # by descriptor from now on
    return path, w, s


def test_a_file_replaced_in_a_settled_folder_is_reopened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, w, s = settled(tmp_path, monkeypatch)
    new = path.with_name("new.tmp")
    w2 = CacheWriter(new, V12, [SimDevice(GPU0, 2 * GiB)])
    w2.add_process(7, 4007)
    os.replace(new, path)
    os.utime(path.parent, (OLD, OLD))  # the mtime put back: the ctime still moved
    assert replaced(s.scan(now_ms=3000)) == [2 * GiB]  # read from the new file
    w.close()
    w2.close()


@pytest.mark.parametrize("change", ["hard link elsewhere", "symlink"])
def test_a_file_in_a_settled_folder_that_gains_a_link_or_becomes_a_symlink_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    path, w, s = settled(tmp_path, monkeypatch)
    outside = tmp_path.parent / f"{tmp_path.name}-outside.cache"
    w2 = CacheWriter(outside, V12, [SimDevice(GPU0, 3 * GiB)])
    if change == "symlink":
        path.unlink()
        path.symlink_to(outside)
        os.utime(path.parent, (OLD, OLD))  # the mtime put back: the ctime still moved
        reason = discover.SYMLINK
    else:
        os.link(path, tmp_path / "elsewhere")  # the folder itself does not change
        reason = "a hard-linked file (2 links): not read"
    events = s.scan(now_ms=3000)
    assert limits(events) == []  # the file outside never read
    assert [(e.path, e.detail) for e in events if isinstance(e, LayoutAnomaly)] == [
        (str(path), reason)
    ]
    w.close()
    w2.close()
    outside.unlink()


def test_a_settled_folder_replaced_by_another_is_reopened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, w, s = settled(tmp_path, monkeypatch)
    w.close()
    os.rename(path.parent, tmp_path / "old")
    path.parent.mkdir()
    w2 = CacheWriter(path, V12, [SimDevice(GPU0, 3 * GiB)])
    w2.add_process(7, 4007)
    events = s.scan(now_ms=3000)
    (appeared,) = [e for e in events if isinstance(e, ContainerAppeared)]
    assert [d.limit_bytes for d in appeared.devices] == [3 * GiB]  # the new folder's file
    assert ContainerGone in [type(e) for e in events]
    w2.close()


def _large_bytes(root: object, size: int) -> set[int]:
    """The ids of the bytes objects of at least `size` bytes that `root` refers to, at any depth
    (through tuples, lists, dicts and objects)."""
    import gc

    found: set[int] = set()
    seen: set[int] = set()
    todo = [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, bytes):
            if len(obj) >= size:
                found.add(id(obj))
            continue
        todo += [r for r in gc.get_referents(obj) if not isinstance(r, type)]
    return found


@pytest.mark.parametrize("layout", [V12, V0A], ids=["v1.2", "v0a"])
def test_an_unchanged_file_is_held_once_not_once_a_scan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: Any
) -> None:
    """The reads of the header and slots that equal bytes already held are kept as those bytes:
    the memo, the slots read along and the writer-fault checks' memo share one copy."""
    monkeypatch.setattr(discover, "TIMESTAMP_WINDOW_NS", int(WINDOW_S * 1e9))
    d = tmp_path / f"{POD}_main"
    d.mkdir()
    w = CacheWriter(d / "a.cache", layout, [SimDevice(GPU0, GiB)])
    for pid in (7, 8, 9):
        w.add_process(pid, 4000 + pid)
        w.add_memory(pid, 0, "data", 64 * MiB)
    os.utime(d, (OLD, OLD))
    s = Scanner(tmp_path, heartbeat_s=3600, inc=1)
    try:
        s.scan(now_ms=1000)  # the file appears
        time.sleep(WINDOW_S + 0.05)
        held: list[set[int]] = []
        for n in range(2, 7):
            w.kernel_launched(time.time() + n)  # the tail moves every scan, as on a busy GPU
            s.scan(now_ms=1000 * n)
            ((key, memo),) = s._memos.items()
            assert memo.past is not None  # read by the known file's path
            size = len(memo.past[2])
            held.append(_large_bytes((memo, s.writer_faults._files[key]), size))
        # Once the file is known and its slots are unchanged: one object, the same each scan.
        assert [len(h) for h in held[1:]] == [1, 1, 1, 1]
        assert held[1] == held[2] == held[3] == held[4]
        w.add_memory(7, 0, "data", MiB)  # a change: new bytes, held once again
        s.scan(now_ms=7000)
        s.scan(now_ms=8000)
        ((key, memo),) = s._memos.items()
        now = _large_bytes((memo, s.writer_faults._files[key]), size)
        assert len(now) == 1 and now != held[4]
    finally:
        w.close()
