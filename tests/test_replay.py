"""`hami-usage replay`: the live run's records again, byte for byte, for a past range.

The live run is `hami-usage aggregate --drain` over a deterministic stream (`streams.py`, 5
minutes: windows 0..5 counted from the stream's start); replay then recomputes a range of it
from the same input - the local log, or the Kafka topic found by `offsets_for_times` - and its
CSV lines must be the live CSV's lines for the windows inside [from, to). Re-sent events (same
inc and seq) change nothing, live or in a replay.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
from streams import (
    T0_MS,
    WINDOW_FLAGS,
    Msg,
    Spec,
    build,
    create_topic,
    csv_lines,
    final_report,
    hami,
    produce,
    read_csv,
    recent_t0,
    reference,
    with_duplicates,
    write_local_log,
)

from collector.aggregate.records import iso_utc

SPEC = Spec()
MIN = 60_000
# (first window, end window) of the ranges replayed: one in the middle, one at the start, all.
RANGES = [(2, 4), (0, 2), (0, 6)]


def in_range(lines: list[str], t0: int, first: int, end: int) -> list[str]:
    """The lines whose window lies inside [t0 + first min, t0 + end min)."""
    starts = {iso_utc(t0 + k * MIN) for k in range(first, end)}
    return [ln for ln in lines if ln.split(",", 1)[0] in starts]


def replay(
    source: list[str], t0: int, first: int, end: int, out: Path
) -> tuple[list[str], dict[str, int]]:
    """The lines replayed, and the counters of replay's summary line."""
    proc = hami(
        "replay", *source, *WINDOW_FLAGS, "--csv", out,
        "--from", iso_utc(t0 + first * MIN), "--to", iso_utc(t0 + end * MIN),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.startswith("replay: "), proc.stderr
    lines = read_csv(out)
    written, counters = final_report(proc.stderr, "replay")
    assert written == len(lines)
    return lines, counters


def live_local(tmp_path: Path, msgs: list[Msg]) -> tuple[list[str], dict[str, int]]:
    log = tmp_path / "log"
    write_local_log(log, msgs)
    csv = tmp_path / "live.csv"
    proc = hami("aggregate", "--log", log, *WINDOW_FLAGS, "--csv", csv, "--drain")
    assert proc.returncode == 0, proc.stderr
    return read_csv(csv), final_report(proc.stderr)[1]


def check_local(tmp_path: Path, msgs: list[Msg], expected: list[str]) -> dict[str, int]:
    live, counters = live_local(tmp_path, msgs)
    assert live == expected
    for first, end in RANGES:
        src = ["--log", str(tmp_path / "log")]
        got, counted = replay(src, T0_MS, first, end, tmp_path / "r.csv")
        want = in_range(live, T0_MS, first, end)
        assert want, (first, end)
        assert got == want, (first, end)  # byte-identical lines, in the same order
        if (first, end) == (0, 6):  # everything: read and counted as the live run did
            assert counted == counters
    return counters


def test_replay_local_is_the_live_run(tmp_path: Path) -> None:
    msgs = build(tmp_path / "nodes", T0_MS, SPEC)
    counters = check_local(tmp_path, msgs, csv_lines(reference(msgs)))
    assert counters.get("duplicates", 0) == 0


def test_duplicates_local(tmp_path: Path) -> None:
    msgs = build(tmp_path / "nodes", T0_MS, SPEC)
    dup = with_duplicates(msgs)
    assert len(dup) > len(msgs) + 300
    counters = check_local(tmp_path, dup, csv_lines(reference(msgs)))
    assert counters["duplicates"] == len(dup) - len(msgs)


async def kafka_topic_with(bootstrap: str, topic: str, msgs: list[Msg]) -> None:
    await create_topic(bootstrap, topic, 3)
    await produce(bootstrap, topic, msgs)


def check_kafka(
    bootstrap: str, topic: str, tmp_path: Path, msgs: list[Msg], expected: list[str], t0: int
) -> dict[str, int]:
    asyncio.run(kafka_topic_with(bootstrap, topic, msgs))
    csv = tmp_path / "live.csv"
    proc = hami(
        "aggregate", "--kafka", bootstrap, "--topic", topic, "--billing-topic", f"{topic}.b",
        "--group", f"{topic}.g", "--instance", uuid.uuid4().hex[:8], *WINDOW_FLAGS,
        "--csv", csv, "--drain",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    counters = final_report(proc.stderr)[1]
    live = read_csv(csv)
    # One aggregator per partition: lines of one batch come from all of them, so the order
    # across nodes may differ from the reference; the lines may not.
    assert sorted(live) == sorted(expected)
    for first, end in RANGES:
        src = ["--kafka", bootstrap, "--topic", topic]
        got, counted = replay(src, t0, first, end, tmp_path / "r.csv")
        want = in_range(live, t0, first, end)
        assert want, (first, end)
        assert sorted(got) == sorted(want), (first, end)  # byte-identical lines
        assert got == sorted(got, key=lambda ln: ln.split(",")[:6])  # replay sorts them
        if (first, end) == (0, 6):
            assert counted == counters
    return counters


@pytest.mark.kafka
def test_replay_kafka_is_the_live_run(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    t0 = recent_t0(SPEC.seconds)
    msgs = build(tmp_path / "nodes", t0, SPEC)
    check_kafka(kafka_bootstrap, kafka_topic, tmp_path, msgs, csv_lines(reference(msgs)), t0)


@pytest.mark.kafka
def test_duplicates_kafka(kafka_bootstrap: str, kafka_topic: str, tmp_path: Path) -> None:
    t0 = recent_t0(SPEC.seconds)
    msgs = build(tmp_path / "nodes", t0, SPEC)
    dup = with_duplicates(msgs)
    expected = csv_lines(reference(msgs))
    counters = check_kafka(kafka_bootstrap, kafka_topic, tmp_path, dup, expected, t0)
    assert counters["duplicates"] == len(dup) - len(msgs)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--from", "yesterday", "--to", "2026-03-02T10:05:00Z"], "not an ISO-8601 time"),
        (["--from", "2026-03-02T10:00:00Z", "--to", "2026-03-02T10:05:00+01:00"], "after"),
        (["--from", "2026-03-02T10:00:00Z", "--to", "2026-03-02T10:00:00Z"], "after"),
        (["--from", "2026-03-02T10:05:00Z", "--to", "2026-03-02T10:00:00Z"], "after"),
        (["--from", "2026-03-02T10:00:00Z", "--to", "2026-03-02T10:05:00Z", "--no-csv"], ""),
    ],
)
def test_replay_usage_errors(tmp_path: Path, args: list[str], message: str) -> None:
    log = tmp_path / "log"
    log.mkdir()
    if "--no-csv" in args:
        args = [a for a in args if a != "--no-csv"]
        message = "--csv"
    else:
        args = [*args, "--csv", str(tmp_path / "r.csv")]
    proc = hami("replay", "--log", log, *args)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("hami-usage replay"), proc.stderr
    assert message in proc.stderr
    assert not (tmp_path / "r.csv").exists()


def test_replay_usage_errors_missing_log(tmp_path: Path) -> None:
    proc = hami(
        "replay", "--log", tmp_path / "nope", "--csv", tmp_path / "r.csv",
        "--from", "2026-03-02T10:00:00Z", "--to", "2026-03-02T10:05:00Z",
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr


def test_replay_without_a_broker_says_so_in_one_line(tmp_path: Path) -> None:
    proc = hami(
        "replay",
        "--kafka",
        "127.0.0.1:1",
        "--from",
        "2026-01-01T00:00:00",
        "--to",
        "2026-01-01T01:00:00",
        "--csv",
        tmp_path / "r.csv",
    )
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("hami-usage replay: no Kafka broker at 127.0.0.1:1 after 10 s")
    assert "Traceback" not in proc.stderr
