"""`hami-usage collect` into the local log (no broker), as a subprocess over simulated files.

The simulator runs in this process (a thread) and keeps a fake host /proc in step with its
processes, so `--host-proc` turns SIGKILLed slots into exits; what the collector wrote is read
back with LogReader and compared with what the simulator did.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from collector.events import (
    SCHEMA_VERSION,
    CollectorStarted,
    ContainerAppeared,
    ContainerGone,
    Event,
    Heartbeat,
    ProcessExited,
    ProcessStarted,
    UsageRow,
    UsageSample,
    decode,
)
from collector.simulate import MiB, NodeSimulator, SimContainer
from collector.transport.locallog import FRAME_OVERHEAD, LogReader, LogRecord

HAMI_USAGE = Path(sys.executable).parent / "hami-usage"

ContainerId = tuple[str, str]  # (pod uid, container)
Rows = dict[tuple[int, int, int], tuple[int, int]]  # (pid, hostpid, device) -> (total, monitor)


class Sim(NodeSimulator):
    """NodeSimulator that keeps `<proc>/<hostpid>` for exactly its live processes and
    remembers every process it ever started (container -> {(pid, hostpid)})."""

    def __init__(self, root: Path, proc: Path, containers: int, **kw: object) -> None:
        self.proc = proc
        self.started: dict[ContainerId, set[tuple[int, int]]] = {}
        proc.mkdir(parents=True, exist_ok=True)
        super().__init__(root, containers, "mixed", **kw)  # type: ignore[arg-type]

    def _start(self, c: SimContainer) -> None:
        (self.proc / str(self.hostpid + 1)).mkdir()  # alive before its slot exists
        super()._start(c)
        self.started.setdefault((c.pod_uid, c.name), set()).add((c.next_pid, self.hostpid))

    def step(self, now: float) -> None:
        super().step(now)
        live = {str(p.hostpid) for c in self.containers for p in c.procs.values()}
        for entry in os.listdir(self.proc):
            if entry not in live:
                os.rmdir(self.proc / entry)  # exited or SIGKILLed

    def model(self) -> dict[ContainerId, Rows]:
        """What every file holds for the live processes: data total and NVML memory."""
        out: dict[ContainerId, Rows] = {}
        for c in self.containers:
            rows: Rows = {}
            for p in c.procs.values():
                for d in range(len(c.writer.devices)):
                    mem = p.memory.get(d)
                    rows[(p.pid, p.hostpid, d)] = (mem or 0, 0 if mem is None else mem + 300 * MiB)
            out[(c.pod_uid, c.name)] = rows
        return out


@dataclass
class SimThread:
    sim: Sim
    period_s: float
    steps: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> SimThread:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sim.step(time.time())
            self.steps += 1
            self._stop.wait(self.period_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """(root, fake host proc) folders."""
    root = tmp_path / "containers"
    root.mkdir()
    yield root, tmp_path / "proc"


def collect_cmd(root: Path, log: Path, proc: Path, *extra: str) -> list[str]:
    return [
        str(HAMI_USAGE), "collect",
        "--root", str(root), "--log", str(log), "--host-proc", str(proc), "--node", "n1",
        *extra,
    ]  # fmt: skip


class Collector:
    """A `hami-usage collect` subprocess. Its stderr goes to a file: a pipe nobody reads
    would fill up and block the collector on its next log line."""

    def __init__(self, cmd: list[str], err: Path) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("HAMI_USAGE_")}
        self.err = err
        with err.open("wb") as f:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f, env=env)

    def running(self) -> bool:
        return self.proc.poll() is None

    def stderr(self) -> str:
        return self.err.read_text()

    def wait(self, timeout: float = 60) -> int:
        return self.proc.wait(timeout)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout)


def run_collector(cmd: list[str], tmp: Path, timeout: float = 120) -> str:
    """Run to completion; assert exit status 0; return stderr."""
    c = Collector(cmd, tmp / f"collect-{time.monotonic_ns()}.err")
    rc = c.wait(timeout)
    assert rc == 0, c.stderr()
    return c.stderr()


def read_all(log: Path) -> list[LogRecord]:
    reader = LogReader(log)
    out: list[LogRecord] = []
    while batch := reader.read(len(out) and out[-1].offset + 1, 5000):
        out += batch
    return out


def wait_for_records(log: Path, n: int, c: Collector, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert c.running(), c.stderr()
        if log.exists() and (end := LogReader(log).end_offset()) >= n:
            return end
        time.sleep(0.05)
    raise AssertionError(f"fewer than {n} records in {log} after {timeout}s")


def check_incarnations(events: list[Event]) -> list[list[Event]]:
    """Split by incarnation; each is dense from seq 0, with the current schema version."""
    runs: list[list[Event]] = []
    for e in events:
        assert e.v == SCHEMA_VERSION
        if not runs or e.inc != runs[-1][0].inc:
            assert e.seq == 0, "an incarnation starts at seq 0"
            runs.append([])
        assert e.seq == len(runs[-1])
        runs[-1].append(e)
    return runs


def fold(events: list[Event]) -> dict[ContainerId, Rows]:
    """Latest absolute rows per live container from one incarnation's change events, with
    the protocol's consistency checked along the way."""
    names: dict[int, ContainerId] = {}
    live: dict[int, dict[tuple[int, int, int], UsageRow]] = {}
    procs: dict[int, set[tuple[int, int]]] = {}
    for e in events:
        if isinstance(e, ContainerAppeared):
            assert e.cid not in names
            names[e.cid], live[e.cid], procs[e.cid] = (e.pod_uid, e.container), {}, set()
        elif isinstance(e, ContainerGone):
            del live[e.cid], procs[e.cid]
        elif isinstance(e, ProcessStarted):
            assert (e.pid, e.hostpid) not in procs[e.cid]
            procs[e.cid].add((e.pid, e.hostpid))
        elif isinstance(e, ProcessExited):
            procs[e.cid].remove((e.pid, e.hostpid))
            for k in [k for k in live[e.cid] if k[:2] == (e.pid, e.hostpid)]:
                del live[e.cid][k]
        elif isinstance(e, UsageSample):
            assert e.rows
            for r in e.rows:
                assert (r.pid, r.hostpid) in procs[e.cid], "usage of a process not started"
                assert r.total == r.context + r.module + r.data
                live[e.cid][(r.pid, r.hostpid, r.device)] = r
    return {
        names[cid]: {k: (r.total, r.monitor) for k, r in rows.items()} for cid, rows in live.items()
    }


def started_processes(events: list[Event]) -> dict[ContainerId, set[tuple[int, int]]]:
    names = {e.cid: (e.pod_uid, e.container) for e in events if isinstance(e, ContainerAppeared)}
    out: dict[ContainerId, set[tuple[int, int]]] = {}
    for e in events:
        if isinstance(e, ProcessStarted):
            out.setdefault(names[e.cid], set()).add((e.pid, e.hostpid))
    return out


def test_collect_into_the_local_log_matches_the_simulator(
    node: tuple[Path, Path], tmp_path: Path
) -> None:
    root, proc_dir = node
    log = tmp_path / "log"
    sim = Sim(root, proc_dir, 10, seed=11, procs_per_container=3)
    try:
        # Phase 1: the collector scans while the simulator writes.
        with SimThread(sim, 0.05) as st:
            run_collector(
                collect_cmd(root, log, proc_dir, "--interval", "0.2", "--max-scans", "12"), tmp_path
            )
        assert st.steps > 20
        # Phase 2: the simulator has stopped; a new incarnation states the final picture.
        run_collector(
            collect_cmd(root, log, proc_dir, "--interval", "0.2", "--max-scans", "2"), tmp_path
        )
        model = sim.model()
    finally:
        sim.close()

    records = read_all(log)
    assert [r.offset for r in records] == list(range(len(records)))
    assert {r.key for r in records} == {b"n1"}
    events = [decode(r.value) for r in records]
    assert [r.timestamp_ms for r in records] == [e.ts for e in events]
    first, second = check_incarnations(events)
    assert first[0].inc != second[0].inc

    # Everything the first run saw start, the simulator started (same pid and host pid).
    seen = started_processes(first)
    assert seen and all(keys <= sim.started[c] for c, keys in seen.items())
    assert sum(isinstance(e, ProcessExited) for e in first) > 0  # exits and SIGKILLs happened
    fold(first)  # consistent on its own
    # The second run restates exactly what the files hold: per container, the live
    # processes and the absolute data/NVML totals of their last sample.
    assert fold(second) == model
    assert {c for c in model} == {(c.pod_uid, c.name) for c in sim.containers}


def test_events_dropped_at_the_end_of_a_run_are_told_and_reported(
    node: tuple[Path, Path], tmp_path: Path
) -> None:
    """The size bound drops events and the run ends before the log takes events again: no later
    event showed their seq gap, nor any heartbeat their count, and the aggregator said "damage:
    none", exit 0. The stopping collector's last heartbeat (past the bound) tells them."""
    root, proc_dir = node
    log = tmp_path / "log"
    sim = Sim(root, proc_dir, 6, seed=5)
    try:
        with SimThread(sim, 0.02):
            err = run_collector(
                collect_cmd(root, log, proc_dir, "--interval", "0.1", "--heartbeat", "60",
                            "--log-max-bytes", "20000", "--max-scans", "30"),
                tmp_path,
            )  # fmt: skip
    finally:
        sim.close()
    m = re.search(r"collector stopped: (\d+) events appended, (\d+) dropped", err)
    assert m, err
    appended, dropped = int(m.group(1)), int(m.group(2))
    assert dropped > 0, err
    records = read_all(log)
    events = [decode(r.value) for r in records]
    assert len(events) == appended
    last = events[-1]
    assert isinstance(last, Heartbeat) and last.dropped == dropped
    assert [e.seq for e in events] == sorted(e.seq for e in events)
    assert last.seq - len(events) + 1 == dropped  # the gap in seq before it
    agg = subprocess.run(
        [str(HAMI_USAGE), "aggregate", "--log", str(log), "--drain", "--no-otlp",
         "--csv", str(tmp_path / "out.csv")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert agg.returncode == 3, agg.stderr
    assert f"seq_missing={dropped} (collectors reported {dropped} dropped)" in agg.stderr


def test_sigterm_mid_run_exits_0_and_everything_appended_is_readable(
    node: tuple[Path, Path], tmp_path: Path
) -> None:
    root, proc_dir = node
    log = tmp_path / "log"
    sim = Sim(root, proc_dir, 20, seed=3)
    try:
        with SimThread(sim, 0.02):
            c = Collector(collect_cmd(root, log, proc_dir, "--interval", "0.05"), tmp_path / "err")
            wait_for_records(log, 300, c)
            time.sleep(0.3)
            rc = c.stop(signal.SIGTERM)
    finally:
        sim.close()
    err = c.stderr()
    assert rc == 0, err
    assert "Traceback" not in err
    m = re.search(r"collector stopped: (\d+) events appended, 0 dropped", err)
    assert m, err
    records = read_all(log)
    assert len(records) == int(m.group(1))
    (run,) = check_incarnations([decode(r.value) for r in records])
    fold(run)


def test_sigkill_mid_run_then_restart_on_the_same_log(
    node: tuple[Path, Path], tmp_path: Path
) -> None:
    root, proc_dir = node
    log = tmp_path / "log"
    sim = Sim(root, proc_dir, 64, seed=5, procs_per_container=2)
    try:
        with SimThread(sim, 0.01):
            c = Collector(collect_cmd(root, log, proc_dir, "--interval", "0.02"), tmp_path / "err")
            wait_for_records(log, 2000, c)
            assert c.stop(signal.SIGKILL) == -signal.SIGKILL

            before = read_all(log)
            n = len(before)
            assert [r.offset for r in before] == list(range(n))
            (killed_run,) = check_incarnations([decode(r.value) for r in before])
            # A crash in the middle of a write leaves part of a frame: cut the newest
            # segment inside its last record (after what the kill itself may have torn: a
            # write of several pages can be cut between them).
            segment = max(log.glob("*.log"))
            last = before[-1]
            frame = FRAME_OVERHEAD + len(last.key) + len(last.value)
            with segment.open("r+b") as f:
                f.truncate(segment.stat().st_size - LogReader(log).torn_tail() - 7)
            assert [r.offset for r in read_all(log)] == list(range(n - 1))  # tail ignored

            err = run_collector(
                collect_cmd(root, log, proc_dir, "--interval", "0.05", "--max-scans", "3"), tmp_path
            )
    finally:
        sim.close()
    assert f"cut a torn tail of {frame - 7} bytes left by a crash; next offset {n - 1}" in err

    after = read_all(log)
    assert [r.offset for r in after] == list(range(len(after)))
    assert after[: n - 1] == before[: n - 1]  # every intact record is untouched
    runs = check_incarnations([decode(r.value) for r in after])
    assert len(runs) == 2
    assert runs[0] == killed_run[:-1]
    # The incarnation announces itself first, then re-announces every container.
    assert isinstance(runs[1][0], CollectorStarted)
    assert runs[1][0].log == str(log) and runs[1][0].pid > 0
    assert isinstance(runs[1][1], ContainerAppeared)
    assert len({e.cid for e in runs[1] if isinstance(e, ContainerAppeared)}) == 64
    fold(runs[1])


def test_a_stalled_collector_does_not_run_the_missed_scans_back_to_back(tmp_path: Path) -> None:
    """Stopped for 6 s (SIGSTOP, as a node under memory pressure or a debugger does) at a
    2 s interval: on resuming it scans once and goes on at the interval, instead of running
    the three scans it missed at once (or, as it did, two)."""
    import socket
    import urllib.request

    (tmp_path / "root").mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [str(HAMI_USAGE), "collect", "--root", str(tmp_path / "root"), "--log",
           str(tmp_path / "log"), "--node", "n1", "--interval", "2", "--heartbeat", "100",
           "--no-nvml", "--no-kubernetes", "--metrics-port", str(port),
           "--metrics-bind-address", "127.0.0.1"]  # fmt: skip

    def scans() -> float:
        url = f"http://127.0.0.1:{port}/metrics"
        try:
            body = urllib.request.urlopen(url, timeout=5).read().decode()
        except OSError:
            return -1.0
        found = re.search(r"^hami_usage_scans_total (\S+)", body, re.M)
        return float(found.group(1)) if found else -1.0

    def next_scan(after: float) -> float:
        """When a scan after the `after`th was seen (polled every 50 ms)."""
        deadline = time.monotonic() + 30
        while scans() <= after:
            assert time.monotonic() < deadline, (tmp_path / "err").read_text()
            time.sleep(0.05)
        return time.monotonic()

    with (tmp_path / "err").open("wb") as err:
        proc = subprocess.Popen(cmd, stderr=err)
    try:
        next_scan(0)
        # Stopped right after a scan, so no scan ends between reading the count and the stop.
        next_scan(scans())
        before = scans()
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(6)
        os.kill(proc.pid, signal.SIGCONT)
        seen = next_scan(before)
        # The scan after it is due 2 s after it ended: 1 s from seeing it, still one scan.
        time.sleep(max(0.0, seen + 1.0 - time.monotonic()))
        assert scans() - before == 1  # not the three missed ones one after another
        next_scan(before + 1)  # and the interval goes on
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
