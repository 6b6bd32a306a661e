"""The parse memo never changes what a snapshot says: a property over random writer histories.

One file per layout, written by the simulator and, between snapshots, changed by a random mix of
what a writer and a hostile tenant do (allocations, frees, exits, compaction, new processes,
random bytes anywhere in the header, a slot or the tail, truncation and regrowth). After every
step the snapshot taken through a `ParseMemo` kept since the first step equals a fresh
`read_snapshot` of the same bytes.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collector.layout.declarations import LAYOUTS, Layout
from collector.layout.detect import HEADER_BYTES
from collector.layout.reader import ParseMemo, read_snapshot, snapshot_fd
from collector.simulate import CacheWriter, SimDevice

MiB = 1 << 20
GPUS = [SimDevice(f"GPU-{d:08x}-1111-2222-3333-444455556666", (8 + d) << 30, 50) for d in range(3)]

steps = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(0, 5), st.integers(0, 3), st.integers(1, 64)),
        st.tuples(st.just("exit"), st.integers(0, 5)),
        st.tuples(st.just("start"), st.integers(0, 5)),
        st.tuples(st.just("compact")),
        st.tuples(st.just("watch"), st.integers(0, 100)),
        st.tuples(
            st.just("poke"),
            st.sampled_from(["header", "slot", "tail"]),
            st.integers(0, 4096),
            st.binary(min_size=1, max_size=16),
        ),  # fmt: skip
        st.tuples(st.just("truncate"), st.integers(0, 3_000_000)),
    ),
    min_size=1,
    max_size=12,
)


def apply(w: CacheWriter, layout: Layout, step: tuple[object, ...], fd: int) -> None:
    kind = step[0]
    live = [p for p in range(100, 106) if w.slot_of(p) is not None]
    if kind == "alloc" and live:
        pid = live[int(step[1]) % len(live)]  # type: ignore[call-overload]
        w.add_memory(pid, int(step[2]) % len(GPUS), "data", int(step[3]) * MiB)  # type: ignore[call-overload]
    elif kind == "exit" and live:
        w.exit(live[int(step[1]) % len(live)])  # type: ignore[call-overload]
    elif kind == "start":
        pid = 100 + int(step[1])  # type: ignore[call-overload]
        if w.slot_of(pid) is None:
            w.add_process(pid, 4000 + pid)
    elif kind == "compact":
        w.compact()
    elif kind == "watch":
        w.watch({4000 + p: {0: (MiB * int(step[1]), int(step[1]))} for p in live})  # type: ignore[call-overload]
    elif kind == "poke":
        where, at, data = step[1], int(step[2]), bytes(step[3])  # type: ignore[call-overload]
        base = {"header": 0, "slot": layout.procs, "tail": layout.proc_num}[str(where)]
        limit = {"header": HEADER_BYTES, "slot": 2 * layout.slot_size, "tail": 16}[str(where)]
        os.pwrite(fd, data, base + at % limit)
    elif kind == "truncate":
        size = os.fstat(fd).st_size
        os.ftruncate(fd, int(step[1]) % (layout.region_size + 1))  # type: ignore[call-overload]
        os.ftruncate(fd, size)  # back to its size: what was cut reads as zero


@pytest.mark.parametrize("name", list(LAYOUTS))
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(history=steps)
def test_a_memoised_snapshot_equals_a_fresh_one(
    tmp_path: Path, name: str, history: list[tuple[object, ...]]
) -> None:
    layout = LAYOUTS[name]
    path = tmp_path / f"{name}.cache"
    path.unlink(missing_ok=True)
    w = CacheWriter(path, layout, GPUS)
    for p in range(100, 104):
        w.add_process(p, 4000 + p)
        w.add_memory(p, 0, "context", 300 * MiB)
    wfd = os.open(path, os.O_RDWR)
    rfd = os.open(path, os.O_RDONLY)
    memo = ParseMemo()
    try:
        assert snapshot_fd(rfd, str(path), memo=memo) == read_snapshot(path)
        for step in history:
            # The simulator refuses some steps on a file poked into nonsense: read it anyway.
            with contextlib.suppress(IndexError, KeyError, RuntimeError, ValueError):
                apply(w, layout, step, wfd)
            assert snapshot_fd(rfd, str(path), memo=memo) == read_snapshot(path), step
            # Twice: the second read is served from the memo where nothing changed.
            assert snapshot_fd(rfd, str(path), memo=memo) == read_snapshot(path), step
    finally:
        os.close(rfd)
        os.close(wfd)
        w.close()
