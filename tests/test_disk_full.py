"""The collector on a disk that fills and frees (a real small filesystem, see fulldisk.py).

Disk full, I/O errors and the log's own size bound are one condition: the collector keeps
scanning, counts what it drops (metric + heartbeat), logs once per episode, says "degraded" on
/healthz, writes again by itself when space returns, and loses nothing it had written; a
restart on a full disk does not crash. The aggregator of a local log whose checkpoint or
output the disk refuses says so in one line and exits 1; its restart goes on from its last
commit.
"""

from __future__ import annotations

import asyncio
import errno
import os
import re
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from fulldisk import full_disk
from streams import (
    CSV_HEADER,
    T0_MS,
    WINDOW_FLAGS,
    Spec,
    build,
    consume_plain,
    create_topic,
    csv_lines,
    env,
    read_csv,
    reference,
    write_local_log,
)
from test_collector_metrics import get as http_get

from collector.aggregate.records import BillingRecord
from collector.aggregate.sinks import JsonlSink
from collector.events import Heartbeat, decode
from collector.simulate import NodeSimulator
from collector.transport.locallog import LocalLog, LogReader, LogRecord
from collector.transport.locallog import writer as writer_module

HAMI_USAGE = Path(sys.executable).parent / "hami-usage"


def read_all(log: Path) -> tuple[list[LogRecord], LogReader]:
    reader = LogReader(log)
    out: list[LogRecord] = []
    while batch := reader.read(len(out) and out[-1].offset + 1, 5000):
        out += batch
    return out, reader


class Proc:
    def __init__(self, cmd: list[str], err: Path, preexec: object = None) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("HAMI_USAGE_")}
        self.err = err
        with err.open("wb") as f:
            self.proc = subprocess.Popen(
                cmd,
                stdout=subprocess.DEVNULL,
                stderr=f,
                env=env,
                preexec_fn=preexec,  # type: ignore[arg-type]
            )

    def stderr(self) -> str:
        return self.err.read_text()

    def port(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.stderr()
            m = re.search(r"metrics on [^ ]*:(\d+)/metrics", self.stderr())
            if m:
                return int(m.group(1))
            time.sleep(0.05)
        raise AssertionError(self.stderr())


def get(port: int, path: str) -> tuple[int, str]:
    status, _, body = http_get(port, path)
    return status, body


def metric(port: int, name: str) -> float:
    _, body = get(port, "/metrics")
    m = re.search(rf"^{name} (\S+)$", body, re.M)
    assert m, body
    return float(m.group(1))


def wait_until(what: str, check: object, p: Proc, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert p.proc.poll() is None, p.stderr()
        if check():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError(f"not {what} after {timeout}s:\n{p.stderr()}")


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[NodeSimulator]:
    root = tmp_path / "containers"
    root.mkdir()
    node = NodeSimulator(root, 4, "v1.2", seed=11)
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            node.step(time.time())
            stop.wait(0.05)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    yield node
    stop.set()
    thread.join()
    node.close()


def collect_cmd(root: Path, log: Path) -> list[str]:
    return [
        str(HAMI_USAGE), "collect", "--root", str(root), "--log", str(log), "--node", "n1",
        "--interval", "0.05", "--heartbeat", "0.5", "--no-nvml", "--metrics-port", "0",
    ]  # fmt: skip


def test_collector_rides_out_a_full_disk(tmp_path: Path, sim: NodeSimulator) -> None:
    with full_disk(tmp_path / "disk") as disk:
        log = disk.directory / "events"
        p = Proc(collect_cmd(sim.root, log), tmp_path / "collect1.err")
        disk.attach(p.proc.pid)
        port = p.port()
        wait_until("writing", lambda: LogReader(log).end_offset() > 50, p)
        before, _ = read_all(log)

        disk.fill()
        wait_until("blocked", lambda: metric(port, "hami_usage_log_blocked") == 1, p)
        dropped = metric(port, "hami_usage_events_dropped_total")
        wait_until(
            "dropping", lambda: metric(port, "hami_usage_events_dropped_total") > dropped + 20, p
        )
        status, body = get(port, "/healthz")
        assert status == 200
        assert body.startswith(f"degraded: local log refuses events ({disk.strerror})"), body
        assert metric(port, "hami_usage_log_blocked_episodes_total") >= 1
        assert metric(port, "hami_usage_log_write_errors_total") >= 1
        scans = metric(port, "hami_usage_scans_total")
        wait_until("scanning", lambda: metric(port, "hami_usage_scans_total") > scans + 10, p)

        disk.free()
        wait_until("writing again", lambda: metric(port, "hami_usage_log_blocked") == 0, p)
        assert get(port, "/healthz")[1].startswith("last scan")
        end = LogReader(log).end_offset()
        wait_until("appending", lambda: LogReader(log).end_offset() > end + 20, p)

        # The second episode is a restart on a full disk: it must start, not crash.
        disk.fill()
        wait_until("blocked", lambda: metric(port, "hami_usage_log_blocked") == 1, p)
        episodes = metric(port, "hami_usage_log_blocked_episodes_total")
        p.proc.send_signal(signal.SIGTERM)
        assert p.proc.wait(30) == 0, p.stderr()
        err1 = p.stderr()
        p2 = Proc(collect_cmd(sim.root, log), tmp_path / "collect2.err", disk.preexec())
        disk.attach(p2.proc.pid)
        port2 = p2.port()
        wait_until("blocked", lambda: metric(port2, "hami_usage_log_blocked") == 1, p2)
        # The log refuses from its first append, which can come before the first scan ends;
        # /healthz is 503 until a scan has happened, and 200 (degraded) from then on.
        wait_until("scanning", lambda: metric(port2, "hami_usage_scans_total") >= 1, p2)
        assert get(port2, "/healthz")[0] == 200
        # (an event refused, not only one held in the writer's buffer, which a disk freed at
        # once takes: the seq gap asserted below is there only then)
        wait_until("dropping", lambda: metric(port2, "hami_usage_events_dropped_total") >= 1, p2)
        disk.free()
        wait_until("writing again", lambda: metric(port2, "hami_usage_log_blocked") == 0, p2)
        end = LogReader(log).end_offset()
        wait_until("appending", lambda: LogReader(log).end_offset() > end + 20, p2)
        p2.proc.send_signal(signal.SIGTERM)
        assert p2.proc.wait(30) == 0, p2.stderr()
        err2 = p2.stderr()

        records, reader = read_all(log)
    for err in (err1, err2):
        assert "Traceback" not in err
    # Once per episode: two in the first run (more if the last page of a segment still took
    # a few records after the disk was full), one in the second.
    assert episodes >= 2
    assert err1.count("cannot take events") == episodes, err1
    assert err1.count("writes again after") == episodes - 1, err1
    assert err2.count("cannot take events") == 1 and err2.count("writes again after") == 1
    assert re.search(r"writes again after [\d.]+ s: [1-9]\d* events dropped", err1), err1
    # Nothing written was lost, nothing is damaged, offsets are dense.
    assert records[: len(before)] == before
    assert [r.offset for r in records] == list(range(len(records)))
    assert reader.stats.corrupt_frames == reader.stats.missing_records == 0
    # The drops are in the heartbeats that followed, and each incarnation's seq gaps are
    # exactly the events it dropped.
    events = [decode(r.value) for r in records]
    incs = list(dict.fromkeys(e.inc for e in events))
    assert len(incs) == 2
    for inc in incs:
        mine = [e for e in events if e.inc == inc]
        seqs = [e.seq for e in mine]
        beats = [e for e in mine if isinstance(e, Heartbeat)]
        assert beats[-1].log_blocked >= 1
        missing = seqs[-1] + 1 - len(seqs)
        assert missing > 0
        # The last heartbeat was stamped before the last events: it counts at most as many.
        assert 0 < beats[-1].dropped <= missing


@pytest.mark.kafka
def test_events_lost_at_a_stop_on_a_full_disk_are_not_left_in_the_spool(
    tmp_path: Path, sim: NodeSimulator, kafka_bootstrap: str, kafka_topic: str
) -> None:
    """With Kafka, stopped while the disk is full: the events the log accepted into its
    buffer and could never write are lost, said so and counted dropped, and the stop line
    does not count them again as left in the spool (it did): everything written was sent."""
    asyncio.run(create_topic(kafka_bootstrap, kafka_topic, 1))
    with full_disk(tmp_path / "disk") as disk:
        cmd = collect_cmd(sim.root, disk.directory / "spool")
        p = Proc([*cmd, "--kafka", kafka_bootstrap, "--topic", kafka_topic], tmp_path / "err")
        disk.attach(p.proc.pid)
        port = p.port()
        wait_until("appending", lambda: metric(port, "hami_usage_events_total") > 50, p)
        disk.fill()
        wait_until("blocked", lambda: metric(port, "hami_usage_log_blocked") == 1, p)
        p.proc.send_signal(signal.SIGTERM)
        assert p.proc.wait(30) == 0, p.stderr()
        err = p.stderr()
    sent = asyncio.run(consume_plain(kafka_topic, bootstrap_servers=kafka_bootstrap))
    lost = re.search(r": (\d+) accepted events could not be written \((.+)\) and are lost", err)
    stop = re.search(r"collector stopped: (\d+) events appended, \d+ dropped, (\d+) left", err)
    assert lost is not None and stop is not None, err
    assert int(lost[1]) >= 1 and lost[2] == disk.strerror
    assert (int(stop[1]), int(stop[2])) == (len(sent), 0)


def test_log_size_bound_is_the_same_condition(tmp_path: Path) -> None:
    with LocalLog(tmp_path, max_bytes=4000) as log:
        accepted = [log.append(b"k", bytes(100), i) for i in range(60)]
        assert None in accepted
        assert log.blocked == "size bound of 4000 bytes reached"
        assert log.stats.blocked_episodes == 1
        n = log.stats.rejected_records
        assert log.append(b"k", bytes(100), 99) is None
        assert log.stats.blocked_episodes == 1  # still the same episode
        assert log.stats.rejected_records == n + 1
        log.flush()
        LogReader(tmp_path).commit("g", log.next_offset)  # a consumer is done: room again
        assert log.append(b"k", bytes(100), 100) is not None
        assert log.blocked is None
        log.append(b"k", bytes(4000), 101)
        assert log.stats.blocked_episodes == 2


def test_writer_holds_what_it_accepted_until_the_disk_takes_it(tmp_path: Path) -> None:
    with full_disk(tmp_path / "disk", size=1024 * 1024) as disk:
        disk.attach(os.getpid())
        try:
            with LocalLog(disk.directory / "log") as log:
                for i in range(100):
                    assert log.append(b"k", i.to_bytes(4, "big") * 100, i) == i
                log.flush()
                disk.fill()
                # Accepted into the buffer, then refused by the disk at flush: kept, retried.
                for i in range(100, 150):
                    assert log.append(b"k", i.to_bytes(4, "big") * 100, i) == i
                log.flush()
                assert log.blocked == disk.strerror
                assert log.unwritten == 50
                assert log.append(b"k", b"x", 150) is None
                assert log.stats.rejected_records == 1
                disk.free()
                log.flush()
                assert log.unwritten == 0
                time.sleep(0.15)  # past the retry pause of appends
                assert log.append(b"k", b"y", 151) == 150
                assert log.blocked is None
            got, reader = read_all(disk.directory / "log")
        finally:
            disk.free()
    assert [r.offset for r in got] == list(range(151))
    assert [r.value for r in got[:150]] == [i.to_bytes(4, "big") * 100 for i in range(150)]
    assert reader.stats.corrupt_frames == 0


def test_records_a_cut_short_write_left_whole_are_not_counted_lost(tmp_path: Path) -> None:
    """The disk takes part of the last write (the rest of the segment's last page) and then
    refuses: the stop count is exactly the records that are not on disk after a reopen."""
    frame = 26 + 1 + 100
    page = resource.getpagesize()
    with full_disk(tmp_path / "disk", size=1024 * 1024) as disk:
        directory = disk.directory / "log"
        disk.attach(os.getpid())
        try:
            log = LocalLog(directory)
            for i in range(10):
                assert log.append(b"k", bytes([i]) * 100, i) == i
            log.flush()
            disk.fill(page_room=True)
            for i in range(10, 60):
                assert log.append(b"k", bytes([i]) * 100, i) == i
            log.flush()
            assert (log.blocked, log.unwritten) == (disk.strerror, 50)
            log.close()
        finally:
            disk.free()
        whole = (page - 10 * frame) // frame  # the frames that fit the rest of the page
        assert log.stats.unwritten_records == 50 - whole
        # The torn frame after them is cut at close: the next open finds no torn tail.
        assert (directory / f"{0:020d}.log").stat().st_size == (10 + whole) * frame
        with LocalLog(directory) as again:
            assert (again.next_offset, again.stats.torn_tail_bytes) == (10 + whole, 0)
        got, reader = read_all(directory)
    assert [(r.offset, r.value) for r in got] == [(i, bytes([i]) * 100) for i in range(10 + whole)]
    assert 60 - len(got) == log.stats.unwritten_records
    assert reader.stats.corrupt_frames == 0


def test_first_start_on_a_full_disk_waits_for_space(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The log's folder exists but the disk has no room for a new file (a full directory block
    or no free inode: neither a full tmpfs nor the file-size limit refuses an empty file, so the
    refusal is made at os.open). The log opens blocked, rejects and counts, and creates its first
    segment once the disk takes it."""
    directory = tmp_path / "log"
    directory.mkdir()
    real_open = os.open
    full = True

    def open_(path: str | Path, flags: int, mode: int = 0o777) -> int:
        if full and flags & os.O_CREAT and not os.path.exists(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_open(path, flags, mode)

    (directory / "writer.lock").touch()
    monkeypatch.setattr(writer_module.os, "open", open_)
    with LocalLog(directory) as log:
        assert log.blocked == os.strerror(errno.ENOSPC)
        assert (log.stats.blocked_episodes, log.stats.write_errors) == (1, 1)
        assert log.append(b"k", b"a", 1) is None
        time.sleep(0.15)  # past the retry pause of appends: the retry is refused too
        assert log.append(b"k", b"b", 2) is None
        log.flush()
        assert (log.stats.rejected_records, log.stats.write_errors) == (2, 3)
        assert list(directory.glob("*.log")) == []
        full = False
        time.sleep(0.15)
        assert log.append(b"k", b"c", 3) == 0
        assert log.append(b"k", b"d", 4) == 1
        assert log.blocked is None
        assert (log.stats.blocked_episodes, log.stats.appended_records) == (1, 2)
    assert log.stats.unwritten_records == 0
    got, _ = read_all(directory)
    assert [(r.offset, r.value) for r in got] == [(0, b"c"), (1, b"d")]


def test_a_first_start_that_cannot_create_the_lock_is_one_line_and_exit_1(tmp_path: Path) -> None:
    """Without its lock file no writer may open the log (two collectors could write it): the
    collector says why in one line and exits 1, for its supervisor to start it again (it was a
    traceback). The disk refusal is made at the lock's open, in the collector's own process."""
    root, log = tmp_path / "containers", tmp_path / "log"
    root.mkdir()
    log.mkdir()
    code = (
        "import errno, os\n"
        "from collector.cli import main\n"
        "real = os.open\n"
        "def refuse(path, flags, mode=0o777, **kw):\n"
        "    if str(path).endswith('writer.lock'):\n"
        "        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))\n"
        "    return real(path, flags, mode, **kw)\n"
        "os.open = refuse\n"
        f"raise SystemExit(main(['collect', '--root', {str(root)!r}, '--log', {str(log)!r},"
        " '--node', 'n1', '--no-nvml', '--max-scans', '1']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        f"hami-usage collect: {log}: cannot create writer.lock: No space left on device"
    ), proc.stderr
    assert "Traceback" not in proc.stderr


# --- the aggregator of a local log ---------------------------------------------------------

# One node, 2 containers on one device: the first windows an aggregate closes are 4056 bytes
# of CSV, less than a file's write buffer and more than the rest of the page its header is in.
SMALL = Spec(containers=2, procs=1, devices=1)


def aggregate(cmd: list[str | Path], preexec: object = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(HAMI_USAGE), *map(str, cmd)], capture_output=True, text=True, timeout=120,
        env=env(), preexec_fn=preexec,  # type: ignore[arg-type]
    )  # fmt: skip


def test_a_checkpoint_the_disk_refuses_is_one_line_and_exit_1(tmp_path: Path) -> None:
    """The local log, and so the group's checkpoint, on a full disk (the output elsewhere):
    at a first start and at the commit of a drain with nothing new, one line naming the
    checkpoint and exit 1 (it was a traceback). The checkpoint is the last one written, and the
    drain after space returns ends with the records a run without the full disk writes."""
    msgs = build(tmp_path / "nodes", T0_MS, SMALL, ("node-a",))
    jsonl = tmp_path / "out.jsonl"
    with full_disk(tmp_path / "disk") as disk:
        log = disk.directory / "log"
        write_local_log(log, msgs)
        checkpoint = log / "consumers" / "hami-usage-aggregator.json"
        cmd = ["aggregate", "--log", log, *WINDOW_FLAGS, "--jsonl", jsonl, "--drain"]
        disk.fill()
        first = aggregate(cmd, disk.preexec(limit=0))
        disk.free()
        drained = aggregate(cmd)
        committed = checkpoint.read_bytes()
        disk.fill()
        again = aggregate(cmd, disk.preexec(limit=0))
        disk.free()
        assert checkpoint.read_bytes() == committed
        # (no temporary file left; the group's lock beside it)
        assert sorted(checkpoint.parent.iterdir()) == [checkpoint, checkpoint.with_suffix(".lock")]
        last = aggregate(cmd)
    line = f"hami-usage aggregate: cannot write {checkpoint}: {disk.strerror}\n"
    for proc in (first, again):
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr.endswith(line), proc.stderr
        assert "Traceback" not in proc.stderr
    assert (drained.returncode, last.returncode) == (0, 0), drained.stderr + last.stderr
    got = [msgspec.json.decode(x, type=BillingRecord) for x in jsonl.read_bytes().splitlines()]
    assert got == reference(msgs)


def test_an_output_the_disk_refuses_is_one_line_though_its_buffer_is_left(
    tmp_path: Path,
) -> None:
    """The CSV on a full disk takes the header (a first run over an empty log) and then
    refuses the first windows, which were held in the file's buffer: closing the file flushes
    that buffer and fails again, which replaced the one line with a traceback. Space again, the
    drain writes every record once."""
    log = tmp_path / "log"
    LocalLog(log).close()
    msgs = build(tmp_path / "nodes", T0_MS, SMALL, ("node-a",))
    with full_disk(tmp_path / "disk") as disk:
        csv = disk.directory / "out.csv"
        cmd = ["aggregate", "--log", log, *WINDOW_FLAGS, "--csv", csv, "--drain"]
        header = aggregate(cmd)
        assert header.returncode == 0, header.stderr
        assert csv.read_text() == CSV_HEADER
        write_local_log(log, msgs)
        disk.fill()
        refused = aggregate(cmd, disk.preexec(limit=len(CSV_HEADER)))
        disk.free()
        last = aggregate(cmd)
        got = read_csv(csv)
    assert refused.returncode == 1, refused.stderr
    assert refused.stderr.endswith(f"hami-usage aggregate: cannot write {csv}: {disk.strerror}\n")
    assert "Traceback" not in refused.stderr
    assert last.returncode == 0, last.stderr
    assert got == csv_lines(reference(msgs))


def test_a_file_sink_the_disk_refuses_is_closed_all_the_same(tmp_path: Path) -> None:
    """What it holds in its buffer cannot be written: close raises the disk's error and the
    file is closed (its descriptor was kept)."""
    records = reference(build(tmp_path / "nodes", T0_MS, SMALL, ("node-a",)))[:4]
    with full_disk(tmp_path / "disk", size=1024 * 1024) as disk:
        path = disk.directory / "out.jsonl"
        disk.attach(os.getpid())
        sink = JsonlSink(path)
        try:
            disk.fill()  # (the file is empty: no room in a page of its own, a limit of 0)
            sink.write(records)  # (into the buffer)
            with pytest.raises(OSError) as refused:
                sink.close()
            sink.close()  # (closed: nothing to do)
        finally:
            disk.free()
        held = [fd for fd in os.listdir("/proc/self/fd") if held_path(fd) == str(path)]
        size = path.stat().st_size
    assert refused.value.errno == disk.errno
    assert (held, size) == ([], 0)


def held_path(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # (the listing's own descriptor, closed by now)
        return ""
