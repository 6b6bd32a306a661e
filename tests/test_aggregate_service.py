"""`hami-usage aggregate` end to end, as a subprocess: the local log and the real broker.

The input is a deterministic stream (`streams.py`: 2 nodes x 3 containers x 2 processes x 2
devices, a sample every second for 5 minutes, heartbeats every 10 s, one process exit, one
container gone). The service's records must be the ones an `Aggregator` fed the same events in
this process gives, and a few are also worked out by hand from the stream's formulas.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import msgspec
import pytest
from streams import (
    HAMI_USAGE,
    SM_LIMIT,
    T0_MS,
    WINDOW_FLAGS,
    Msg,
    Spec,
    build,
    committed_metadata,
    create_topic,
    csv_lines,
    env,
    final_report,
    hami,
    limit_bytes,
    monitor_bytes,
    produce,
    read_billing,
    read_csv,
    recent_t0,
    reference,
    sm_percent,
    sort_key,
    total_bytes,
    totals,
    with_bad_input,
    write_local_log,
)

from collector.aggregate.parquet import day_of
from collector.aggregate.records import BillingRecord, make_record_id
from collector.aggregate.service import Checkpoint
from collector.transport.locallog import LogReader

SPEC = Spec()
NODES = ("node-a", "node-b")


def window_of(
    records: list[BillingRecord], t0: int, k: int, node: str, c: int, d: int
) -> BillingRecord:
    n = NODES.index(node)
    (hit,) = [
        r
        for r in records
        if r.window_start_ms == t0 + k * 60_000
        and r.node == node
        and r.container == f"ctr{c}"
        and r.device_uuid.startswith(f"GPU-{n:04d}{d:04d}")
    ]
    return hit


def by_hand(
    t0: int, k: int, n: int, c: int, d: int, seconds: range, procs: dict[int, range]
) -> dict[str, object]:
    """Window k of container c on device d of node n, from the formulas: every value holds
    exactly one second (the next sample comes a second later); `procs` says which seconds each
    process was live; the container is present during `seconds`."""
    mem = sum(total_bytes(n, c, p, d, s) for p, live in procs.items() for s in live)
    nvml = sum(monitor_bytes(n, c, p, d, s) for p, live in procs.items() for s in live)
    sm = sum(sm_percent(n, c, p, d, s) for p, live in procs.items() for s in live)
    peak = max(
        sum(total_bytes(n, c, p, d, s) for p, live in procs.items() if s in live) for s in seconds
    )
    return {
        "window_start_ms": t0 + k * 60_000,
        "memory_byte_seconds": float(mem),
        "nvml_memory_byte_seconds": float(nvml),
        "sm_percent_seconds": float(sm),
        "memory_limit_byte_seconds": float(limit_bytes(c, d) * len(seconds)),
        "sm_limit_percent_seconds": float(SM_LIMIT * len(seconds)),
        "peak_memory_bytes": peak,
        "observed_seconds": float(len(seconds)),
    }


def check_by_hand(records: list[BillingRecord], t0: int) -> None:
    def fields(r: BillingRecord, want: dict[str, object]) -> dict[str, object]:
        return {k: getattr(r, k) for k in want}

    # A quiet minute: node-a, container 0, device 0, window 1 = seconds [60, 120).
    live = range(60, 120)
    r = window_of(records, t0, 1, "node-a", 0, 0)
    want = by_hand(t0, 1, 0, 0, 0, live, {0: live, 1: live})
    assert fields(r, want) == want
    # 60 samples of 2 rows, and 6 heartbeats (s = 60, 70, ..., 110) restating both rows.
    assert r.samples == 2 * 60 + 6 * 2
    assert r.record_id == make_record_id(r.window_start_ms, "node-a", r.pod_uid, "ctr0",
                                         r.device_uuid)  # fmt: skip

    # The process exit: node-b, container 1, device 1, window 1; process 1 exits at s = 100.
    r = window_of(records, t0, 1, "node-b", 1, 1)
    want = by_hand(t0, 1, 1, 1, 1, live, {0: live, 1: range(60, 100)})
    assert fields(r, want) == want
    assert r.samples == 60 + 40 + 4 * 2 + 2 * 1

    # Container gone at s = 200: node-a, container 2, device 1, window 3 = [180, 240).
    r = window_of(records, t0, 3, "node-a", 2, 1)
    gone = range(180, 200)
    want = by_hand(t0, 3, 0, 2, 1, gone, {0: gone, 1: gone})
    assert fields(r, want) == want
    assert not [x for x in records if x.container == "ctr2" and x.window_start_ms >= t0 + 240_000]

    # The end of the stream: the samples of s = 299 hold for max_gap (30 s), so window 5 bills
    # [300, 329) of them and nothing after; no samples lie in it.
    r = window_of(records, t0, 5, "node-b", 0, 0)
    held = 29
    assert r.memory_byte_seconds == float(sum(total_bytes(1, 0, p, 0, 299) for p in (0, 1)) * held)
    assert r.observed_seconds == float(held)
    assert r.memory_limit_byte_seconds == float(limit_bytes(0, 0) * held)
    assert r.samples == 0
    assert max(x.window_end_ms for x in records) == t0 + 360_000


# --- local log ---------------------------------------------------------------------------


def local_run(tmp_path: Path, msgs: list[Msg]) -> tuple[Path, Path, Path, list[str]]:
    log = tmp_path / "log"
    write_local_log(log, msgs)
    csv, jsonl = tmp_path / "out.csv", tmp_path / "out.jsonl"
    cmd = ["aggregate", "--log", log, *WINDOW_FLAGS, "--csv", csv, "--jsonl", jsonl, "--drain"]
    return log, csv, jsonl, [str(x) for x in cmd]


def test_local_log_service(tmp_path: Path) -> None:
    msgs = build(tmp_path / "nodes", T0_MS, SPEC, NODES)
    log, csv, jsonl, cmd = local_run(tmp_path, msgs)
    expected = reference(msgs)
    assert len([r for r in expected if r.kind == "container"]) == 2 * (12 + 12 + 8)
    # and per node, GPU (2) and window (6): the GPU's record and its idle time
    assert len(expected) == 2 * (12 + 12 + 8) + 2 * 2 * 6 * 2
    # When windows are closed does not matter (the service advances after every batch).
    assert reference(msgs, advance_every=1) == reference(msgs, advance_every=250) == expected

    proc = hami(*cmd)
    assert proc.returncode == 0, proc.stderr
    written, counters = final_report(proc.stderr)
    assert written == len(expected)
    assert counters["events"] == len(msgs)
    assert counters["records"] == len(expected)
    for bad in ("duplicates", "late_events", "future_events", "undecodable", "unknown_schema"):
        assert counters.get(bad, 0) == 0, counters

    # One aggregator, records sorted within each batch and batches in window order: the CSV
    # is exactly the reference, line for line.
    lines = read_csv(csv)
    assert lines == csv_lines(expected)
    got = [msgspec.json.decode(x, type=BillingRecord) for x in jsonl.read_bytes().splitlines()]
    assert got == expected
    assert totals(got) == totals(expected)
    check_by_hand(got, T0_MS)

    # Again on the same log and group: the checkpoint holds, nothing new, files untouched.
    before = (csv.read_bytes(), jsonl.read_bytes())
    proc = hami(*cmd)
    assert proc.returncode == 0, proc.stderr
    assert final_report(proc.stderr)[0] == 0
    assert (csv.read_bytes(), jsonl.read_bytes()) == before


def with_reader_hook(cmd: list[str], method: str, hook: str) -> subprocess.CompletedProcess[str]:
    """`hami-usage *cmd` in a process whose `LogReader.<method>` runs `hook` (Python, with
    `call()` the real method on the same arguments) the first time it is called. `handled`
    is a threading.Event set once the event loop has run a signal handler of the service's."""
    code = (
        "import asyncio.unix_events, os, signal, threading\n"
        "from collector.cli import main\n"
        "handled = threading.Event()\n"
        "loop_class = asyncio.unix_events._UnixSelectorEventLoop\n"
        "add_handler = loop_class.add_signal_handler\n"
        "def handle(loop, sig, callback, *args):\n"
        "    return add_handler(loop, sig, lambda *a: (callback(*a), handled.set()), *args)\n"
        "loop_class.add_signal_handler = handle\n"
        "from collector.transport.locallog import LogReader\n"
        f"real = LogReader.{method}\n"
        "def first(self, *a, **k):\n"
        f"    LogReader.{method} = real\n"
        "    call = lambda: real(self, *a, **k)\n"
        f"    {hook}\n"
        f"LogReader.{method} = first\n"
        f"raise SystemExit(main({cmd!r}))\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def test_a_drain_stopped_by_a_signal_says_so_and_exits_1(tmp_path: Path) -> None:
    """SIGTERM before the end of the input (sent here at the first read of the log): what was
    written stands, and a later --drain finishes it, but the run is not the whole input (it
    exited 0 with a sixth of the records). The read returns once the event loop has taken the
    signal: it runs in a thread, and one that returned before read the whole log, the drain
    then finishing it (exit 0; seen once on a loaded machine)."""
    msgs = build(tmp_path / "nodes", T0_MS, SPEC, NODES)
    _, csv, _, cmd = local_run(tmp_path, msgs)
    hook = "os.kill(os.getpid(), signal.SIGTERM); assert handled.wait(60); return call()"
    proc = with_reader_hook(cmd, "read", hook)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.endswith(
        "hami-usage aggregate: --drain stopped before the end of the input\n"
    ), proc.stderr
    partial = len(read_csv(csv))
    assert 0 < partial < len(reference(msgs))
    again = hami(*cmd)  # the same drain, uninterrupted, finishes from the commit
    assert again.returncode == 0, again.stderr
    assert read_csv(csv) == csv_lines(reference(msgs))


@pytest.mark.parametrize("drain", [False, True])
def test_a_signal_while_waiting_for_the_broker_stops_at_once(tmp_path: Path, drain: bool) -> None:
    """No broker (a closed port): start-up waits up to 60 s for one, but SIGTERM ends the wait
    (it used to be ignored until the minute was up). A service stops with 0; a drain that read
    nothing did not finish its input: 1."""
    cmd = ["aggregate", "--kafka", "127.0.0.1:1", "--health-port", "0", "--csv", tmp_path / "o.csv"]
    proc = subprocess.Popen(
        [str(HAMI_USAGE), *map(str, cmd + (["--drain"] if drain else []))],
        stderr=subprocess.PIPE, text=True, env=env(),
    )  # fmt: skip
    assert proc.stderr is not None
    for line in proc.stderr:  # the health server starts after the signal handlers
        if "health on" in line:
            break
    time.sleep(1)  # well into the wait for the broker
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rest = proc.stderr.read()
    assert proc.wait(timeout=30) == (1 if drain else 0), rest
    assert time.monotonic() - started < 10
    assert "stopped while waiting for the broker at 127.0.0.1:1: nothing was read" in rest
    assert "Traceback" not in rest


def test_an_output_that_cannot_be_written_is_one_line_and_exit_1(tmp_path: Path) -> None:
    """A file where a Parquet day folder goes (or a full disk): a traceback before."""
    msgs = build(tmp_path / "nodes", T0_MS, SPEC, NODES)
    _, csv, _, cmd = local_run(tmp_path, msgs)
    parts = tmp_path / "pq"
    parts.mkdir()
    (parts / f"day={day_of(T0_MS)}").write_text("not a folder")
    proc = hami(*cmd, "--parquet", parts)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.endswith(
        f"hami-usage aggregate: cannot write {parts}/day={day_of(T0_MS)}: File exists\n"
    ), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_a_first_start_killed_at_its_first_commit_left_what_it_committed(
    tmp_path: Path,
) -> None:
    """A replica's first start commits its files' lengths at once: the CSV header counted in
    that length must be on disk by then (killed right after, the restart found the file
    shorter than its checkpoint and said so)."""
    msgs = build(tmp_path / "nodes", T0_MS, SPEC, NODES)
    _, csv, _, cmd = local_run(tmp_path, msgs)
    proc = with_reader_hook(cmd, "commit", "call(); os._exit(9)")
    assert proc.returncode == 9, proc.stderr
    committed = json.loads(LogReader(tmp_path / "log").committed("hami-usage-aggregator")[1])
    assert csv.stat().st_size == committed["csv_bytes"] > 0
    again = hami(*cmd)
    assert again.returncode == 0 and "shorter than its checkpoint" not in again.stderr
    assert read_csv(csv) == csv_lines(reference(msgs))


def test_local_log_bad_input(tmp_path: Path) -> None:
    good = build(tmp_path / "nodes", T0_MS, SPEC, NODES)
    msgs = with_bad_input(good)
    assert len(msgs) == len(good) + 3
    _, csv, _, cmd = local_run(tmp_path, msgs)
    proc = hami(*cmd)
    assert proc.returncode == 0, proc.stderr
    last = [ln for ln in proc.stderr.splitlines() if "aggregate: " in ln][-1]
    assert "undecodable=1 unknown_schema=1" in last and "future_events=1" in last, last
    written, counters = final_report(proc.stderr)
    expected = reference(good)
    assert written == len(expected)
    assert read_csv(csv) == csv_lines(expected)
    # The future event reached the aggregator (and was dropped there); the other two did not.
    assert counters["events"] == len(good) + 1


# --- Kafka -------------------------------------------------------------------------------


async def kafka_run(
    bootstrap: str, topic: str, tmp_path: Path, msgs: list[Msg]
) -> tuple[dict[str, int], list[str], Path, str]:
    await create_topic(bootstrap, topic, 3)
    partition_of = await produce(bootstrap, topic, msgs)
    group = f"{topic}.g"
    csv = tmp_path / "out.csv"
    cmd = [
        "aggregate", "--kafka", bootstrap, "--topic", topic, "--billing-topic",
        f"{topic}.billing", "--group", group, "--instance", uuid.uuid4().hex[:8],
        *WINDOW_FLAGS, "--csv", str(csv), "--drain",
    ]  # fmt: skip
    return partition_of, cmd, csv, group


@pytest.mark.kafka
def test_kafka_service(kafka_bootstrap: str, kafka_topic: str, tmp_path: Path) -> None:
    t0 = recent_t0(SPEC.seconds)
    msgs = build(tmp_path / "nodes", t0, SPEC, NODES)
    partition_of, cmd, csv, group = asyncio.run(
        kafka_run(kafka_bootstrap, kafka_topic, tmp_path, msgs)
    )
    expected = reference(msgs, source_of=partition_of)
    assert expected == reference(msgs)  # the split into partitions changes nothing here

    proc = hami(*cmd)
    assert proc.returncode == 0, proc.stderr
    written, counters = final_report(proc.stderr)
    assert written == len(expected)
    assert counters["events"] == len(msgs), "every message reached an aggregator, once"

    billing = asyncio.run(read_billing(kafka_bootstrap, f"{kafka_topic}.billing"))
    assert sorted(billing, key=sort_key) == expected
    assert len({r.record_id for r in billing}) == len(billing)
    check_by_hand(billing, t0)
    assert sorted(read_csv(csv)) == sorted(csv_lines(expected))

    # The offsets of the group were committed with the records, each with a Checkpoint.
    meta = asyncio.run(committed_metadata(kafka_bootstrap, group))
    assert set(meta) == {0, 1, 2}
    counts = {p: sum(1 for m in msgs if partition_of[m.node] == p) for p in range(3)}
    for p, (offset, text) in meta.items():
        cp = msgspec.json.decode(text, type=Checkpoint)
        assert cp.csv_bytes == csv.stat().st_size
        assert cp.jsonl_bytes == 0
        assert 0 <= offset <= counts[p]
        ends = [r.window_end_ms for r in expected if partition_of[r.node] == p]
        if ends:
            assert cp.emitted_until_ms == max(ends)
        else:
            assert (offset, cp.emitted_until_ms) == (0, 0)

    # Again: the checkpoint holds, no new billing records, the CSV is unchanged.
    before = csv.read_bytes()
    proc = hami(*cmd)
    assert proc.returncode == 0, proc.stderr
    assert final_report(proc.stderr)[0] == 0
    assert csv.read_bytes() == before
    assert len(asyncio.run(read_billing(kafka_bootstrap, f"{kafka_topic}.billing"))) == len(billing)


@pytest.mark.kafka
def test_kafka_bad_input(kafka_bootstrap: str, kafka_topic: str, tmp_path: Path) -> None:
    t0 = recent_t0(SPEC.seconds)
    good = build(tmp_path / "nodes", t0, SPEC, NODES)
    msgs = with_bad_input(good)
    partition_of, cmd, csv, _ = asyncio.run(kafka_run(kafka_bootstrap, kafka_topic, tmp_path, msgs))
    proc = hami(*cmd)
    assert proc.returncode == 0, proc.stderr
    last = [ln for ln in proc.stderr.splitlines() if "aggregate: " in ln][-1]
    assert "undecodable=1 unknown_schema=1" in last and "future_events=1" in last, last
    expected = reference(good, source_of=partition_of)
    billing = asyncio.run(read_billing(kafka_bootstrap, f"{kafka_topic}.billing"))
    assert sorted(billing, key=sort_key) == expected
    assert sorted(read_csv(csv)) == sorted(csv_lines(expected))


# --- OTLP through the service ------------------------------------------------------------


def test_local_log_service_pushes_otlp(tmp_path: Path) -> None:
    """`aggregate --otlp` against a real OTLP/HTTP receiver: the cumulative counters of the
    last push equal the sums of the billing records, per container and device."""
    from otlp_receiver import OtlpReceiver

    msgs = build(tmp_path / "nodes", T0_MS, SPEC, NODES)
    _, csv, _, cmd = local_run(tmp_path, msgs)
    expected = reference(msgs)
    with OtlpReceiver() as receiver:
        proc = hami(*cmd, "--otlp", receiver.endpoint)
        assert proc.returncode == 0, proc.stderr
        last = receiver.received[-1].metrics()
    usage = last["hami.gpu.memory.usage_byte_seconds"]
    assert usage.unit == "{By.s}" and usage.is_monotonic
    want: dict[tuple[str, str, str], float] = {}
    for r in expected:
        if r.kind in ("gpu", "idle"):  # a GPU's own records are not exported
            continue
        key = (r.pod_uid, r.container, r.device_uuid)
        want[key] = want.get(key, 0.0) + float(r.memory_byte_seconds)
    got = {
        (a["k8s.pod.uid"], a["k8s.container.name"], a["hw.id"]): v
        for attrs, v in usage.points.items()
        for a in [dict(attrs)]
    }
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-12), key
    assert read_csv(csv) == csv_lines(expected)


def test_no_otlp_pushes_nothing_even_where_the_config_file_names_an_endpoint(
    tmp_path: Path,
) -> None:
    """The aggregator's pod has `otlp` in its config file: a one-off `--drain` there pushed its
    totals as the live service's series (its instance is the pod's), and nothing on the
    command line turned that off (`--otlp ''` is refused)."""
    from otlp_receiver import OtlpReceiver

    msgs = build(tmp_path / "nodes", T0_MS, SPEC, NODES)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _, csv, _, quiet_cmd = local_run(tmp_path / "a", msgs)
    _, _, _, pushed_cmd = local_run(tmp_path / "b", msgs)
    with OtlpReceiver() as receiver:
        config = tmp_path / "config.toml"
        config.write_text(f'[aggregate]\notlp = "{receiver.endpoint}"\n')
        quiet = hami(*quiet_cmd, "--config", config, "--no-otlp")
        assert quiet.returncode == 0, quiet.stderr
        assert receiver.received == [] and "otlp:" not in quiet.stderr
        assert read_csv(csv) == csv_lines(reference(msgs))
        pushed = hami(*pushed_cmd, "--config", config)  # the file's endpoint, as before
        assert pushed.returncode == 0, pushed.stderr
        assert receiver.received


def test_first_start_keeps_what_the_file_held_and_commits_it(tmp_path: Path) -> None:
    """A group's first run appends to an existing file and at once commits its length, so a
    crash before the first window closes cuts back to exactly there on restart."""
    from collector.transport.locallog import LocalLog, LogReader

    log = tmp_path / "log"
    LocalLog(log).close()
    csv = tmp_path / "old.csv"
    csv.write_text("kept from before\n")
    proc = hami("aggregate", "--log", log, "--csv", csv, "--group", "g1", "--drain")
    assert proc.returncode == 0, proc.stderr
    assert csv.read_text() == "kept from before\n"
    committed = LogReader(log).committed("g1")
    assert committed is not None
    assert msgspec.json.decode(committed[1], type=Checkpoint).csv_bytes == len("kept from before\n")


def test_start_from_places_a_new_group_in_a_local_log(tmp_path: Path) -> None:
    """`--start-from` was read for Kafka only: a new group of a local log billed the whole log
    whatever it said. A time before 1970 is every record's, as for Kafka (where it was a
    traceback: Kafka takes no negative time). A time inside a window published that window from
    the input after the time, under the whole window's record_id."""
    from collector.aggregate.records import iso_utc

    log = tmp_path / "log"
    write_local_log(log, build(tmp_path / "nodes", T0_MS, Spec(seconds=240)))

    def aggregate(group: str, *extra: str) -> list[str]:
        out = tmp_path / f"{group}.csv"
        proc = hami("aggregate", "--log", log, *WINDOW_FLAGS, "--drain", "--group", group,
                    "--csv", out, *extra)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return read_csv(out)

    whole = aggregate("all")
    assert whole and aggregate("old", "--start-from", "1960-01-01T00:00:00Z") == whole
    assert aggregate("end", "--start-from", "latest") == []
    # A time inside a window: that window is not billed (its input before the time was not
    # read: it went out under the whole window's record_id with part of its values); every
    # window after is the record a group from the beginning bills, byte for byte.
    cut = T0_MS + 2 * 60_000 + 30_000
    later = aggregate("later", "--start-from", iso_utc(cut))
    assert later and min(line.split(",")[0] for line in later) == iso_utc(T0_MS + 3 * 60_000)
    assert set(later) == {line for line in whole if line.split(",")[0] >= iso_utc(cut)}
