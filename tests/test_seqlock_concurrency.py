"""The seqlock under a real concurrent writer.

`tests/c/seqlock_writer.c` maps a cache file MAP_SHARED (as libvgpu.so does) and rewrites
`used[0..3]` of slot 0 inside seqlock brackets, keeping total == context + data with values
that change every update. Meanwhile this test takes snapshots and requires every device entry
it gets back for slot 0 to be consistent. A plain read of the same bytes without the seqlock
must see inconsistent values in the same period, so the check has teeth.

Two writer speeds:
* "tight": no pause at all, about 10^8 updates/s. The seqlock word changes every few ns, far
  faster than one `pread` (about 1 us), so most snapshots cannot get a consistent slot 0 within
  their retry bound and report `torn_read` instead (no reader can do better: a seqlock lets a
  writer that never stops starve its readers). What matters there: whatever comes back is
  consistent.
* "hot": a pause of PAUSE_NS between updates, about 10^5 updates/s per slot, far above what a
  CUDA program's allocations produce. Here fewer than 1 % of >= 100 000 snapshots may be torn.
"""

from __future__ import annotations

import ctypes as C
import os
import struct
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from ccompile import compile_c

from collector.layout.declarations import LAYOUTS, Layout
from collector.layout.reader import ParseMemo, read_snapshot, snapshot_fd
from collector.simulate import CacheWriter, SimDevice

C_SOURCE = Path(__file__).parent / "c" / "seqlock_writer.c"
NDEV = 4
PAUSE_NS = 5_000
HOT_SNAPSHOTS = 100_000
TIGHT_SECONDS = 2.0  # at least this long
TIGHT_SNAPSHOTS = 1000  # and at least this many snapshots, on a slow machine within:
TIGHT_LIMIT_SECONDS = 40.0  # (less than WRITER_SECONDS: the writer must still be running)
TEETH_SECONDS = 5.0
WRITER_SECONDS = 60.0  # upper bound; the test stops the writer when done


@pytest.fixture(scope="module")
def writer_exe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_c(C_SOURCE, tmp_path_factory.mktemp("seqlock"), opt="-O2")


@dataclass(frozen=True)
class Geometry:
    """Offsets for the C writer and the plain reader, all from the ctypes declarations."""

    slot: int  # absolute offset of slot 0
    seq: int  # seqlock inside the slot
    used: int  # used[] inside the slot
    stride: int  # sizeof(device_memory_t)
    ctx: int
    data: int
    total: int

    @classmethod
    def of(cls, lay: Layout) -> Geometry:
        dm = lay.device_memory
        assert lay.slot_seqlock is not None
        return cls(
            slot=lay.slot_offset(0),
            seq=lay.slot_seqlock,
            used=lay.slot_used,
            stride=C.sizeof(dm),
            ctx=dm.context_size.offset,
            data=dm.data_size.offset,
            total=dm.total.offset,
        )

    def args(self) -> list[str]:
        return [str(v) for v in (self.slot, self.seq, self.used, self.stride, self.ctx,
                                 self.data, self.total)]  # fmt: skip


@contextmanager
def running_writer(exe: Path, path: Path, geo: Geometry, pause_ns: int) -> Iterator[None]:
    cmd = [str(exe), str(path), *geo.args(), str(NDEV), str(WRITER_SECONDS), str(pause_ns)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline().strip()
        assert line == "ready", (line, proc.stderr.read())
        yield
        assert proc.poll() is None, "the writer stopped before the test was done"
    finally:
        proc.terminate()  # SIGTERM: the writer finishes its bracket, then exits
        out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    updates, seq = (int(v) for v in out.split()[1::2])
    assert updates > 0 and seq % 2 == 0, out


def _u64x3(raw: bytes, geo: Geometry, d: int) -> tuple[int, int, int]:
    base = geo.used + d * geo.stride
    (ctx,) = struct.unpack_from("<Q", raw, base + geo.ctx)
    (data,) = struct.unpack_from("<Q", raw, base + geo.data)
    (total,) = struct.unpack_from("<Q", raw, base + geo.total)
    return ctx, data, total


def plain_inconsistent(fd: int, geo: Geometry, slot_size: int) -> int:
    """Read slot 0 with no seqlock, as a field-by-field reader would (HAMi's monitor reads
    fields one at a time): the slot, then `total` of each device again. How many devices
    have total != context + data."""
    raw = bytearray(os.pread(fd, slot_size, geo.slot))
    bad = 0
    for d in range(NDEV):
        at = geo.used + d * geo.stride + geo.total
        raw[at : at + 8] = os.pread(fd, 8, geo.slot + at)
        ctx, data, total = _u64x3(bytes(raw), geo, d)
        bad += total != ctx + data
    return bad


@dataclass
class Tally:
    snapshots: int = 0
    torn: int = 0  # snapshots with a torn_read anomaly
    slot0_missing: int = 0
    entries_checked: int = 0
    inconsistent: list[tuple[int, int, int, int]] | None = None
    plain_reads: int = 0
    plain_inconsistent: int = 0

    def __post_init__(self) -> None:
        self.inconsistent = []

    def report(self) -> str:
        return (
            f"snapshots={self.snapshots} torn_read={self.torn} "
            f"({100 * self.torn / max(self.snapshots, 1):.3f} %) "
            f"slot0_missing={self.slot0_missing} entries_checked={self.entries_checked} "
            f"plain_reads={self.plain_reads} plain_inconsistent={self.plain_inconsistent} "
            f"inconsistent (device, context, data, total)={(self.inconsistent or [])[:5]}"
        )


def tight_enough(start: float, tally: Tally) -> bool:
    elapsed = time.monotonic() - start
    return elapsed >= TIGHT_SECONDS and (
        tally.snapshots >= TIGHT_SNAPSHOTS or elapsed >= TIGHT_LIMIT_SECONDS
    )


def take(
    fd: int,
    path: str,
    geo: Geometry,
    slot_size: int,
    tally: Tally,
    *,
    plain: bool,
    memo: ParseMemo | None = None,
) -> None:
    snap = snapshot_fd(fd, path, memo=memo)
    tally.snapshots += 1
    if any(a.kind == "torn_read" for a in snap.anomalies):
        tally.torn += 1
    slot0 = [p for p in snap.procs if p.slot == 0]
    if not slot0:
        tally.slot0_missing += 1
    for p in slot0:
        for u in p.devices:
            tally.entries_checked += 1
            if u.total != u.context + u.module + u.data:
                assert tally.inconsistent is not None
                tally.inconsistent.append((u.index, u.context, u.data, u.total))
    if plain:
        tally.plain_reads += 1
        tally.plain_inconsistent += plain_inconsistent(fd, geo, slot_size)


def _file(tmp_path: Path, name: str) -> Path:
    path = tmp_path / "c.cache"
    w = CacheWriter(path, LAYOUTS[name], [SimDevice(f"GPU-{d:08d}-0000") for d in range(NDEV)])
    w.add_process(1, 11)
    w.add_process(2, 12)
    w.add_memory(2, 0, "data", 12345)
    w.close()
    return path


@pytest.mark.parametrize("name", ["v1.2", "v1.1-interim"])
def test_seqlock_snapshots_are_consistent(
    writer_exe: Path, tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    lay = LAYOUTS[name]
    geo = Geometry.of(lay)
    path = _file(tmp_path, name)
    fd = os.open(path, os.O_RDONLY)
    try:
        # --- tight loop: everything returned is consistent; a plain read is not ------------
        tight = Tally()
        with running_writer(writer_exe, path, geo, pause_ns=0):
            start = time.monotonic()
            while not tight_enough(start, tight):
                take(fd, str(path), geo, lay.slot_size, tight, plain=True)
            end = time.monotonic() + TEETH_SECONDS
            while tight.plain_inconsistent == 0 and time.monotonic() < end:
                tight.plain_reads += 1
                tight.plain_inconsistent += plain_inconsistent(fd, geo, lay.slot_size)
        assert tight.inconsistent == [], tight.report()
        assert tight.plain_inconsistent > 0, "no-seqlock read never saw a torn value: " + (
            tight.report()
        )
        assert tight.snapshots >= TIGHT_SNAPSHOTS, tight.report()

        # --- hot writer: >= 100 000 snapshots, < 1 % torn ----------------------------------
        hot = Tally()
        with running_writer(writer_exe, path, geo, pause_ns=PAUSE_NS):
            while hot.snapshots < HOT_SNAPSHOTS:
                take(fd, str(path), geo, lay.slot_size, hot, plain=hot.snapshots % 2 == 0)
            end = time.monotonic() + TEETH_SECONDS
            while hot.plain_inconsistent == 0 and time.monotonic() < end:
                hot.plain_reads += 1
                hot.plain_inconsistent += plain_inconsistent(fd, geo, lay.slot_size)
        assert hot.inconsistent == [], hot.report()
        assert hot.torn < hot.snapshots / 100, hot.report()
        assert hot.slot0_missing == hot.torn, hot.report()  # torn slot 0 is the only loss
        assert hot.entries_checked == (hot.snapshots - hot.slot0_missing) * NDEV, hot.report()
    finally:
        os.close(fd)
    with capsys.disabled():
        print(f"\n[{name}] tight: {tight.report()}\n[{name}] hot ({PAUSE_NS} ns): {hot.report()}")
    # The writer has stopped: the file reads cleanly and slot 0 is consistent again.
    final = read_snapshot(path)
    assert not [a for a in final.anomalies if a.kind != "mislabelled_layout"]


@pytest.mark.parametrize("name", ["v1.2", "v1.1-interim"])
def test_memoised_snapshots_are_consistent(writer_exe: Path, tmp_path: Path, name: str) -> None:
    """The collector's path (one ParseMemo across snapshots: the slots read in one piece, last
    scan's parse reused where the bytes are the same) under the same tight writer: nothing it
    returns is torn, and the slot-by-slot fallback is taken when the writer is caught."""
    lay = LAYOUTS[name]
    geo = Geometry.of(lay)
    path = _file(tmp_path, name)
    fd = os.open(path, os.O_RDONLY)
    memo = ParseMemo()
    tally = Tally()
    try:
        with running_writer(writer_exe, path, geo, pause_ns=0):
            start = time.monotonic()
            while not tight_enough(start, tally):
                take(fd, str(path), geo, lay.slot_size, tally, plain=False, memo=memo)
    finally:
        os.close(fd)
    assert tally.inconsistent == [], tally.report()
    assert tally.snapshots >= TIGHT_SNAPSHOTS and tally.entries_checked > 0, tally.report()
    assert tally.torn > 0, tally.report()  # caught mid-update: the fallback ran
    fd = os.open(path, os.O_RDONLY)
    try:  # the writer has stopped: the memo gives what a fresh read gives
        assert snapshot_fd(fd, str(path), memo=memo) == read_snapshot(path)
    finally:
        os.close(fd)
