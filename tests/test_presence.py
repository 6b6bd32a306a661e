"""Presence from the pod watch, scan by scan (collector/node/presence.py and runs.py): the real
Scanner over real cache files with the pod watch's view, and the Aggregator over what it sends.

A Job's container terminates at +8 s while its folder stays; it restarts (seen by the watch),
restarts again unseen (only `lastState` tells), and ends at +32 s. Its limit is billed exactly
inside its running intervals as Kubernetes stamped them, `stale_container` is reported once per
termination, a pod deleted while its process runs is still billed and one deleted with only its
folder left stops at the DELETED event's time; windows closed as events come, and a restart of
the aggregator at any point, give the same records. End to end through the collector subprocess
and the API server stand-in: `test_presence_k8s.py`.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from test_windows import Collector, dev, row

from collector.aggregate.records import BillingRecord
from collector.aggregate.windows import Aggregator, WindowSettings
from collector.events import (
    ContainerAppeared,
    ContainerGone,
    ContainerRun,
    Event,
    Heartbeat,
    Identity,
    LayoutAnomaly,
    UsageSample,
)
from collector.layout.declarations import V12
from collector.node.identity import IdentityStage
from collector.node.pods import PodView, Run
from collector.node.presence import PresenceStage
from collector.node.scan import Scanner
from collector.simulate import CacheWriter, GiB, MiB, SimDevice, new_cache_file

JOB = "0b8e6a43-2f7e-4a6c-9d1e-6f5e1c0a9b11"
DEP = "7c1d2e3f-4a5b-4c6d-8e9f-0a1b2c3d4e5f"
LOST = "5a6b7c8d-9e0f-4a1b-8c2d-3e4f5a6b7c8d"
T0 = 1_795_991_820_000  # 2026-11-29T22:37:00Z, a whole minute


def iso(second: int) -> str:
    return f"2026-11-29T22:37:{second:02d}Z"


def job(state: str, started: int = 0, finished: int | None = None, last: int | None = None,
        restarts: int = 0, phase: str = "Running") -> PodView:  # fmt: skip
    run = Run("main", state, iso(started), "" if finished is None else iso(finished),
              "" if last is None else iso(last), restarts)  # fmt: skip
    return PodView(Identity(JOB, "ml", "eval-29412360-q9w8e", "CronJob", "eval", {}), ("main",),
                   None, None, phase=phase, runs=(run,))  # fmt: skip


def other(uid: str, name: str, deleted_at: float | None = None) -> PodView:
    return PodView(Identity(uid, "ml", name, "Deployment", name, {}), ("main",), None, None,
                   deleted=deleted_at is not None, deleted_at=deleted_at or 0.0,
                   runs=(Run("main", "running", iso(0)),))  # fmt: skip


def scenario(tmp_path: Path) -> tuple[list[Event], PresenceStage]:
    """The Job's container runs [0, 8), is restarted (seen running again at +12, started at
    +11), restarts once more between two reads of the watch (only `lastState` tells that it
    ended at +19 and ran again from +20), and ends for good at +32. The trainer's pod is deleted
    at +39.5 while its process runs: billed on. The lost pod (no process, its folder stays) is
    deleted at +39.5 too: billed until then."""
    root = tmp_path / "root"
    writers = [
        new_cache_file(root, JOB, "main", V12, [SimDevice("GPU-a", 4 * GiB, 50)]),
        new_cache_file(root, DEP, "main", V12, [SimDevice("GPU-b", 1 * GiB, 100)]),
        new_cache_file(root, LOST, "main", V12, [SimDevice("GPU-c", 2 * GiB, 100)]),
    ]
    writers[1].add_process(100, 0)
    second = 0.0
    views = {
        # second -> the job's view from then on
        0: job("running"),
        9: job("terminated", 0, 8),  # terminated at +8 s, seen at the +9 s scan
        12: job("running", 11, last=8, restarts=1),  # restarted: running again
        21: job("running", 20, last=19, restarts=2),  # a whole restart missed by the watch
        33: job("terminated", 20, 32, last=19, restarts=2, phase="Failed"),
    }
    current: dict[str, PodView] = {}
    presence = PresenceStage(lambda: current, monotonic=lambda: second)
    scanner = Scanner(root, heartbeat_s=10, inc=1, identity=IdentityStage(lambda: current),
                      presence=presence)  # fmt: skip
    events: list[Event] = []
    for s in range(0, 60):
        second = float(s)
        deleted = 39.5 if s >= 40 else None
        current = {
            JOB: views.get(s, current.get(JOB, views[0])),
            DEP: other(DEP, "trainer-x", deleted),
            LOST: other(LOST, "lost-y", deleted),
        }
        events += scanner.scan(now_ms=T0 + s * 1000)
    for w in writers:
        w.close()
    return events, presence


def test_limits_are_billed_only_while_the_container_runs(tmp_path: Path) -> None:
    events, presence = scenario(tmp_path)
    stale = [e for e in events if isinstance(e, LayoutAnomaly) and e.anomaly == "stale_container"]
    assert [(e.ts - T0, e.value, e.detail) for e in stale] == [
        (9_000, 1, "container main of pod ml/eval-29412360-q9w8e terminated at "
                   "2026-11-29T22:37:08Z, 1 s ago; its folder is still there: not billed"),
        (33_000, 1, "container main of pod ml/eval-29412360-q9w8e terminated at "
                    "2026-11-29T22:37:32Z, 1 s ago; its folder is still there: not billed"),
    ]  # fmt: skip
    assert presence.stale == 1
    cids = {e.cid: (e.pod_uid, e.ts - T0) for e in events if isinstance(e, ContainerAppeared)}
    job_cids = sorted(c for c, (uid, _) in cids.items() if uid == JOB)
    assert [cids[c][1] for c in job_cids] == [0, 12_000]  # the first run, the seen restart
    runs = [(e.cid, e.running, e.at - T0, e.reason, e.ts - T0)
            for e in events if isinstance(e, ContainerRun)]  # fmt: skip
    first, second_run = job_cids
    by_pod = {uid: c for c, (uid, _) in cids.items()}
    dep, lost = by_pod[DEP], by_pod[LOST]
    assert sorted(runs[:3]) == sorted([(c, True, 0, "started", 0) for c in (first, dep, lost)])
    assert runs[3:] == [
        (first, False, 8_000, "finished", 9_000),
        (second_run, True, 11_000, "started", 12_000),
        (second_run, False, 19_000, "restart_missed", 21_000),
        (second_run, True, 20_000, "started", 21_000),
        (second_run, False, 32_000, "finished", 33_000),
        (lost, False, 39_500, "deleted", 40_000),
    ]  # fmt: skip
    gone = sorted(e.ts - T0 for e in events if isinstance(e, ContainerGone) and e.cid in job_cids)
    assert gone == [9_000, 33_000]
    hb = [e for e in events if isinstance(e, Heartbeat) and e.ts - T0 == 50_000]
    assert {c.cid: c.running for c in hb[0].containers} == {dep: True, lost: False}

    # Billed: the job's 4 GiB limit for its three runs, [0, 8), [12, 19) and [20, 32): 27 s
    # (the second run from when its folder was tracked again); the trainer's whole minute, its
    # pod's deletion notwithstanding; the lost pod's until its deletion.
    agg = Aggregator(WindowSettings())
    for i, e in enumerate(events):
        agg.add("n1", e, offset=i)
    # The OTLP gauges: a limit only for what runs, from events still pending too.
    assert {g.pod_uid: g.memory_limit_bytes for g in agg.gauges()} == {DEP: GiB}
    records = agg.flush()
    assert agg.gauges() == []  # (every value ran to its cap)
    limit = {r.pod_uid: r.memory_limit_byte_seconds for r in records if r.window_start_ms == T0}
    assert limit == {JOB: 4 * GiB * 27, DEP: 1 * GiB * 60, LOST: Decimal(2 * GiB * 39.5), "": 0}
    alloc = {r.pod_uid: r.allocated_gpu_seconds for r in records
             if r.window_start_ms == T0 and r.kind == "container"}  # fmt: skip
    assert alloc == {JOB: Decimal("13.5"), DEP: 60, LOST: Decimal("39.5")}  # 50 % SM for 27 s
    assert agg.stats.presence_clamped == 0
    named = {r.pod_uid: r.pod for r in records if r.window_start_ms == T0 and r.pod_uid}
    assert named == {JOB: "eval-29412360-q9w8e", DEP: "trainer-x", LOST: "lost-y"}

    # Closing windows as the events come gives the same records (replay, a live run).
    step = Aggregator(WindowSettings())
    out = []
    for i, e in enumerate(events):
        step.add("n1", e, offset=i)
        out += step.advance()
    # The OTLP gauges: a limit only for what runs, from events still pending too.
    assert {g.pod_uid: g.memory_limit_bytes for g in step.gauges()} == {DEP: GiB}
    assert out + step.flush() == records


def one_container_sampled() -> Aggregator:
    """An aggregator that read one container's appearance (limit 1000) and one sample (100)."""
    c = Collector()
    agg = Aggregator(WindowSettings())
    events = [c.appeared(T0, devices=[dev(0)]), c.sample(T0 + 1_000, row(1, 100))]
    for i, e in enumerate(events):
        agg.add("n1", e, offset=i, record_ts_ms=e.ts)
    assert [(g.memory_limit_bytes, g.memory_used_bytes) for g in agg.gauges()] == [(1000, 100)]
    return agg


def test_the_gauges_of_a_node_that_falls_silent_stop_once_its_values_lapse() -> None:
    """Presence in the gauges was judged against the source's newest event, which a source
    whose only node stopped sending never moves: its containers' gauges, their limits among
    them, stayed at their last values for good, while the records billed them no more. The
    record time the source's silence has come to (`Aggregator.idle`) moves it on."""
    agg = one_container_sampled()
    agg.idle(T0 + 1_000 + WindowSettings().max_gap_ms - 1)
    assert [(g.memory_limit_bytes, g.memory_used_bytes) for g in agg.gauges()] == [(1000, 100)]
    agg.idle(T0 + 1_000 + WindowSettings().max_gap_ms)
    assert agg.gauges() == []


def test_after_a_drain_no_gauge_is_left_with_its_limit_and_no_usage() -> None:
    """`flush` (a drain's end) runs every value to its cap: the gauges were still judged as of
    the newest event, so the usage was gone (0) and the limits still reported, in the drain's
    last push; they are judged as of the flush now, as the records are."""
    agg = one_container_sampled()
    assert agg.flush()
    assert agg.gauges() == []


def limits_billed(events: list[Event]) -> dict[str, Decimal]:
    """Per pod, the memory-limit byte-seconds its container records bill."""
    agg = Aggregator(WindowSettings())
    for i, e in enumerate(events):
        agg.add("n1", e, offset=i)
    return {r.pod_uid: r.memory_limit_byte_seconds for r in agg.flush() if r.kind == "container"}


def forgotten_at_30(second: int) -> dict[str, PodView]:
    """The watch's view: the Job runs, ends at +8 (seen at +9), and is gone from +30."""
    if second < 9:
        return {JOB: job("running")}
    if second < 30:
        return {JOB: job("terminated", 0, 8, phase="Succeeded")}
    return {}


def test_a_finished_folder_stays_unbilled_once_its_pod_is_forgotten(tmp_path: Path) -> None:
    """The Job's container ends at +8; from +30 the watch no longer has its pod (deleted, then
    forgotten after `keep_deleted_s`). Its folder is still there: never tracked again, so its
    limit is billed for the 8 s it ran, not again from +30."""
    w = new_cache_file(tmp_path / "root", JOB, "main", V12, [SimDevice("GPU-a", 4 * GiB, 50)])
    current: dict[str, PodView] = {}
    presence = PresenceStage(lambda: current)
    scanner = Scanner(tmp_path / "root", heartbeat_s=10, inc=1,
                      identity=IdentityStage(lambda: current), presence=presence)  # fmt: skip
    events: list[Event] = []
    for s in range(60):
        current = forgotten_at_30(s)
        events += scanner.scan(now_ms=T0 + s * 1000)
    w.close()
    assert [e.ts - T0 for e in events if isinstance(e, ContainerAppeared)] == [0]
    assert [e.ts - T0 for e in events if isinstance(e, ContainerGone)] == [9_000]
    assert presence.stale == 1
    limit = limits_billed(events)
    assert limit == {JOB: 4 * GiB * 8}


@pytest.mark.parametrize("unlisted", ["root", "folder"])
def test_a_failed_listing_leaves_a_finished_folder_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, unlisted: str
) -> None:
    """As above, and the scans at +20 (the pod still in the watch) and +40 (forgotten) cannot
    list the root, or the Job's folder (EIO): what it holds is unknown then, not gone. The
    folder stays stale through both: `stale_container` once, never tracked again, its limit
    billed for the 8 s it ran."""
    root = tmp_path / "root"
    w = new_cache_file(root, JOB, "main", V12, [SimDevice("GPU-a", 4 * GiB, 50)])
    current: dict[str, PodView] = {}
    presence = PresenceStage(lambda: current)
    scanner = Scanner(root, heartbeat_s=10, inc=1, presence=presence)
    discovery = scanner.discovery
    real_scandir, real_open_dir = os.scandir, discovery._open_dir

    def scandir(path: Any) -> Any:
        if path == discovery._root_fd:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_scandir(path)

    def open_dir(name: str) -> int:
        if name == w.path.parent.name:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_open_dir(name)

    events: list[Event] = []
    stale: list[int] = []
    for s in range(60):
        current = forgotten_at_30(s)
        with monkeypatch.context() as m:
            if s in (20, 40) and unlisted == "root":
                m.setattr(os, "scandir", scandir)
            elif s in (20, 40):
                m.setattr(discovery, "_open_dir", open_dir)
                os.utime(w.path.parent)  # its mtime moved: listed again
            events += scanner.scan(now_ms=T0 + s * 1000)
        stale.append(presence.stale)
    w.close()
    failed = [(e.ts - T0, e.path) for e in events
              if isinstance(e, LayoutAnomaly) and e.anomaly == "skipped_path"]  # fmt: skip
    where = str(root) if unlisted == "root" else str(w.path.parent)
    assert failed == [(20_000, where), (40_000, where)]
    reported = [e.ts - T0 for e in events
                if isinstance(e, LayoutAnomaly) and e.anomaly == "stale_container"]  # fmt: skip
    assert reported == [9_000]
    assert [e.ts - T0 for e in events if isinstance(e, ContainerAppeared)] == [0]
    assert [e.ts - T0 for e in events if isinstance(e, ContainerGone)] == [9_000]
    assert stale == [0] * 9 + [1] * 51
    assert limits_billed(events) == {JOB: 4 * GiB * 8}


def test_a_stale_folder_keeps_no_descriptor_open(tmp_path: Path) -> None:
    """Six containers run; five end at +8 and their folders stay: only the running one's folder
    and file are kept open from then on. One of the five is restarted at +20: its folder and
    file are opened and read again."""
    root = tmp_path / "root"
    uids = [f"{i:08d}-0000-4000-8000-000000000000" for i in range(6)]
    writers = [new_cache_file(root, uid, "main", V12, [SimDevice("GPU-a", GiB, 10)])
               for uid in uids]  # fmt: skip

    def view(uid: str, run: Run, phase: str = "Running") -> PodView:
        return PodView(Identity(uid, "ml", uid[:8], "Job", uid[:8], {}), ("main",), None, None,
                       phase=phase, runs=(run,))  # fmt: skip

    running = Run("main", "running", iso(0))
    ended = Run("main", "terminated", iso(0), iso(8))
    restarted = Run("main", "running", iso(19), last_finished=iso(8), restarts=1)
    current: dict[str, PodView] = {}
    scanner = Scanner(root, heartbeat_s=3600, inc=1, presence=PresenceStage(lambda: current))
    kept: list[int] = []
    events: list[Event] = []
    for s in range(30):
        current = {uid: view(uid, running) for uid in uids}
        if s >= 9:
            current |= {uid: view(uid, ended, "Succeeded") for uid in uids[1:]}
        if s >= 20:
            current[uids[1]] = view(uids[1], restarted)
        if s == 25:
            writers[1].add_process(1, 4001)
            writers[1].add_memory(1, 0, "data", MiB)
        events += scanner.scan(now_ms=T0 + s * 1000)
        kept.append(scanner.discovery.open_count)
    for w in writers:
        w.close()
    assert kept == [12] * 9 + [2] * 11 + [4] * 10  # two per container tracked
    appeared = [(e.ts - T0, e.pod_uid) for e in events if isinstance(e, ContainerAppeared)]
    assert appeared == [(0, uid) for uid in uids] + [(20_000, uids[1])]
    samples = [(e.ts - T0, e.cid, e.rows[0].data) for e in events if isinstance(e, UsageSample)]
    assert samples == [(25_000, 6, MiB)]


def scan_job(tmp_path: Path, seconds: int, view: Callable[[int], PodView]) -> list[Event]:
    """The Job's cache file scanned once a second, the watch's view of it `view(second)`."""
    w = new_cache_file(tmp_path / "root", JOB, "main", V12, [SimDevice("GPU-a", 4 * GiB, 50)])
    current: dict[str, PodView] = {}
    scanner = Scanner(tmp_path / "root", heartbeat_s=10, inc=1,
                      presence=PresenceStage(lambda: current))  # fmt: skip
    events: list[Event] = []
    for s in range(seconds):
        current = {JOB: view(s)}
        events += scanner.scan(now_ms=T0 + s * 1000)
    w.close()
    return events


def test_a_missed_restart_that_ends_terminated_bills_each_run(tmp_path: Path) -> None:
    """The watch knew the run from 0; when it reads again (+16) the container had ended at +10
    (`lastState`), run again from +12, and ended for good at +15: the two runs are billed,
    [0, 10) and [12, 15), not the gap between them."""
    done = job("terminated", 12, 15, last=10, restarts=1, phase="Succeeded")
    events = scan_job(tmp_path, 30, lambda s: job("running") if s < 16 else done)
    runs = [(e.running, e.at - T0, e.reason) for e in events if isinstance(e, ContainerRun)]
    assert runs == [
        (True, 0, "started"),
        (False, 10_000, "restart_missed"),
        (True, 12_000, "started"),
        (False, 15_000, "finished"),
    ]
    limit = limits_billed(events)
    assert limit == {JOB: 4 * GiB * 13}


def restart_seen_late(
    tmp_path: Path,
    phase: str = "Running",
    *,
    new_run: str = "same file",
    final_from: int = 60,
    during: Callable[[int, Scanner], contextlib.AbstractContextManager[object]] | None = None,
    also: Callable[[int, CacheWriter], None] | None = None,
) -> list[Event]:
    """The Job's process (1 GiB) exits at +8 and the watch shows its container terminated, then
    in back-off (`waiting`), until +40; the new run's process (2 GiB) starts writing the file
    (`new_run`: "same file", "new file" beside it, or "none") at +12, and the watch shows it
    running (from +12) only at +40: the kubelet's status lags. From `final_from` on the pod's
    phase is `Failed` with the back-off status unchanged. `during(s, scanner)`: a context the
    scan of second s runs in (a fault). `also(s, writer)`: more of the first run's writes, made
    before the scan of second s (its process 10 exits at +8 unless it is gone by then)."""
    root = tmp_path / "root"
    w = new_cache_file(root, JOB, "main", V12, [SimDevice("GPU-a", 4 * GiB, 50)])
    writers = [w]
    w.add_process(10, 5010)
    w.add_memory(10, 0, "data", GiB)
    current: dict[str, PodView] = {}
    scanner = Scanner(root, heartbeat_s=10, inc=1, presence=PresenceStage(lambda: current))
    waiting = Run("main", "waiting", last_finished=iso(8), restarts=1)
    identity = job("running").identity
    events: list[Event] = []
    for s in range(60):
        if also is not None:
            also(s, w)
        if s == 8 and w.region.procs[0].pid == 10 and w.region.procs[0].seqlock % 2 == 0:
            w.exit(10)
        if s == 12 and new_run != "none":
            if new_run == "new file":
                gpu = [SimDevice("GPU-a", 4 * GiB, 50)]
                writers.append(new_cache_file(root, JOB, "main", V12, gpu))
            writers[-1].add_process(1, 5100)
            writers[-1].add_memory(1, 0, "data", 2 * GiB)
        if s < 8:
            current = {JOB: job("running")}
        elif s < 9:
            current = {JOB: job("terminated", 0, 8)}
        elif s < 40 or s >= final_from:
            current = {JOB: PodView(identity, ("main",), None, None,
                                    phase=phase if s < final_from else "Failed",
                                    runs=(waiting,))}  # fmt: skip
        else:
            current = {JOB: job("running", 12, last=8, restarts=1)}
        with during(s, scanner) if during is not None else contextlib.nullcontext():
            events += scanner.scan(now_ms=T0 + s * 1000)
    for x in writers:
        x.close()
    return events


def billed_minute(events: list[Event]) -> tuple[Decimal, Decimal]:
    """The Job's memory and memory-limit byte-seconds in the minute scanned, in GiB·s."""
    agg = Aggregator(WindowSettings())
    for i, e in enumerate(events):
        agg.add("n1", e, offset=i)
    minute = [r for r in agg.flush() if r.kind == "container" and r.window_start_ms == T0]
    return (sum(r.memory_byte_seconds for r in minute) / GiB,
            sum(r.memory_limit_byte_seconds for r in minute) / GiB)  # fmt: skip


def test_a_restart_the_watch_shows_late_is_billed_from_the_scan_that_sees_it_written(
    tmp_path: Path,
) -> None:
    """A stale folder of a pod that can still restart its container is read on each scan: once
    a process writes the file after the termination (a new run), it is tracked again at once,
    not when the watch first shows the container running. Before, the new run's process was
    unbilled until +40: 48 of the 104 GiB·s it and the first run used in the minute."""
    events = restart_seen_late(tmp_path)
    appeared = [e.ts - T0 for e in events if isinstance(e, ContainerAppeared)]
    assert appeared == [0, 12_000]
    runs = [(e.running, e.at - T0, e.reason, e.ts - T0)
            for e in events if isinstance(e, ContainerRun)]  # fmt: skip
    # The new run's gate comes with the watch: its startedAt, put on the timeline at +12.
    assert runs == [(True, 0, "started", 0), (False, 8_000, "finished", 8_000),
                    (True, 12_000, "started", 40_000)]  # fmt: skip
    assert billed_minute(events) == (8 + 2 * 48, 4 * (8 + 48))


def test_a_finished_pods_stale_folder_is_not_read_again(tmp_path: Path) -> None:
    """A pod whose phase is final cannot restart its containers: its stale folder is not read,
    and a write to it (no run of the pod's) is not billed."""
    events = restart_seen_late(tmp_path, "Succeeded")
    assert [e.ts - T0 for e in events if isinstance(e, ContainerAppeared)] == [0, 40_000]


def test_a_restart_seen_late_is_tracked_through_a_scan_that_cannot_list_its_folder(
    tmp_path: Path,
) -> None:
    """The folder cannot be listed (EIO) at +20, while the new run is tracked before the watch
    shows it: what it holds is unknown then, not gone. The restart was forgotten with that
    scan, so +21 ended the container again (`stale_container` a second time, its run stopped
    at +8): 66 of 104 GiB·s and 112 of 224 GiB·s of limit billed."""

    def unlisted(s: int, scanner: Scanner) -> contextlib.AbstractContextManager[object]:
        if s != 20:
            return contextlib.nullcontext()
        folder = next(iter(scanner.discovery._held))
        os.utime(scanner.discovery.root / folder)  # its mtime moved: listed again
        failed = OSError(errno.EIO, os.strerror(errno.EIO))
        return mock.patch.object(scanner.discovery, "_open_dir", side_effect=failed)

    events = restart_seen_late(tmp_path, during=unlisted)
    stale = [e.ts - T0 for e in events
             if isinstance(e, LayoutAnomaly) and e.anomaly == "stale_container"]  # fmt: skip
    assert stale == [8_000]
    runs = [(e.running, e.at - T0) for e in events if isinstance(e, ContainerRun)]
    assert runs == [(True, 0), (False, 8_000), (True, 12_000)]
    assert billed_minute(events) == (8 + 2 * 48, 4 * (8 + 48))


def test_a_failed_read_of_a_stale_folder_is_no_new_run(tmp_path: Path) -> None:
    """The container ended for good (its pod runs on: another container); one read of its file
    fails (EIO) at +20, and from +40 the pod is `Failed`. That read differed from the mark, and
    the container was tracked again to the end of the minute: 188 GiB·s of limit for the 8 s
    it ran. A read that is not clear tells nothing."""

    def eio(s: int, scanner: Scanner) -> contextlib.AbstractContextManager[object]:
        if s != 20:
            return contextlib.nullcontext()
        return mock.patch.object(os, "pread", side_effect=OSError(errno.EIO, "I/O error"))

    events = restart_seen_late(tmp_path, new_run="none", final_from=40, during=eio)
    assert [e.ts - T0 for e in events if isinstance(e, ContainerAppeared)] == [0]
    assert billed_minute(events) == (8, 4 * 8)


def test_a_revived_container_of_a_pod_gone_final_is_stale_again(tmp_path: Path) -> None:
    """The new run is tracked from +12 while the watch still shows the last termination; at +40
    the pod is `Failed` with that same status: a pod in a final phase runs nothing, so the
    folder is stale again from then (it was tracked to the end of the minute)."""
    events = restart_seen_late(tmp_path, final_from=40)
    assert [e.ts - T0 for e in events if isinstance(e, ContainerAppeared)] == [0, 12_000]
    assert [e.ts - T0 for e in events if isinstance(e, ContainerGone)] == [8_000, 40_000]
    assert billed_minute(events) == (8 + 2 * 28, 4 * (8 + 28))


def test_a_new_run_that_writes_a_new_file_in_the_folder_is_tracked_at_once(
    tmp_path: Path,
) -> None:
    """HAMi-core may name the file anew (a new uuid) in a new run: a file first read after its
    folder's termination was marked, with a live slot, is the new run's. It was marked as the
    termination instead, and tracked from +40: 48 of 104 GiB·s."""
    events = restart_seen_late(tmp_path, new_run="new file")
    appeared = [(e.ts - T0, e.path) for e in events if isinstance(e, ContainerAppeared)]
    old = appeared[0][1]
    # the new file at once; the old one (its exit marker) with the watch, as before
    assert [(t, path == old) for t, path in appeared] == [(0, True), (12_000, False),
                                                          (40_000, True)]  # fmt: skip
    assert billed_minute(events)[0] == 8 + 2 * 48


def test_a_restart_is_seen_behind_a_probes_exit_marker(tmp_path: Path) -> None:
    """The first run's last process was a CUDA probe that ended before it had a host pid or
    memory: its exit marker is the last counted slot, which a read without the file's known
    count takes for a garbled count. Every read of the stale file was unclear, the new run's
    first write became the mark, and it was tracked from +40: 48 of 104 GiB·s."""

    def probe(s: int, w: CacheWriter) -> None:
        if s == 3:
            w.add_process(11)
        if s == 5:
            w.exit(11)

    events = restart_seen_late(tmp_path, also=probe)
    assert [e.ts - T0 for e in events if isinstance(e, ContainerAppeared)] == [0, 12_000]
    assert billed_minute(events) == (8 + 2 * 48, 4 * (8 + 48))


def test_a_restart_is_seen_beside_a_slot_killed_mid_update(tmp_path: Path) -> None:
    """The first run's process was killed between its seqlock increments at +7: every read of
    its slot is torn. A read with a torn slot was unclear, so the file got no mark, and the new
    run was tracked from +40. The torn slot is left out of the mark, as the reader leaves it
    out."""

    def killed(s: int, w: CacheWriter) -> None:
        if s == 7:
            w.region.procs[0].seqlock += 1  # odd, and nobody will make it even again

    events = restart_seen_late(tmp_path, also=killed)
    assert [e.ts - T0 for e in events if isinstance(e, ContainerAppeared)] == [0, 12_000]


def test_a_file_unreadable_when_its_folder_was_marked_is_not_a_new_runs(tmp_path: Path) -> None:
    """Two files in the folder: one left by an earlier run whose process was SIGKILLed (its slot
    live-looking for good), and the one of the run that ends at +8. The first could not be
    opened (EMFILE) at the scan that marked the folder, so it was taken for a new run's file
    at +9 and billed on (268 GiB·s of limit where 64 ran). A file seen then is not new."""
    root = tmp_path / "root"
    old = new_cache_file(root, JOB, "main", V12, [SimDevice("GPU-a", 4 * GiB, 50)])
    old.add_process(7, 4007)
    old.add_memory(7, 0, "data", GiB)
    w = new_cache_file(root, JOB, "main", V12, [SimDevice("GPU-a", 4 * GiB, 50)])
    w.add_process(10, 5010)
    w.add_memory(10, 0, "data", GiB)
    current: dict[str, PodView] = {}
    scanner = Scanner(root, heartbeat_s=10, inc=1, presence=PresenceStage(lambda: current))
    waiting = Run("main", "waiting", last_finished=iso(8), restarts=1)
    real_open = scanner.discovery.open

    def emfile(f: Any) -> Any:
        if f.path == str(old.path):
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real_open(f)

    events: list[Event] = []
    for s in range(60):
        if s == 8:
            w.exit(10)
        if s < 8:
            current = {JOB: job("running")}
        elif s < 9:
            current = {JOB: job("terminated", 0, 8)}
        else:
            current = {JOB: PodView(job("running").identity, ("main",), None, None,
                                    phase="Running", runs=(waiting,))}  # fmt: skip
        with mock.patch.object(scanner.discovery, "open", emfile if s == 8 else real_open):
            events += scanner.scan(now_ms=T0 + s * 1000)
    old.close()
    w.close()
    assert [e.ts - T0 for e in events if isinstance(e, ContainerAppeared)] == [0, 0]
    assert billed_minute(events) == (16, 64)


def test_a_run_the_runtime_lost_ends_when_the_watch_says_so(tmp_path: Path) -> None:
    """A reboot: the kubelet writes `waiting` (ContainerCreating) with `lastState.terminated`
    ContainerStatusUnknown, its times null. That lost run was taken for still running (its
    null time read as no last run): its limits billed through the 31 s it was away. It ends at
    the scan that reads it (+9), and the next run starts at its startedAt (+40)."""
    import msgspec

    from collector.node.pods import ContainerStatus

    lost = msgspec.json.decode(
        b'{"name": "main", "restartCount": 1, "state": {"waiting": {"reason": '
        b'"ContainerCreating"}}, "lastState": {"terminated": {"reason": '
        b'"ContainerStatusUnknown", "exitCode": 137, "startedAt": null, "finishedAt": null}}}',
        type=ContainerStatus,
    ).run()

    def view(s: int) -> PodView:
        if 9 <= s < 40:
            return PodView(job("running").identity, ("main",), None, None, runs=(lost,))
        return job("running") if s < 9 else job("running", 40, restarts=1)

    events = scan_job(tmp_path, 60, view)
    runs = [(e.running, e.at - T0, e.reason) for e in events if isinstance(e, ContainerRun)]
    assert runs == [(True, 0, "started"), (False, 9_000, "finished"), (True, 40_000, "started")]
    agg = Aggregator(WindowSettings())
    for i, e in enumerate(events):
        agg.add("n1", e, offset=i)
    # the minute scanned (after it the last run's limit is held to max_gap)
    minute = [r for r in agg.flush() if r.kind == "container" and r.window_start_ms == T0]
    assert sum(r.memory_limit_byte_seconds for r in minute) == 4 * GiB * (9 + 20)


def test_a_restart_at_every_cut_point_bills_the_same_runs(tmp_path: Path) -> None:
    """The aggregator restarted anywhere (from `needed_offsets()`, windows up to
    `emitted_until_ms` suppressed) gives the records of an uninterrupted run: the running gate
    is rebuilt from the change that set it, or the heartbeat that restated it."""
    events, _ = scenario(tmp_path)
    settings = WindowSettings(window_ms=5_000, lateness_ms=10_000, max_gap_ms=30_000)

    def feed(agg: Aggregator, first: int, last: int) -> list[BillingRecord]:
        out: list[BillingRecord] = []
        for offset in range(first, last):
            agg.add("n1", events[offset], offset=offset)
            out += agg.advance()
        return out

    whole = Aggregator(settings)
    expected = feed(whole, 0, len(events)) + whole.flush()
    assert sum(r.memory_limit_byte_seconds for r in expected if r.pod_uid == JOB) == 4 * GiB * 27
    for cut in range(1, len(events), 3):
        before = Aggregator(settings)
        got = feed(before, 0, cut)
        resume = before.needed_offsets().get(0, cut)
        after = Aggregator(settings, emitted_until_ms=before.emitted_until_ms)
        got += feed(after, resume, len(events)) + after.flush()
        assert got == expected, cut
