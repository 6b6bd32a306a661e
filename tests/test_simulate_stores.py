"""The simulator's writer stores an update of a `used[]` entry at once, as HAMi-core's few
instructions practically do. Two Python statements can be milliseconds apart (a thread waits
out the GIL's switch interval between them); in layouts without a seqlock, two reads of the
slot can then agree on a half-done update, which no reader can tell from a finished one, and
the tests that check `total == context + module + data` on what the collector sent would fail
for the simulator's sake, not the collector's.

Python switches threads only between bytecodes, so the collector's reader is run at every
bytecode boundary of the writer's update: what it reads there is all another thread could
ever see of it. (A thread of the operating system can still be preempted between the machine
stores of one copy, as HAMi-core's can: no reader without a seqlock can tell that from a
finished update; README, Consistency. An earlier form of this test ran the writer in a thread
against a reading loop, and failed in CI once that way.)"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from collector.layout.declarations import LAYOUTS
from collector.layout.reader import read_snapshot
from collector.layout.snapshot import DeviceUsage
from collector.simulate import CacheWriter, SimDevice

WITHOUT_SEQLOCK = sorted(name for name, lay in LAYOUTS.items() if lay.slot_seqlock is None)
MASK = (1 << 64) - 1


@contextmanager
def read_at_every_bytecode(path: Path, torn: list[DeviceUsage]) -> Iterator[list[int]]:
    """Reads the file at each bytecode boundary of the calls made inside the block (not of
    the block's own frame), collecting rows whose total is not the sum of their parts."""
    boundaries = [0]

    def check() -> None:
        boundaries[0] += 1
        for p in read_snapshot(str(path)).procs:
            torn.extend(u for u in p.devices if u.total != u.context + u.module + u.data)

    def trace(frame: FrameType, event: str, arg: Any) -> Callable[..., Any]:
        if event == "call":
            frame.f_trace_opcodes = True
        if event in ("opcode", "return"):
            check()
        return trace

    sys.settrace(trace)
    try:
        yield boundaries
    finally:
        sys.settrace(None)


def split_update(w: CacheWriter, pid: int, device: int, kind: str, nbytes: int) -> None:
    """The simulator's update before it stored the entry at once: two stores, two statements."""
    used = w._slot(pid).used[device]
    setattr(used, f"{kind}_size", (getattr(used, f"{kind}_size") + nbytes) & MASK)
    used.total = (used.total + nbytes) & MASK


def updates(write: Callable[[CacheWriter, int, int, str, int], None], w: CacheWriter) -> None:
    for n in (1, 7, 1000):
        for kind, sign in (("data", 1), ("context", 1), ("module", 1)):
            write(w, 1, 0, kind, sign * 4096 * n)
        for kind in ("module", "context", "data"):
            write(w, 1, 0, kind, -4096 * n)


@pytest.mark.parametrize("name", WITHOUT_SEQLOCK)
def test_no_bytecode_boundary_of_an_update_shows_half_of_it(tmp_path: Path, name: str) -> None:
    assert WITHOUT_SEQLOCK == ["v0a", "v0b", "v1.1"]
    path = tmp_path / "c.cache"
    w = CacheWriter(path, LAYOUTS[name], [SimDevice("GPU-00000000-0000")])
    w.add_process(1, 11)
    try:
        torn: list[DeviceUsage] = []
        with read_at_every_bytecode(path, torn) as boundaries:
            updates(CacheWriter.add_memory, w)
        # 18 updates, each dozens of bytecodes: the reader really ran between them.
        assert boundaries[0] > 18 * 20
        assert torn == []
        assert [u.total for p in read_snapshot(str(path)).procs for u in p.devices] == [0]

        # The same reads catch the update as two statements: the check can fail.
        with read_at_every_bytecode(path, torn):
            updates(split_update, w)
        # Each update leaves one half-done state, seen at every boundary between its stores.
        assert len({(u.context, u.module, u.data, u.total) for u in torn}) == 18
        assert {u.total - (u.context + u.module + u.data) for u in torn} == {
            d * 4096 * n for n in (1, 7, 1000) for d in (-1, 1)
        }
    finally:
        w.close()
