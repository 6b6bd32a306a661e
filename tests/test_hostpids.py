"""The `host_proc` judgements kept across restarts (collector/node/hostpids.py): what a new
incarnation starts a file from, and a file that cannot be read or written."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collector.events import UsageRow
from collector.node.diff import FileState
from collector.node.hostpids import FILE_NAME, HostPidMemory

KEY = ("/root/pod_main/0.cache", 64769, 1234)

proc_keys = st.tuples(st.integers(0, 2**31 - 1), st.integers(-1, 2**31 - 1))
counters = st.integers(0, 2**48)


@st.composite
def judged(draw: st.DrawFn) -> FileState:
    state = FileState(3, "pod", "main", KEY[0])
    for pid, hostpid in draw(st.lists(proc_keys, max_size=6, unique=True)):
        rows = [UsageRow(pid, hostpid, d, *draw(st.tuples(*[counters] * 6))) for d in range(2)]
        state.dead_rows[(pid, hostpid)] = rows
    keys = sorted(state.dead_rows)
    state.dead = set(draw(st.lists(st.sampled_from(keys), unique=True))) if keys else set()
    rest = [k for k in keys if k not in state.dead]
    state.vouched = set(draw(st.lists(st.sampled_from(rest), unique=True))) if rest else set()
    state.moving = set(draw(st.lists(st.sampled_from(keys), unique=True))) if keys else set()
    return state


@settings(max_examples=60, deadline=None)
@given(before=judged())
def test_a_new_incarnation_starts_a_file_from_what_the_last_one_judged(
    tmp_path_factory: pytest.TempPathFactory, before: FileState
) -> None:
    folder = tmp_path_factory.mktemp("log")
    HostPidMemory(folder).save(
        {KEY: before, ("/root/other/0.cache", 1, 2): FileState(4, "", "", "")}
    )
    again = FileState(9, "pod", "main", KEY[0])
    memory = HostPidMemory(folder)
    memory.seed(KEY, again)
    # A vouched-for slot's rows are its last read, not kept (they are never compared).
    rows = {k: [] if k in before.vouched else r for k, r in before.dead_rows.items()}
    assert (again.dead_rows, again.dead, again.vouched, again.moving) == (
        rows, before.dead, before.vouched, before.moving,
    )  # fmt: skip
    other = FileState(9, "pod", "main", KEY[0])
    memory.seed(KEY, other)  # only the first file found under the key (not a later one)
    memory.seed((KEY[0], KEY[1], KEY[2] + 1), other)  # another inode: judged afresh
    assert (other.dead_rows, other.dead, other.vouched) == ({}, set(), set())


@pytest.mark.parametrize("bad", ["undecodable", "a directory"])
def test_a_file_that_cannot_be_used_starts_every_file_afresh_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, bad: str
) -> None:
    if bad == "undecodable":
        (tmp_path / FILE_NAME).write_bytes(b'[{"path": "x", "dev": 1}]')
        why = "Object missing required"
    else:
        (tmp_path / FILE_NAME).mkdir()  # (it raised: the collector did not start)
        why = "[Errno 21] Is a directory"
    state = FileState(1, "pod", "main", KEY[0])
    with caplog.at_level(logging.WARNING, "collector.node.hostpids"):
        HostPidMemory(tmp_path).seed(KEY, state)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"{tmp_path / FILE_NAME} cannot be used ({why}")
    assert line.endswith("every slot is judged afresh")
    assert state.dead_rows == {} and state.dead == set()


def test_a_busy_vouched_for_slot_does_not_rewrite_the_file(tmp_path: Path) -> None:
    """Its rows move at every scan; its judgement does not (it was written once a second)."""
    memory = HostPidMemory(tmp_path)
    state = FileState(1, "pod", "main", KEY[0])
    state.vouched = {(7, 4001)}
    for total in range(5):
        state.dead_rows = {(7, 4001): [UsageRow(7, 4001, 0, total, 1, 1, total, 0, 50)]}
        memory.save({KEY: state})
        if total == 0:
            first = (tmp_path / FILE_NAME).stat().st_mtime_ns, (tmp_path / FILE_NAME).stat().st_ino
    after = (tmp_path / FILE_NAME).stat().st_mtime_ns, (tmp_path / FILE_NAME).stat().st_ino
    assert after == first


def test_a_file_that_cannot_be_written_is_one_warning_until_it_can(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "log"
    memory = HostPidMemory(folder)  # (the folder does not exist yet)
    state = FileState(1, "pod", "main", KEY[0])
    state.dead_rows = {(1, 4001): [UsageRow(1, 4001, 0, 5, 1, 1, 3, 0, 0)]}
    state.dead = {(1, 4001)}
    with caplog.at_level(logging.INFO, "collector.node.hostpids"):
        memory.save({KEY: state})
        memory.save({KEY: state})
        folder.mkdir()
        memory.save({KEY: state})
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", f"cannot write {folder / FILE_NAME} (No such file or directory): "
                    "a restart would judge every slot afresh"),
        ("INFO", f"{folder / FILE_NAME} written again"),
    ]  # fmt: skip
    again = FileState(2, "pod", "main", KEY[0])
    HostPidMemory(folder).seed(KEY, again)
    assert again.dead == {(1, 4001)} and again.dead_rows == state.dead_rows
    assert sorted(p.name for p in folder.iterdir()) == [FILE_NAME]
