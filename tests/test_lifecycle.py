"""Billing through real container lifecycles is the exact integral of what the files say.

Each scenario drives cache files through the simulator's writer (HAMi-core's protocol), scans
them once per second on an injected clock, aggregates the events (window 60 s, lateness 10 s,
max_gap 90 s, heartbeat 30 s) and compares every (container, device, window) with the exact
integral (`tests/lifecycle.py`). The same events through `hami-usage aggregate` and `replay`
on a local log give the same figures, byte for byte between the two.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
from collections.abc import Callable
from pathlib import Path

import pytest
from lifecycle import (
    SECOND_NS,
    SETTINGS,
    SETTINGS_FLAGS,
    T0_MS,
    FakeClock,
    Lab,
    TruthKey,
    billed,
    gpu,
    nonzero,
    truncate,
    wave,
    zero_in_place,
)
from streams import hami, msg, read_csv, reference, write_local_log

from collector.aggregate.records import CSV_FIELDS, iso_utc
from collector.aggregate.windows import Aggregator
from collector.events import (
    ContainerAppeared,
    Heartbeat,
    Identity,
    LayoutAnomaly,
    ProcessExited,
    ProcessStarted,
)
from collector.node.identity import IdentityStage
from collector.node.pods import PodView
from collector.node.scan import Scanner
from collector.simulate import GiB, MiB

Script = Callable[[Lab, int], None]
SECONDS = 240
POD0 = f"{0:08d}-0000-4000-8000-000000000000"  # the pod UID of a lab's first container


def steady(lab: Lab, s: int, name: str, pids: list[int], devices: int = 2) -> None:
    """Every live process of `name` writes a new value on every device each second."""
    c = lab.ctrs[name]
    for p in pids:
        for d in range(devices):
            lab.set_data(c, p, d, wave(s, p + d))


# --- scenarios that were billed wrong -------------------------------------------------------


def restart_zeroed(lab: Lab, s: int) -> None:
    """The container restarts: its file is zeroed in place at 40; the new run's first CUDA
    call re-initialises it 3 s later, with a pid of the old run."""
    if s == 0:
        c = lab.container("main")
        lab.spawn(c, 1, 4001)
        lab.spawn(c, 2, 4002)
    c = lab.ctrs["main"]
    if s < 40:
        steady(lab, s, "main", [1, 2])
    elif s == 40:
        zero_in_place(c)
        lab.stop_run(c)
    elif s == 43:
        lab.init_file(c)
        lab.spawn(c, 1, 4101)
    if s >= 43:
        steady(lab, s, "main", [1])


def restart_truncated_late(lab: Lab, s: int) -> None:
    """The file is truncated to 0 at 40; the new run's first CUDA call comes 140 s later."""
    if s == 0:
        c = lab.container("main")
        lab.spawn(c, 1, 4001)
        lab.set_data(c, 1, 0, 3 * GiB)
    c = lab.ctrs["main"]
    if s == 40:
        lab.stop_run(c)
        truncate(c)
    elif s == 180:
        lab.init_file(c)
        lab.spawn(c, 1, 4101)
        lab.set_data(c, 1, 0, 2 * GiB)


def clock_back(step_s: float) -> Script:
    """NTP steps the wall clock back at 50; a process exits at 51 and the other one grows at
    52 and stays (so only a restatement would say it again)."""

    def script(lab: Lab, s: int) -> None:
        if s == 0:
            c = lab.container("main")
            lab.spawn(c, 1, 4001)
            lab.spawn(c, 2, 4002)
        c = lab.ctrs["main"]
        if s < 50:
            steady(lab, s, "main", [1, 2])
        if s == 50:
            lab.clock.step_wall(step_s)
        if s == 51:
            c.w.exit(2)
        if s == 52:
            lab.set_data(c, 1, 0, 6 * GiB)

    return script


def clock_back_then_restart(lab: Lab, s: int) -> None:
    """The wall clock steps back 60 s at 50; the collector restarts at 100 (its new wall clock
    is 60 s behind the last event it wrote)."""
    clock_back(-60)(lab, s)
    if s == 100:
        lab.restart_collector()


def late_device(lab: Lab, s: int) -> None:
    """HAMi-core registers device 1 lazily: usage on it from 10, the device in the table at 36."""
    if s == 0:
        c = lab.container("main")
        c.w._set_device_num(1)
        lab.spawn(c, 1, 4001)
    c = lab.ctrs["main"]
    lab.set_data(c, 1, 0, wave(s, 1))
    if s == 10:
        lab.set_data(c, 1, 1, 3 * GiB)
    if s == 36:
        c.w._set_device_num(2)


def garbage_between(first: int, last: int) -> Script:
    """The file is garbage (an unknown version) from `first` to `last`; the process is idle
    from `first - 1` on, so nothing changes when the file is readable again."""

    def script(lab: Lab, s: int) -> None:
        if s == 0:
            c = lab.container("main")
            lab.spawn(c, 1, 4001)
        c = lab.ctrs["main"]
        if s < first - 1:
            lab.set_data(c, 1, 0, 2 * GiB + wave(s, 1))
        if s == first - 1:
            lab.set_data(c, 1, 0, 3 * GiB)
        if s == first:
            c.w.region.major_version = 9
            c.garbage = True
        if s == last:
            c.w.region.major_version = 1
            c.garbage = False

    return script


# Longer than max_gap.
unreadable_spell = garbage_between(40, 160)
# Longer than the aggregator keeps the name of a container it hears nothing of (2 x max_gap
# from the last sample at 19); usable again between two heartbeats.
unreadable_past_retain = garbage_between(20, 215)


def host_pid_lag(replaced_at: int | None) -> Script:
    """With --host-proc: the container crashes at 30 (its process SIGKILLed, slot left); the
    restarted container's first process has the same container pid and takes the slot over at
    35, before HAMi-core has replaced the slot's host pid (at `replaced_at`, or never when its
    host-pid lookup times out). It allocates until 50, then holds its memory, idle."""

    def script(lab: Lab, s: int) -> None:
        if s == 0:
            c = lab.container("main")
            lab.spawn(c, 7, 4001)
        c = lab.ctrs["main"]
        if s < 30:
            steady(lab, s, "main", [7])
        if s == 30:
            lab.kill(c, 7)
        if s == 35:
            c.w.reuse_slot(7)
            c.dead.clear()
            assert lab.proc is not None
            (lab.proc / "4201").mkdir()  # the new process's real host pid
            c.w.add_memory(7, 0, "context", 200 * MiB)
        if 35 <= s < 50:
            steady(lab, s, "main", [7])
        if s == replaced_at:
            c.w.set_hostpid(7, 4201)

    return script


def garbled_count(lab: Lab, s: int) -> None:
    """Three live processes; a compaction left a stale copy of a SIGKILLed fourth beyond the
    end. proc_num reads -1 for one scan at 40, and 700 (in 0..1024: only the contents tell)
    for one scan at 60."""
    if s == 0:
        c = lab.container("main")
        for p in (1, 2, 3, 4):
            lab.spawn(c, p, 4000 + p)
    c = lab.ctrs["main"]
    if s == 20:
        lab.kill(c, 4)
        c.w.compact({4}, clear=False)  # a library that leaves the old last slot as it was
    if s in (41, 61):
        c.w.region.proc_num = c.real_count
        c.real_count = None
    steady(lab, s, "main", [1, 2, 3] if s >= 20 else [1, 2, 3, 4])
    if s in (40, 60):
        c.real_count = c.w.proc_num
        c.w.region.proc_num = -1 if s == 40 else 700


def compaction_preempted(step: str | None) -> Script:
    """pid 1 exits at 20 (an exit marker in slot 0, its counters left there); at 25 a later
    process compacts, moving pid 3 into slot 0: at once (`step` None), or preempted after
    `step` until 28, when it finishes (nobody allocates from 25 to 28 then)."""

    def script(lab: Lab, s: int) -> None:
        if s == 0:
            c = lab.container("main")
            for p in (1, 2, 3):
                lab.spawn(c, p, 4000 + p)
        c = lab.ctrs["main"]
        if s == 20:
            c.w.exit(1)
        if s == 25 and step is None:
            c.w.compact()
        elif s == 25:
            lab.compact_until(c, step)
        if s == 28 and step is not None:
            lab.finish_compaction(c)
        if step is None or not 25 <= s < 28:
            steady(lab, s, "main", [2, 3] if s >= 20 else [1, 2, 3])

    return script


def host_pid_reused(lab: Lab, s: int) -> None:
    """With --host-proc: pid 1 (2 GiB) is SIGKILLed at 10 and its slot stays (nothing compacts
    it); at 40 the host gives its host pid to an unrelated process."""
    if s == 0:
        c = lab.container("main", devices=1)
        lab.spawn(c, 1, 4001)
        lab.set_data(c, 1, 0, 2 * GiB)
    c = lab.ctrs["main"]
    if s == 10:
        lab.kill(c, 1)
    if s == 40:
        assert lab.proc is not None
        (lab.proc / "4001").mkdir()


def restarted_at(restart_at: int, script: Script) -> Script:
    """`script`, with the collector restarted at `restart_at`."""

    def restarted(lab: Lab, s: int) -> None:
        script(lab, s)
        if s == restart_at:
            lab.restart_collector()

    return restarted


# --- scenarios that were already billed exactly ---------------------------------------------


def pid_reuse(lab: Lab, s: int) -> None:
    """A process exits at 30; the next one, with the same container pid and a new host pid,
    takes the compacted slot at 31."""
    if s == 0:
        c = lab.container("main")
        lab.spawn(c, 5, 4005)
    c = lab.ctrs["main"]
    if s == 30:
        c.w.exit(5)
    elif s == 31:
        c.w.compact()
        lab.spawn(c, 5, 4105)
    if s != 30:
        steady(lab, s, "main", [5])


compaction = compaction_preempted(None)


def limits_and_uuid(lab: Lab, s: int) -> None:
    if s == 0:
        c = lab.container("main")
        lab.spawn(c, 1, 4001)
    c = lab.ctrs["main"]
    steady(lab, s, "main", [1])
    if s == 30:
        c.w.region.limit[0] = 9 * GiB
        c.w.region.sm_limit[1] = 20
    if s == 70:
        c.w.region.uuids[1].value = b"GPU-99999999-1111-4000-8000-000000000000"


def many_containers(lab: Lab, s: int) -> None:
    """60 containers coming and going: container i from second i, gone at 120 + i."""
    for i in range(60):
        name = f"c{i}"
        if s == i:
            c = lab.container(name, devices=1)
            lab.spawn(c, 1, 5000 + i)
        if s == 120 + i:
            lab.remove(lab.ctrs[name])
        if name in lab.ctrs:
            steady(lab, s + i, name, [1], devices=1)


def collector_restart(lab: Lab, s: int) -> None:
    if s == 0:
        c = lab.container("main")
        lab.spawn(c, 1, 4001)
        lab.spawn(c, 2, 4002)
    steady(lab, s, "main", [1, 2])
    if s == 60:
        lab.restart_collector()


def inode_change(lab: Lab, s: int) -> None:
    """The restarted container's file is a new one (same name, new inode) at 40."""
    if s == 0:
        c = lab.container("main")
        lab.spawn(c, 1, 4001)
    c = lab.ctrs["main"]
    if s == 40:
        lab.stop_run(c)
        assert c.path is not None
        c.path.unlink()
        lab.init_file(c)
        lab.spawn(c, 1, 4101)
    steady(lab, s, "main", [1])


def trailing_exit_marker(host_pid_at: int | None) -> Script:
    """A CUDA probe (pid 2) initialises the library after the trainer, is seen live without a
    host pid or memory, and exits at 3: its exit marker, all zero, is the last counted slot.
    The trainer frees to 1 GiB at 20 and exits at 30; nothing starts after it (a finished
    Job). The count is the one seen while the probe ran: both exits are read below it.
    `host_pid_at`: the trainer starts before HAMi-core knows its host pid (4001), filled in
    then. The count was taken for garbled, so (1, 4001) could not start on its word: the
    trainer went unbilled from then on, for as long as the marker stayed last."""

    def script(lab: Lab, s: int) -> None:
        if s == 0:
            c = lab.container("main", devices=1)
            c.w.add_process(1, 0 if host_pid_at else 4001)
            lab.set_data(c, 1, 0, 2 * GiB)
            c.w.add_process(2, 0)
        c = lab.ctrs["main"]
        if s == 3:
            c.w.exit(2)
        if s == host_pid_at:
            c.w.set_hostpid(1, 4001)
        if s == 20:
            lab.set_data(c, 1, 0, 1 * GiB)
        if s == 30:
            c.w.exit(1)

    return script


def two_exit_markers(probe_at: int | None) -> Script:
    """Trainer, probe, worker, probe; the first probe exits at 3, leaving a marker in slot 1,
    the second at 3 too (`probe_at` None) or it starts and exits between two scans at
    `probe_at` (a probe that lives under a second: its marker is last in a count never seen
    before, one slot above the count last read). The slots were cut at the first marker, so
    the worker's free at 10 and its exit at 20 were never read: billed at 1.5 GiB until a
    later start compacted the table (never, for a finished Job)."""

    def script(lab: Lab, s: int) -> None:
        if s == 0:
            c = lab.container("main", devices=1)
            lab.spawn(c, 1, 4001)
            lab.set_data(c, 1, 0, 2 * GiB)
            c.w.add_process(2, 0)
            lab.spawn(c, 3, 4003)
            lab.set_data(c, 3, 0, GiB + GiB // 2)
            if probe_at is None:
                c.w.add_process(4, 0)
        c = lab.ctrs["main"]
        if s == 3:
            c.w.exit(2)
            if probe_at is None:
                c.w.exit(4)
        if s == probe_at:
            c.w.add_process(4, 0)
            c.w.exit(4)
        if s == 10:
            lab.set_data(c, 3, 0, 1 * GiB)
        if s == 20:
            c.w.exit(3)

    return script


FIXED: dict[str, tuple[Script, bool]] = {  # name -> (script, with a host /proc)
    "restart_zeroed": (restart_zeroed, False),
    "restart_truncated_late": (restart_truncated_late, False),
    "clock_back_2s": (clock_back(-2), False),
    "clock_back_300s": (clock_back(-300), False),
    "clock_forward_60s": (clock_back(60), False),
    "late_device": (late_device, False),
    "unreadable_spell": (unreadable_spell, False),
    "unreadable_past_retain": (unreadable_past_retain, False),
    "host_pid_lag": (host_pid_lag(60), True),
    "host_pid_lookup_timeout": (host_pid_lag(None), True),
    "garbled_count": (garbled_count, False),
    "trailing_exit_marker": (trailing_exit_marker(None), False),
    "trailing_marker_host_pid": (trailing_exit_marker(10), False),
    "two_exit_markers": (two_exit_markers(None), False),
    "two_exit_markers_quick_probe": (two_exit_markers(5), False),
    # proc_num lowered, pid 3 not yet copied into the hole: only past the count
    "compaction_preempted_count": (compaction_preempted("count"), False),
    # pid 3's identity copied into the hole, used[] not yet: the exit marker's counters
    "compaction_preempted_identity": (compaction_preempted("identity"), False),
    # device 0 copied, device 1 still pid 1's
    "compaction_preempted_mid_copy": (compaction_preempted("used[0]"), False),
    "host_pid_reused": (host_pid_reused, True),
    # reused before the restart: the new incarnation takes the judgement from the last one
    "host_pid_reused_then_restart": (restarted_at(50, host_pid_reused), True),
    # the process that took the slot over is idle from 50: still billed after the restart
    "host_pid_lookup_timeout_then_restart": (restarted_at(70, host_pid_lag(None)), True),
}
PASSING: dict[str, tuple[Script, bool]] = {
    "pid_reuse": (pid_reuse, False),
    "compaction": (compaction, False),
    "limits_and_uuid": (limits_and_uuid, False),
    "many_containers": (many_containers, False),
    "collector_restart": (collector_restart, False),
    "inode_change": (inode_change, False),
}
SCENARIOS = {**FIXED, **PASSING}


def run(tmp_path: Path, name: str, reuse: bool = True) -> Lab:
    script, host_proc = SCENARIOS[name]
    lab = Lab(tmp_path, name, host_proc=host_proc, reuse=reuse)
    lab.run(SECONDS, script)
    return lab


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario_bills_the_exact_integral(tmp_path: Path, name: str) -> None:
    lab = run(tmp_path, name)
    records = reference([msg(lab.name, e) for e in lab.events], SETTINGS)
    truth = nonzero(lab.truth)
    assert truth
    assert billed(records, lab.name) == truth


def marker_last_from_the_start(lab: Lab, s: int) -> None:
    """The trainer (2 GiB), and a probe that exited before the collector first read the file:
    its exit marker is the last counted slot at the first scan. The trainer exits at 30."""
    if s == 0:
        c = lab.container("main", devices=1)
        lab.spawn(c, 1, 4001)
        lab.set_data(c, 1, 0, 2 * GiB)
        c.w.add_process(2, 0)
        c.w.exit(2)
    if s == 30:
        lab.ctrs["main"].w.exit(1)


@pytest.mark.parametrize(
    "script, missed_at, missed",
    [
        (marker_last_from_the_start, 0, 2 * GiB),
        (restarted_at(25, trailing_exit_marker(None)), 25, 1 * GiB),
    ],
    ids=["first-read", "collector-restarted"],
)
def test_a_count_read_twice_with_an_exit_marker_last_is_the_writers(
    tmp_path: Path, script: Script, missed_at: int, missed: int
) -> None:
    """A collector that first reads a file (it starts, restarts, or the container is new)
    while a probe's exit marker is the last counted slot took that count for garbled at every
    scan: no process started on its word, and the trainer was billed nothing for as long as
    the marker stayed last (all 60 GiB*s here; with a restart at 25, 5 of 50). The same
    count read again at the next scan is the writer's: only the first scan's second is
    missing, the trainer's memory for one second."""
    lab = Lab(tmp_path, "marker")
    lab.run(SECONDS, script)
    records = reference([msg(lab.name, e) for e in lab.events], SETTINGS)
    truth, got = nonzero(lab.truth), billed(records, lab.name)
    short = {k: truth[k] - got.get(k, 0) for k in truth if truth[k] != got.get(k, 0)}
    [(key, ms)] = short.items()
    assert (key[3], ms) == (T0_MS + missed_at // 60 * 60_000, missed * 1000)
    assert not got.keys() - truth.keys()


@pytest.mark.parametrize("name", ["two_exit_markers", "two_exit_markers_quick_probe"])
def test_exit_markers_bill_the_same_without_reuse(tmp_path: Path, name: str) -> None:
    """The count last read as the writer's is the scanner's, not the parse memo's: a scanner
    that keeps no memo (`reuse=False`) read these counts as garbled and billed the worker on."""
    lab = run(tmp_path, name, reuse=False)
    records = reference([msg(lab.name, e) for e in lab.events], SETTINGS)
    assert billed(records, lab.name) == nonzero(lab.truth)


# --- what the collector says along the way --------------------------------------------------


def test_clock_steps_are_reported_once_each_and_event_time_never_goes_back(
    tmp_path: Path,
) -> None:
    for name, step_ms in (("clock_back_300s", -300_000), ("clock_forward_60s", 60_000)):
        lab = run(tmp_path, name)
        steps = [
            e for e in lab.events if isinstance(e, LayoutAnomaly) and e.anomaly == "clock_step"
        ]
        assert [(e.cid, e.value, e.ts) for e in steps] == [(-1, step_ms, T0_MS + 50_000)]
        assert lab.scanner.stats.clock_steps == 1
        assert lab.scanner.stats.clock_offset_ms == step_ms
        ts = [e.ts for e in lab.events]
        assert ts == sorted(ts)
        beats = sorted({e.ts for e in lab.events if type(e).__name__ == "Heartbeat"})
        assert beats == [T0_MS + k * 30_000 for k in range(SECONDS // 30 + 1)]


def test_collector_started_is_seq_0_when_the_clock_steps_while_it_starts(tmp_path: Path) -> None:
    """A step between the scanner's making and its announcement (start-up opens NVML, the log
    and the metrics server in between) was stamped first: `clock_step` took seq 0, and
    `CollectorStarted` seq 1, against the README's "the first event (seq 0)"."""
    clock = FakeClock(T0_MS)
    scanner = Scanner(tmp_path, heartbeat_s=30, inc=1, clock=clock)
    clock.mono += 500_000_000
    clock.step_wall(-5)
    started, step = scanner.announce("h", "/log")
    assert (type(started).__name__, started.seq, started.ts) == ("CollectorStarted", 0, T0_MS + 500)
    assert isinstance(step, LayoutAnomaly)
    assert (step.anomaly, step.seq, step.ts, step.value) == ("clock_step", 1, T0_MS + 500, -5000)


def test_a_restart_after_a_backward_step_goes_on_after_the_last_event(tmp_path: Path) -> None:
    """The restarted collector's wall clock is 60 s behind the last event it wrote: the new
    incarnation starts just after that event instead, so the two never bill the same time.
    What it cannot know is how long it was away: the time from the last event (the heartbeat at
    90) to the restart (100) is not billed, at the values then in effect (constant since 52)."""
    lab = Lab(tmp_path, "clock_back_then_restart")
    lab.run(SECONDS, clock_back_then_restart)
    old = [e for e in lab.events if e.inc == 1000]
    new = [e for e in lab.events if e.inc == 1001]
    assert old[-1].ts == T0_MS + 90_000 and new[0].ts == T0_MS + 90_001
    assert lab.scanner.clock.offset_ms == -50_001  # the wall clock behind event time
    records = reference([msg(lab.name, e) for e in lab.events], SETTINGS)
    got, truth = billed(records, lab.name), nonzero(lab.truth)
    assert got.keys() == truth.keys()
    last_window = max(k[3] for k in truth)
    c = lab.events[0]
    assert isinstance(c, ContainerAppeared)
    held = {d.uuid: 0 for d in c.devices}
    for k, v in truth.items():  # what each device holds at the end: 1/60 of the last window
        if k[3] == last_window:
            held[k[2]] = v // 60
    lost = 100_000 - 90_001
    for k, v in truth.items():
        want = v - held[k[2]] * lost // 1000 if k[3] == last_window else v
        assert got[k] == want, k


def test_a_file_back_to_uninitialised_ends_its_processes_at_that_scan(tmp_path: Path) -> None:
    lab = run(tmp_path, "restart_zeroed")
    exits = [(e.pid, e.hostpid, e.ts) for e in lab.events if isinstance(e, ProcessExited)]
    starts = [(e.pid, e.hostpid, e.ts) for e in lab.events if isinstance(e, ProcessStarted)]
    at = T0_MS + 40_000
    assert exits[:2] == [(1, 4001, at), (2, 4002, at)]
    assert (1, 4101, T0_MS + 43_000) in starts


def test_a_slot_whose_counters_move_is_live_whatever_its_host_pid(tmp_path: Path) -> None:
    lab = run(tmp_path, "host_pid_lookup_timeout")
    stale = [
        (e.value, e.ts)
        for e in lab.events
        if isinstance(e, LayoutAnomaly) and e.anomaly == "stale_process"
    ]
    assert stale == [(4001, T0_MS + 30_000)]  # the killed process, once; not its successor
    starts = [(e.pid, e.hostpid, e.ts) for e in lab.events if isinstance(e, ProcessStarted)]
    assert starts == [(7, 4001, T0_MS), (7, 4001, T0_MS + 35_000)]


@pytest.mark.parametrize("step", ["count", "identity", "mid_copy"])
def test_a_compaction_caught_midway_keeps_the_moved_process_as_it_is(
    tmp_path: Path, step: str
) -> None:
    """Scanned three times while pid 3 is being moved into slot 0: it neither exits (and starts
    again) nor picks up the counters pid 1 left there, and nothing is reported."""
    lab = run(tmp_path, f"compaction_preempted_{step}")
    lives = [
        (type(e).__name__, e.pid, e.ts - T0_MS)
        for e in lab.events
        if isinstance(e, (ProcessStarted, ProcessExited))
    ]
    assert lives == [
        ("ProcessStarted", 1, 0), ("ProcessStarted", 2, 0), ("ProcessStarted", 3, 0),
        ("ProcessExited", 1, 20_000),
    ]  # fmt: skip
    assert [e.anomaly for e in lab.events if isinstance(e, LayoutAnomaly)] == []
    records = reference([msg(lab.name, e) for e in lab.events], SETTINGS)
    got = billed(records, lab.name)
    # The first window by hand, per device d (pid p writes wave(s, p + d) each second it is
    # not idle): pids 1-3 until 20; pids 2 and 3 after; from 25 to 28, while the compaction
    # is stopped, what they wrote at 24.
    for d in (0, 1):
        want = 0
        for s in range(60):
            at = 24 if 25 <= s < 28 else s
            want += sum(wave(at, p + d) for p in ([1, 2, 3] if s < 20 else [2, 3]))
        assert got[(POD0, "main", gpu(d), T0_MS)] == want * 1000
    assert got == nonzero(lab.truth)


def test_a_dead_slot_stays_dead_when_the_host_reuses_its_host_pid(tmp_path: Path) -> None:
    """The killed process's 2 GiB are billed for the 10 s it lived, not again from 40 on when
    an unrelated process gets host pid 4001 (its counters never move again)."""
    lab = run(tmp_path, "host_pid_reused")
    records = reference([msg(lab.name, e) for e in lab.events], SETTINGS)
    assert sum(billed(records, lab.name).values()) == 2 * GiB * 10 * 1000  # 20 GiB*s
    starts = [(e.pid, e.hostpid, e.ts) for e in lab.events if isinstance(e, ProcessStarted)]
    assert starts == [(1, 4001, T0_MS)]
    stale = [
        (e.value, e.ts)
        for e in lab.events
        if isinstance(e, LayoutAnomaly) and e.anomaly == "stale_process"
    ]
    assert stale == [(4001, T0_MS + 10_000)]


@pytest.mark.parametrize("deleted", [False, True])
def test_a_spell_longer_than_the_name_is_kept_is_billed_again_from_the_scan_after(
    tmp_path: Path, deleted: bool
) -> None:
    """Unusable from 40 to 391: heartbeats leave the container out, and the aggregator forgets
    its name (2 x max_gap after its last event, the heartbeat at 30) and its pod's identity.
    The scan that reads the file again announces the container again and restates its pod's
    identity, so its usage and limits are billed from 391 under its pod's name, not only from
    the next heartbeat at 420. `deleted`: the pod is deleted at 100 (its identity is kept while
    its container is tracked) and the container is gone at 400, before any heartbeat."""
    lab = Lab(tmp_path, "spell")
    pod = f"{0:08d}-0000-4000-8000-000000000000"
    who = Identity(pod, "ml", "trainer-0", "Deployment", "trainer", {})
    view: dict[str, PodView] = {pod: PodView(who, ("main",), None, None)}
    lab.scanner.identity = IdentityStage(lambda: view)

    def script(lab: Lab, s: int) -> None:
        if s == 0:
            c = lab.container("main", devices=1)
            lab.spawn(c, 1, 4001)
            lab.set_data(c, 1, 0, 2 * GiB)
        if "main" not in lab.ctrs:
            return
        c = lab.ctrs["main"]
        if s == 40:
            c.w.region.major_version = 9
        if s == 100 and deleted:
            view.clear()
        if s == 391:
            c.w.region.major_version = 1
        if s == 400 and deleted:
            lab.remove(c)

    lab.run(460, script)
    agg = Aggregator(SETTINGS)
    for i, e in enumerate(lab.events):
        agg.add(lab.name, e, offset=i)
    records = [r for r in agg.flush() if r.kind == "container" and r.pod_uid]
    got = {
        (r.window_start_ms - T0_MS) // 1000: (
            r.memory_byte_seconds / GiB,
            r.memory_limit_byte_seconds / GiB,
            r.namespace,
            r.pod,
        )
        for r in records
    }
    # The last sample (the heartbeat at 30) holds until max_gap after it (120); the presence too.
    named = ("ml", "trainer-0")
    want = {0: (120, 4 * 60, *named), 60: (120, 4 * 60, *named)}
    if deleted:
        want[360] = (2 * 9, 4 * 9, *named)
    else:
        want[360] = (2 * 29, 4 * 29, *named)
        want[420] = (2 * 40, 4 * 40, *named)
    assert got == want
    assert agg.stats.unattributed_rows == 0
    at = T0_MS + 391_000
    assert [type(e).__name__ for e in lab.events if e.ts == at] == [
        "ContainerAppeared", "UsageSample", "PodIdentity",
    ]  # fmt: skip


# --- the same through the services ----------------------------------------------------------


def test_live_service_and_replay_bill_every_scenario_exactly(tmp_path: Path) -> None:
    """All scenarios as nodes of one local log, in event-time order: `aggregate --drain` and
    `replay` over the whole range give the exact integral of each, and the same lines."""
    labs = [run(tmp_path / "labs", name) for name in SCENARIOS]
    msgs = sorted(
        (msg(lab.name, e) for lab in labs for e in lab.events),
        key=lambda m: m.ts,  # stable: each node's events stay in their order
    )
    log = tmp_path / "log"
    write_local_log(log, msgs)
    live_csv = tmp_path / "live.csv"
    proc = hami("aggregate", "--log", log, *SETTINGS_FLAGS, "--csv", live_csv, "--drain")
    assert proc.returncode == 0, proc.stderr
    end = T0_MS + (SECONDS // 60 + 2) * 60_000
    replay_csv = tmp_path / "replay.csv"
    proc = hami(
        "replay", "--log", log, *SETTINGS_FLAGS, "--csv", replay_csv,
        "--from", iso_utc(T0_MS), "--to", iso_utc(end),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    live = read_csv(live_csv)
    assert read_csv(replay_csv) == live
    got: dict[str, dict[TruthKey, int]] = {lab.name: {} for lab in labs}
    for row in csv.DictReader(io.StringIO("".join([",".join(CSV_FIELDS) + "\n", *live]))):
        if not row["pod_uid"]:
            continue
        start_ms = iso_ms(row["window_start"])
        key = (row["pod_uid"], row["container"], row["device_uuid"], start_ms)
        mem = round(float(row["memory_byte_seconds"]) * 1000)
        if mem:
            got[row["node"]][key] = got[row["node"]].get(key, 0) + mem
    for lab in labs:
        assert got[lab.name] == nonzero(lab.truth), lab.name


def iso_ms(text: str) -> int:
    return int(dt.datetime.fromisoformat(text).timestamp() * 1000)


@pytest.mark.parametrize("jitter", [0.0, 0.1])
@pytest.mark.parametrize(
    "interval_s, spacing_ms", [(1.0, 30_000), (20.0, 40_000), (120.0, 120_000), (0.3, 30_000)]
)
def test_heartbeats_state_the_spacing_the_scans_give_them(
    tmp_path: Path, interval_s: float, spacing_ms: int, jitter: float
) -> None:
    """A heartbeat goes out on the first scan at least 30 s after the last: scans 20 s apart
    send one every 40 s, 120 s apart every 120 s. Each said 30 000 ms, so the aggregator's
    warning for a heartbeat spacing above `max_gap` (values lapse between them) stayed silent.
    Scans off their time by up to a tenth of the interval (`jitter`) keep the spacing within
    that: a heartbeat due at least 30 s after one taken late slipped a whole scan."""
    clock = FakeClock(T0_MS)
    scanner = Scanner(tmp_path, heartbeat_s=30, scan_interval_s=interval_s, inc=1, clock=clock)
    start = clock.mono
    beats: list[tuple[int, int]] = []
    for k in range(round(600 / interval_s)):
        off = jitter * interval_s * (-1 if k % 3 == 1 else 1 if k % 3 == 2 else 0)
        clock.mono = start + round((k * interval_s + off) * SECOND_NS)
        beats += [(e.ts, e.interval_ms) for e in scanner.scan() if isinstance(e, Heartbeat)]
    assert len(beats) >= 5
    gaps = [b - a for (a, _), (b, _) in zip(beats, beats[1:], strict=False)]
    slack = 2 * jitter * interval_s * 1000
    assert all(abs(gap - spacing_ms) <= slack for gap in gaps), gaps
    assert {said for _, said in beats} == {spacing_ms}
