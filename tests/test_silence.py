"""The record time the service tells a partition read to its end (`aggregate/silence.py`): its
own newest record time moved on by the monotonic time since, never another partition's record
time or the wall clock."""

from __future__ import annotations

import asyncio
import csv
import io
import logging
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from streams import (
    HAMI_USAGE,
    T0_MS,
    WINDOW,
    build,
    create_topic,
    csv_lines,
    env,
    final_report,
    read_csv,
    reference,
    write_local_log,
)
from test_windows import Collector, row, state

from collector.aggregate.records import BillingRecord, iso_ms
from collector.aggregate.service import AggregateSettings, run_local
from collector.aggregate.silence import Silence
from collector.aggregate.windows import Aggregator, WindowSettings
from collector.layout.declarations import V12
from collector.simulate import SimDevice, new_cache_file


class Clock:
    def __init__(self) -> None:
        self.s = 100.0

    def __call__(self) -> float:
        return self.s


def test_a_source_moves_on_from_its_newest_record_by_the_time_it_was_seen_at_its_end() -> None:
    clock = Clock()
    silence = Silence(clock)
    assert silence.now_ms("p0") is None  # nothing read: nothing to say
    silence.read("p0", 5_000)
    clock.s += 2.5
    assert silence.now_ms("p0") == 5_000  # not seen at its end since: a stall, an outage
    silence.at_end("p0")
    assert silence.now_ms("p0") == 7_500
    clock.s += 60.0  # not seen since (the broker does not answer): no more
    assert silence.now_ms("p0") == 7_500
    silence.at_end("p0")  # a sighting 60 s after the last: that time is not counted
    assert silence.now_ms("p0") == 7_500
    clock.s += 1.0
    silence.read("p0", 4_000)  # an older record time (a node behind): the newest stays
    silence.at_end("p0")
    assert silence.now_ms("p0") == 8_500
    silence.read("p0", 69_000)
    clock.s += 0.25
    silence.at_end("p0")
    assert silence.now_ms("p0") == 69_250
    silence.read("p1", 1_000_000)  # another source's time is its own
    assert silence.now_ms("p0") == 69_250
    silence.forget("p0")
    assert silence.now_ms("p0") is None and silence.now_ms("p1") == 1_000_000


# The README defaults: a silent node stops holding its partition back after 600 s.
DEFAULTS = WindowSettings(
    window_ms=60_000, lateness_ms=10_000, max_gap_ms=90_000, max_skew_ms=300_000, idle_ms=600_000
)
T0 = 1_800_000_000_000


def node_a_records(ahead_s: int, live: bool) -> tuple[list[BillingRecord], int]:
    """Node A (partition 0, its clock right) and node B (partition 1, its clock `ahead_s`
    ahead), a heartbeat a second each for 30 minutes, read as the service's loop reads them
    (one record of each partition per second, both read to their end). `live`: the service's
    idle calls, else none (a replay). A's container records, and its late events."""
    aggs = {0: Aggregator(DEFAULTS), 1: Aggregator(DEFAULTS)}
    a, b = Collector(inc=1), Collector(inc=2)
    clock = Clock()
    silence = Silence(clock)
    out: list[BillingRecord] = []
    for s in range(1800):
        t, tb = T0 + s * 1000, T0 + (s + ahead_s) * 1000
        mib = 100 + (s // 60) * 10  # A's memory changes every minute
        ea = a.heartbeat(t, state(1, row(1, mib << 20)))
        eb = b.heartbeat(tb, state(1, row(1, 1 << 20), pod="pod-b"))
        aggs[0].add("A", msgspec.structs.replace(ea, interval_ms=1000), offset=s, record_ts_ms=t)
        aggs[1].add("B", msgspec.structs.replace(eb, interval_ms=1000), offset=s, record_ts_ms=tb)
        silence.read(0, t)
        silence.read(1, tb)
        clock.s += 1.0
        for source, agg in aggs.items():
            silence.at_end(source)
            if live and (now_ms := silence.now_ms(source)) is not None:
                agg.idle(now_ms)
            out += agg.advance()
    for agg in aggs.values():
        out += agg.flush()
    return [r for r in out if r.node == "A" and r.kind == "container"], aggs[0].stats.late_events


def test_a_node_whose_clock_runs_ahead_in_another_partition_closes_nothing_of_this_one() -> None:
    """Before, the service told every partition read to its end the newest record time of
    any partition: with B 700 s ahead (more than `idle`), A turned idle at every read and was
    billed 8.8 GiB-s in 2 records, 1 799 of its events late, instead of 464.6 GiB-s in 32."""
    replayed, late = node_a_records(700, live=False)
    assert late == 0 and len(replayed) == 32
    # a minute of each value, and the last one until max_gap after its heartbeat at 1 799 s
    mib_s = 60 * sum(100 + 10 * m for m in range(30)) + 390 * 89
    assert sum(r.memory_byte_seconds for r in replayed) == mib_s << 20
    assert node_a_records(700, live=True) == (replayed, 0)
    assert node_a_records(0, live=True) == (replayed, 0)


def one_partition_records(live: bool) -> tuple[list[BillingRecord], int]:
    """One partition: node A, its clock right, and node B, its clock 290 s ahead (within
    max_skew), a heartbeat a second each, record times their own clocks; both collectors stop
    at 821 s, A comes back at 1425 s and B at 1700 s. 300 s windows, the other settings the
    README's. `live`: the service's idle calls (the partition seen at its end each second
    while quiet), else none (a replay). Every record, and the late events."""
    settings = msgspec.structs.replace(DEFAULTS, window_ms=300_000)
    agg = Aggregator(settings)
    a, b = Collector(inc=1), Collector(inc=2)
    clock = Clock()
    silence = Silence(clock)
    out: list[BillingRecord] = []
    for s in range(2400):
        for node, c, ahead, back in (("A", a, 0, 1425), ("B", b, 290, 1700)):
            if 821 <= s < back:
                continue
            t = T0 + (s + ahead) * 1000
            e = c.heartbeat(t, state(1, row(1, (100 + s // 60) << 20), pod=f"pod-{node}"))
            agg.add(node, msgspec.structs.replace(e, interval_ms=1000), offset=2 * s + ahead % 2,
                    record_ts_ms=t)  # fmt: skip
            silence.read(0, t)
        clock.s += 1.0
        silence.at_end(0)
        if live and (now_ms := silence.now_ms(0)) is not None:
            agg.idle(now_ms)
        out += agg.advance()
    return out + agg.flush(), agg.stats.late_events


def test_a_quiet_partition_whose_newest_record_came_from_a_clock_ahead_closes_as_a_replay() -> None:
    """The silence moved the partition's newest record time on, but that time was B's, 290 s
    ahead: A turned idle 290 s of silence early, then B too, and A's events when it came back
    were late in the live run and in time in a replay (48 records against 51, A billed 3.8 %
    less). The next record cannot come before A's own last one moved on by the silence."""
    replayed, late = one_partition_records(live=False)
    assert one_partition_records(live=True) == (replayed, late)
    assert len(replayed) == 51


def test_a_live_aggregator_far_ahead_of_the_event_times_closes_no_window_early(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Events stamped long before the aggregator's wall clock (a node's clock behind, a
    suspend, a stepped clock; here: events of March) on the local log. Before, every read that
    found nothing new took the wall clock for record time: the nodes turned idle, their windows
    closed, and the rest of their events were late. Now the live run, stopped after the second
    half and finished by a drain, writes the records of one uninterrupted drain."""
    msgs = build(tmp_path / "nodes", T0_MS)
    half = len(msgs) // 2
    assert half < 5000  # (one read takes it all: the next read finds nothing new)
    log, out = tmp_path / "log", tmp_path / "b.csv"
    write_local_log(log, msgs[:half])

    def settings(drain: bool) -> AggregateSettings:
        return AggregateSettings(
            window=WINDOW, kafka=None, topic="t", billing_topic="b", group="g", log_dir=log,
            csv=str(out), drain=drain,
        )  # fmt: skip

    async def live() -> None:
        s, stopping = settings(False), asyncio.Event()
        task = asyncio.create_task(run_local(s, stopping))

        async def turns(n: int) -> None:
            until = s.liveness.beats + n
            while s.liveness.beats < until:
                assert not task.done()
                await asyncio.sleep(0.02)

        await turns(3)  # the first half read, then at least one read that found nothing new
        await asyncio.to_thread(write_local_log, log, msgs[half:])
        await turns(3)
        stopping.set()
        await task

    with caplog.at_level(logging.INFO, logger="collector.aggregate.service"):
        asyncio.run(live())
        (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("aggr")]
        assert "late_events" not in line, line
        asyncio.run(run_local(settings(True), asyncio.Event()))
    assert read_csv(out) == csv_lines(reference(msgs))


WINDOWS = ["--window", "2", "--lateness", "1", "--max-gap", "4", "--max-skew", "2", "--idle", "7"]


def live_pair(bootstrap: str, topic: str, tmp_path: Path) -> tuple[Any, Any, Any]:
    """A collector of one container sending to `topic` and a live aggregator of it into
    `b.csv` (windows of 2 s, idle 7 s); and the container's cache writer."""
    asyncio.run(create_topic(bootstrap, topic, 1))
    root = tmp_path / "root"
    root.mkdir()
    w = new_cache_file(root, "pod-1", "main", V12, [SimDevice("GPU-1", 8 << 30, 100)])
    w.add_process(100, 4100)
    w.add_memory(100, 0, "context", 64 << 20)
    collect = subprocess.Popen(
        [str(HAMI_USAGE), "collect", "--root", str(root), "--log", str(tmp_path / "spool"),
         "--node", "n1", "--no-nvml", "--no-kubernetes", "--interval", "0.5", "--heartbeat", "1",
         "--kafka", bootstrap, "--topic", topic],
        env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    aggregate = subprocess.Popen(
        [str(HAMI_USAGE), "aggregate", "--kafka", bootstrap, "--topic", topic,
         "--billing-topic", f"{topic}.billing", "--group", f"{topic}.g",
         "--csv", str(tmp_path / "b.csv"), *WINDOWS],
        env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    return collect, aggregate, w


def window_ends(out: Path) -> list[str]:
    """The `window_end` of each container record written so far."""
    if not out.exists():
        return []
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    return [r["window_end"] for r in rows if r.get("kind") == "container"]


def until(what: Callable[[], bool], proc: Any, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not what():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.2)


def stop(collect: Any, aggregate: Any, w: Any) -> str:
    aggregate.send_signal(signal.SIGCONT)
    aggregate.terminate()
    _, stderr = aggregate.communicate(timeout=60)
    collect.terminate()
    collect.wait(60)
    w.close()
    assert aggregate.returncode == 0, stderr[-3000:]
    return str(stderr)


@pytest.mark.kafka
def test_a_partition_whose_nodes_all_fall_silent_closes_its_windows_after_idle(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    """The only collector stops: once its partition has been seen at its end for `idle` (7 s),
    the windows it held open close, each value to its max_gap cap, as `--drain` or its next
    record would close them. Before, a partition closed on other partitions' record time: with
    none (every node gone, a one-partition topic) its last windows waited for new traffic."""
    collect, aggregate, w = live_pair(kafka_bootstrap, kafka_topic, tmp_path)
    out = tmp_path / "b.csv"
    try:
        until(lambda: len(window_ends(out)) >= 2, aggregate, 120)
        collect.terminate()
        assert collect.wait(60) == 0
        stopped = time.time()
        # its last values held max_gap (4 s) past its last event: windows up to then close
        until(lambda: iso_ms(max(window_ends(out))) > (stopped + 2) * 1000, aggregate, 60)
    finally:
        stderr = stop(collect, aggregate, w)
    _, counters = final_report(stderr)
    assert counters.get("late_events", 0) == 0, counters


@pytest.mark.kafka
def test_an_aggregator_stopped_longer_than_idle_bills_what_came_meanwhile(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    """A live collector sends; the aggregator is stopped (SIGSTOP: a paused pod, a frozen VM)
    for longer than `idle`. It has not seen its partition at its end meanwhile, so that time is
    not silence: what was sent meanwhile is billed, none of it late. It was stopped past its
    group session too: it carries on, and stops with exit 0 when told to."""
    collect, aggregate, w = live_pair(kafka_bootstrap, kafka_topic, tmp_path)
    out = tmp_path / "b.csv"
    try:
        until(lambda: len(window_ends(out)) >= 2, aggregate, 120)
        aggregate.send_signal(signal.SIGSTOP)
        time.sleep(12)  # longer than idle (7 s)
        aggregate.send_signal(signal.SIGCONT)
        closed = len(window_ends(out))
        until(lambda: len(window_ends(out)) >= closed + 3, aggregate, 60)
    finally:
        stderr = stop(collect, aggregate, w)
    written, counters = final_report(stderr)
    assert counters.get("late_events", 0) == 0, counters
    assert counters.get("records", 0) == written, counters  # each handed out once
    # Stopped past its session, the replica was dropped from its group; it rejoined and went
    # on from its checkpoint (a commit it tried before it rejoined was refused, most often,
    # and what that one wrote to the file was cut back).
    lines = read_csv(out)
    assert len(lines) == len(set(lines)), "a CSV line was written twice"
