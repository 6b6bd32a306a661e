"""Damaged input is never a silently different bill.

A local log of the deterministic stream (streams.py) is damaged the ways an operator's bad day
does it; `aggregate --drain` and `replay` then either bill exactly what the intact log bills or
exit 3 with one summary line naming the damage (0 with `--accept-damaged`, the line still
there). A damaged or future checkpoint is one line and exit 4. Seq gaps are found from the
stream alone, so the Kafka path reports them too.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
from streams import (
    T0_MS,
    WINDOW_FLAGS,
    Msg,
    Spec,
    build,
    create_topic,
    csv_lines,
    hami,
    produce,
    read_csv,
    recent_t0,
    reference,
)
from test_windows import Collector, row, state

from collector.aggregate.damage import EXIT_CHECKPOINT, EXIT_DAMAGED, DamageReport
from collector.aggregate.records import iso_utc
from collector.events import (
    MAX_LABELS,
    MAX_NODE_DEVICES,
    DeviceLimit,
    DeviceUsageRow,
    Event,
    Identity,
    PodIdentity,
)
from collector.replay import missing_history
from collector.transport.locallog import LocalLog, LogReader

SPEC = Spec(seconds=240)
NODES = ("node-a", "node-b")
SEGMENT = 48 * 1024
FROM, TO = "2026-03-02T10:00:00Z", "2026-03-02T10:04:00Z"
_DAMAGE = re.compile(
    r"damage: corrupt_frames=(\d+) missing_records=(\d+) missing_segments=(\d+) "
    r"torn_tail_bytes=(\d+) seq_gaps=(\d+) seq_missing=(\d+)"
)


@pytest.fixture(scope="module")
def stream(tmp_path_factory: pytest.TempPathFactory) -> list[Msg]:
    return build(tmp_path_factory.mktemp("nodes"), T0_MS, SPEC, NODES)


def write_log(directory: Path, msgs: list[Msg]) -> list[int]:
    with LocalLog(directory, segment_bytes=SEGMENT) as log:
        for m in msgs:
            assert log.append(m.key, m.value, m.ts) is not None
    return sorted(int(p.name[:20]) for p in directory.glob("*.log"))


def segment(directory: Path, base: int) -> Path:
    return directory / f"{base:020d}.log"


def cut_newest_half(log: Path, bases: list[int]) -> str:
    path = segment(log, bases[-1])
    data = path.read_bytes()
    at = len(data) // 2
    path.write_bytes(data[:at])
    if LogReader(log).torn_tail() == 0:  # the half fell on a frame boundary: one byte more
        path.write_bytes(data[: at - 1])
    return "torn_tail_bytes"


def flip_newest(log: Path, bases: list[int]) -> str:
    path = segment(log, bases[-1])
    data = bytearray(path.read_bytes())
    for at in range(len(data) // 4, len(data) // 2, 997):
        data[at] ^= 0xA5
    path.write_bytes(bytes(data))
    return "corrupt_frames"


def delete_middle(log: Path, bases: list[int]) -> str:
    segment(log, bases[len(bases) // 2]).unlink()
    return "missing_segments"


def huge_length(log: Path, bases: list[int]) -> str:
    path = segment(log, bases[len(bases) // 2])
    data = bytearray(path.read_bytes())
    data[0:4] = (0xFFFFFF00).to_bytes(4, "little")  # the segment's first frame
    path.write_bytes(bytes(data))
    return "corrupt_frames"


DAMAGES: dict[str, Callable[[Path, list[int]], str]] = {
    "cut_newest_half": cut_newest_half,
    "flip_newest": flip_newest,
    "delete_middle": delete_middle,
    "huge_length": huge_length,
}


def damage_of(stderr: str) -> dict[str, int]:
    m = _DAMAGE.search(stderr)
    assert m, stderr[-3000:]
    names = [
        "corrupt_frames",
        "missing_records",
        "missing_segments",
        "torn_tail_bytes",
        "seq_gaps",
        "seq_missing",
    ]
    return dict(zip(names, map(int, m.groups()), strict=True))


def aggregate(log: Path, csv: Path, *extra: str) -> tuple[int, str]:
    proc = hami("aggregate", "--log", log, *WINDOW_FLAGS, "--csv", csv, "--drain", *extra)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, proc.stderr


def replay(log: Path, csv: Path, *extra: str, to: str = TO) -> tuple[int, str]:
    proc = hami(
        "replay", "--log", log, "--from", FROM, "--to", to, *WINDOW_FLAGS, "--csv", csv, *extra
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, proc.stderr


def test_intact_log_says_no_damage(tmp_path: Path, stream: list[Msg]) -> None:
    log = tmp_path / "log"
    assert len(write_log(log, stream)) >= 5
    rc, err = aggregate(log, tmp_path / "a.csv")
    assert rc == 0, err
    assert "damage: none" in err
    assert read_csv(tmp_path / "a.csv") == csv_lines(reference(stream))
    rc, err = replay(log, tmp_path / "r.csv")
    assert rc == 0, err
    assert "damage: none" in err


def test_an_event_kind_from_a_newer_collector_is_undecodable_and_its_seq_a_gap(
    tmp_path: Path, stream: list[Msg]
) -> None:
    """A collector newer than its aggregator may send a kind the aggregator does not know,
    with schema version 1 (README: upgrade the aggregators first). One of node-a's events, its
    tag made 99: counted undecodable, its seq missing, and `--drain` exits 3."""
    at = next(i for i, m in enumerate(stream) if m.key == b"node-a" and i > len(stream) // 2)
    raw = msgspec.msgpack.decode(stream[at].value)
    raw[0] = 99
    newer = Msg(stream[at].key, msgspec.msgpack.encode(raw), stream[at].ts)
    log = tmp_path / "log"
    write_log(log, [*stream[:at], newer, *stream[at + 1 :]])
    rc, err = aggregate(log, tmp_path / "a.csv")
    assert rc == EXIT_DAMAGED, err
    assert " undecodable=1 unknown_schema=0;" in err
    assert damage_of(err) == {
        "corrupt_frames": 0,
        "missing_records": 0,
        "missing_segments": 0,
        "torn_tail_bytes": 0,
        "seq_gaps": 1,
        "seq_missing": 1,
    }


def test_names_longer_than_any_collector_sends_are_undecodable(
    tmp_path: Path, stream: list[Msg]
) -> None:
    """A container name of 200 000 characters (any producer may write to the topic) made a
    billing record too large for the billing topic, which stopped the aggregator at every
    restart, and a key of any length was a node name. Both are undecodable now, and the
    nodes' bill is as without them; names at the bounds are taken (the other tests' events)."""
    hostile = Collector()
    huge = msgspec.structs.replace(hostile.appeared(T0_MS), container="\x01" * 200_000)
    long_key = Msg(b"n" * 256, msgspec.msgpack.encode(hostile.appeared(T0_MS)), T0_MS)
    # (and an empty pod UID, whose records were its GPU's node row: usage and limits merged)
    no_pod = Msg(b"node-a", msgspec.msgpack.encode(hostile.appeared(T0_MS, pod="")), T0_MS)
    # (and more devices than a cache file holds: each was kept for the container's life)
    many = hostile.limits(T0_MS, [DeviceLimit(i, f"GPU-{i}", 1, 1) for i in range(17)])
    many_devices = Msg(b"hostile", msgspec.msgpack.encode(many), T0_MS)
    # (and more labels than a collector copies: 2 400 made every record of the pod 5.4 MB)
    labels = {f"k{i}": "v" for i in range(MAX_LABELS + 1)}
    who = Identity("pod-h", "ns", "p", "Pod", "p", labels)
    many_labels = Msg(b"hostile", msgspec.msgpack.encode(PodIdentity(1, hostile.inc, 90,
                      T0_MS, who)), T0_MS)  # fmt: skip
    # (and more GPUs than a node lists: one sample of 40 000 cost 17 s)
    gpus = [DeviceUsageRow(f"GPU-{i}", 1, 1, 0) for i in range(MAX_NODE_DEVICES + 1)]
    many_gpus = Msg(b"hostile", msgspec.msgpack.encode(hostile.node(T0_MS, *gpus)), T0_MS)
    log = tmp_path / "log"
    write_log(log, [Msg(b"hostile", msgspec.msgpack.encode(huge), T0_MS), long_key, no_pod,
                    many_devices, many_labels, many_gpus, *stream])  # fmt: skip
    rc, err = aggregate(log, tmp_path / "a.csv", "--accept-damaged")
    assert rc == 0, err
    assert " undecodable=6 unknown_schema=0;" in err
    assert read_csv(tmp_path / "a.csv") == csv_lines(reference(stream))


@pytest.mark.parametrize("how", DAMAGES)
def test_damaged_log_exits_3_naming_the_damage(tmp_path: Path, stream: list[Msg], how: str) -> None:
    log = tmp_path / "log"
    bases = write_log(log, stream)
    kind = DAMAGES[how](log, bases)
    expected = csv_lines(reference(stream))

    rc, err = aggregate(log, tmp_path / "a.csv")
    assert rc == EXIT_DAMAGED, err
    found = damage_of(err)
    assert found[kind] > 0, found
    (line,) = [ln for ln in err.splitlines() if ln.startswith("hami-usage aggregate: input")]
    assert "--accept-damaged" in line
    # The damage changed the bill: that is why it must not exit 0 silently.
    assert read_csv(tmp_path / "a.csv") != expected

    rc, err = replay(log, tmp_path / "r.csv")
    assert rc == EXIT_DAMAGED, err
    assert damage_of(err)[kind] > 0

    rc, err = aggregate(log, tmp_path / "b.csv", "--group", "again", "--accept-damaged")
    assert rc == 0, err
    assert damage_of(err)[kind] > 0
    rc, err = replay(log, tmp_path / "r2.csv", "--accept-damaged")
    assert rc == 0, err


def test_replay_counts_only_the_damage_it_reads(tmp_path: Path, stream: list[Msg]) -> None:
    """Damage in the newest segment, after what replaying the first minute reads (it stops once
    that window has closed): its records are the intact log's, exit 0, no damage."""
    intact, log = tmp_path / "intact", tmp_path / "log"
    write_log(intact, stream)
    flip_newest(log, write_log(log, stream))
    first_minute = "2026-03-02T10:01:00Z"
    rc, err = replay(intact, tmp_path / "i.csv", to=first_minute)
    assert (rc, "damage: none" in err) == (0, True), err
    rc, err = replay(log, tmp_path / "r.csv", to=first_minute)
    assert (rc, "damage: none" in err) == (0, True), err
    assert read_csv(tmp_path / "r.csv") == read_csv(tmp_path / "i.csv") != []


def test_replay_of_a_log_that_no_longer_reaches_back_says_so(
    tmp_path: Path, stream: list[Msg]
) -> None:
    """The two oldest segments deleted (as the log's size bound does once every group has read
    them): the values in effect at the range's start may be gone, so the replay is not taken
    for complete (exit 3, the deleted offsets counted), unless --accept-damaged."""
    log = tmp_path / "log"
    bases = write_log(log, stream)
    for base in bases[:2]:
        segment(log, base).unlink()
    rc, err = replay(log, tmp_path / "r.csv")
    assert rc == EXIT_DAMAGED, err
    found = damage_of(err)
    assert (found["missing_records"], found["missing_segments"]) == (bases[2], 1), found
    rc, err = replay(log, tmp_path / "r2.csv", "--accept-damaged")
    assert rc == 0, err


def test_what_counts_as_history_deleted() -> None:
    """`missing_history(begin, first, first_ts, start)`: offsets deleted below `begin` count
    only when reading starts at the oldest record kept and that one is newer than the start,
    or nothing is kept at all."""
    assert missing_history(0, 0, 5_000, 1_000) == 0  # nothing was ever deleted
    assert missing_history(500, 500, 2_000, 1_000) == 500  # the oldest kept is too new
    assert missing_history(500, 500, None, 1_000) == 500  # everything deleted
    assert missing_history(500, 700, 2_000, 1_000) == 0  # older records kept: seen again
    assert missing_history(500, 700, None, 1_000) == 0  # all kept is older than the start


def test_the_lost_head_of_an_incarnation_begun_after_the_reader_came_in_is_a_gap() -> None:
    """A collector restarts on a full disk: its first 5 events (CollectorStarted among them)
    are dropped. A reader that read the node before it began saw where it began: a gap of 5,
    as for 5 events lost in the middle. A reader that comes in on the new incarnation alone
    cannot tell, and a node first read in another source is a different reader's start."""

    def damage(*runs: tuple[int, list[Event]]) -> tuple[int, int]:
        report = DamageReport()
        for source, events in runs:
            for e in events:
                report.see("n1", e, source)
        return report.seq_gaps, report.seq_missing

    a, b = Collector(inc=111), Collector(inc=222)
    old = [a.heartbeat(t, state(1, row(1, 100))) for t in range(0, 300_000, 30_000)]
    new = [b.heartbeat(t, state(1, row(1, 100))) for t in range(300_000, 600_000, 30_000)]
    assert damage((0, old + new[5:])) == (1, 5)
    assert damage((0, old + new[:2] + new[7:])) == (1, 5)
    assert damage((0, new[5:])) == (0, 0)
    assert damage((0, old), (1, new[5:])) == (0, 0)
    # Two collectors under one node name, both running when the reader came in: the older
    # sends after the newer's first event seen, so that one did not begin after the reader.
    side_by_side = [e for pair in zip(old[5:], new[5:], strict=True) for e in pair]
    assert damage((0, side_by_side)) == (0, 0)


def test_dropped_events_are_seq_gaps(tmp_path: Path, stream: list[Msg]) -> None:
    # The collector could not store some events (a full disk): the stream has holes in seq.
    holes = stream[:500] + stream[520:1000] + stream[1003:]
    log = tmp_path / "log"
    write_log(log, holes)
    rc, err = aggregate(log, tmp_path / "a.csv")
    assert rc == EXIT_DAMAGED, err
    found = damage_of(err)
    assert found["seq_missing"] == 23
    assert 2 <= found["seq_gaps"] <= 4  # the holes may span both nodes' incarnations
    assert found["corrupt_frames"] == found["missing_records"] == 0


@pytest.mark.kafka
def test_seq_gaps_on_the_kafka_path(kafka_bootstrap: str, kafka_topic: str, tmp_path: Path) -> None:
    t0 = recent_t0(SPEC.seconds)
    msgs = build(tmp_path / "nodes", t0, SPEC, NODES)
    node_a = [i for i, m in enumerate(msgs) if m.node == "node-a"]
    lost = set(node_a[300:307])
    asyncio.run(create_topic(kafka_bootstrap, kafka_topic, 2))
    asyncio.run(
        produce(kafka_bootstrap, kafka_topic, [m for i, m in enumerate(msgs) if i not in lost])
    )
    cmd = [
        "aggregate", "--kafka", kafka_bootstrap, "--topic", kafka_topic,
        "--billing-topic", f"{kafka_topic}.billing", "--group", f"{kafka_topic}.g",
        "--instance", uuid.uuid4().hex[:8], *WINDOW_FLAGS, "--drain",
    ]  # fmt: skip
    proc = hami(*cmd)
    assert proc.returncode == EXIT_DAMAGED, proc.stderr
    found = damage_of(proc.stderr)
    assert (found["seq_gaps"], found["seq_missing"]) == (1, 7)


@pytest.mark.kafka
def test_replay_of_a_topic_that_no_longer_reaches_back_says_so(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    """The usage topic's oldest 500 records of one partition deleted (retention): replaying
    the whole stream cannot see what was in effect at its start, and says so (exit 3)."""
    from aiokafka import TopicPartition
    from aiokafka.admin import AIOKafkaAdminClient, RecordsToDelete

    t0 = recent_t0(SPEC.seconds)
    asyncio.run(create_topic(kafka_bootstrap, kafka_topic, 1))
    asyncio.run(produce(kafka_bootstrap, kafka_topic, build(tmp_path / "nodes", t0, SPEC, NODES)))

    async def delete_oldest() -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
        await admin.start()
        try:
            await admin.delete_records({TopicPartition(kafka_topic, 0): RecordsToDelete(500)})
        finally:
            await admin.close()

    span = ["--from", iso_utc(t0), "--to", iso_utc(t0 + 4 * 60_000)]
    cmd = ["replay", "--kafka", kafka_bootstrap, "--topic", kafka_topic, *WINDOW_FLAGS, *span]
    whole = hami(*cmd, "--csv", tmp_path / "whole.csv")
    assert whole.returncode == 0 and "damage: none" in whole.stderr, whole.stderr
    asyncio.run(delete_oldest())
    cut = hami(*cmd, "--csv", tmp_path / "cut.csv")
    assert cut.returncode == EXIT_DAMAGED, cut.stderr
    found = damage_of(cut.stderr)
    assert (found["missing_records"], found["missing_segments"]) == (500, 1), found


def checkpoint_file(log: Path) -> Path:
    return log / "consumers" / "hami-usage-aggregator.json"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"{not json", "unreadable"),
        (b'{"offset": -5}', "unreadable"),
        (b'{"offset": 10, "metadata": "garbage"}', "unreadable metadata"),
        # the right shape, values no aggregator writes: each was a traceback, exit 1
        (
            b'{"offset": 10, "metadata": "{\\"csv_bytes\\": -7}"}',
            "Expected `int` >= -1 - at `$.csv_bytes`",
        ),
        (
            b'{"offset": 10, "metadata": "{\\"replicas\\": {\\"0\\": [-7, -1]}}"}',
            "Expected `int` >= -1 - at `$.replicas[...][0]`",
        ),
        (
            b'{"offset": 10, "metadata": "{\\"emitted_until_ms\\": 99999999999999999999}"}',
            "unreadable metadata",
        ),
        (
            b'{"offset": 10, "metadata": "{\\"emitted_until_ms\\": -99999999999999999}"}',
            "Expected `int` >= 0 - at `$.emitted_until_ms`",
        ),
        (b'{"offset": 99999999, "metadata": ""}', "beyond the end of the log"),
    ],
)
def test_damaged_or_future_checkpoint_is_one_line_and_exit_4(
    tmp_path: Path, stream: list[Msg], content: bytes, message: str
) -> None:
    log = tmp_path / "log"
    write_log(log, stream[:2000])
    rc, err = aggregate(log, tmp_path / "a.csv")
    assert rc == 0, err
    checkpoint = msgspec.json.decode(checkpoint_file(log).read_bytes())
    assert checkpoint["offset"] > 0
    checkpoint_file(log).write_bytes(content)
    before = (tmp_path / "a.csv").read_bytes()
    proc = hami("aggregate", "--log", log, *WINDOW_FLAGS, "--csv", tmp_path / "a.csv", "--drain")
    assert proc.returncode == EXIT_CHECKPOINT, proc.stderr
    assert "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("hami-usage aggregate: checkpoint of group hami-usage-aggregator")
    assert message in line
    assert (tmp_path / "a.csv").read_bytes() == before  # nothing was done
