"""The simulator's writer stores an update of a `used[]` entry at once, as HAMi-core's few
instructions practically do. Two Python statements can be milliseconds apart (a thread waits
out the GIL's switch interval between them); in layouts without a seqlock, two reads of the
slot can then agree on a half-done update, which no reader can tell from a finished one, and
the tests that check `total == context + module + data` on what the collector sent would fail
for the simulator's sake, not the collector's."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from collector.layout.declarations import LAYOUTS
from collector.layout.reader import read_snapshot
from collector.simulate import CacheWriter, SimDevice

SECONDS = 0.5  # at least this long
MIN_READS = 400  # and at least this many rows, however slow the machine (CI saw 95 in 0.5 s)
LIMIT_SECONDS = 120.0
WITHOUT_SEQLOCK = sorted(name for name, lay in LAYOUTS.items() if lay.slot_seqlock is None)


@pytest.fixture
def tiny_switch_interval() -> Iterator[None]:
    # Switch threads as often as CPython can, so that a writer's thread is interrupted between
    # any two of its statements many times a second (with two stores: in 4-5 % of the reads).
    was = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(was)


@pytest.mark.usefixtures("tiny_switch_interval")
@pytest.mark.parametrize("name", WITHOUT_SEQLOCK)
def test_reads_without_a_seqlock_never_see_half_an_update(tmp_path: Path, name: str) -> None:
    assert WITHOUT_SEQLOCK == ["v0a", "v0b", "v1.1"]
    w = CacheWriter(tmp_path / "c.cache", LAYOUTS[name], [SimDevice("GPU-00000000-0000")])
    w.add_process(1, 11)
    stop = threading.Event()

    def write() -> None:
        n = 1
        while not stop.is_set():
            w.add_memory(1, 0, "data", 4096 * n)
            w.add_memory(1, 0, "context", 4096 * n)
            w.add_memory(1, 0, "context", -4096 * n)
            w.add_memory(1, 0, "data", -4096 * n)
            n = n % 1000 + 1

    writer = threading.Thread(target=write)
    writer.start()
    reads, torn = 0, []
    try:
        start = time.monotonic()
        while (elapsed := time.monotonic() - start) < SECONDS or reads < MIN_READS:
            assert elapsed < LIMIT_SECONDS, f"{reads} reads in {elapsed:.0f} s"
            for p in read_snapshot(str(tmp_path / "c.cache")).procs:
                reads += 1
                torn += [u for u in p.devices if u.total != u.context + u.module + u.data]
    finally:
        stop.set()
        writer.join()
        w.close()
    assert reads >= MIN_READS
    assert torn == []
