"""The aggregator's summary line: each record and window counted once per process across
rebalances (`tally`), future events per node, the OTLP exporter's counts."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import NamedTuple

import msgspec
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from streams import (
    T0_MS,
    WINDOW,
    WINDOW_FLAGS,
    Msg,
    Spec,
    build,
    committed_metadata,
    create_topic,
    hami,
    msg,
    sort_key,
    with_bad_input,
    with_duplicates,
    write_local_log,
)

from collector.aggregate.damage import DamageReport
from collector.aggregate.intake import InputStats
from collector.aggregate.records import BillingRecord
from collector.aggregate.service import (
    AggregateSettings,
    DamageWatch,
    report,
    run_kafka,
)
from collector.aggregate.tally import Tally
from collector.aggregate.windows import AggregateStats, Aggregator
from collector.events import (
    CollectorStarted,
    ContainerAppeared,
    DeviceLimit,
    Heartbeat,
    UsageRow,
    UsageSample,
    encode,
)

SPEC = Spec(seconds=200, exit_at=60, gone_at=130)


class Record(NamedTuple):
    """What `add_kafka_records` reads of an aiokafka ConsumerRecord."""

    offset: int
    key: bytes
    value: bytes
    timestamp: int


def with_strays(msgs: list[Msg]) -> list[Msg]:
    """`msgs` with a sample every 10 s of a container no one announced (node-x): its rows are
    counted in `unattributed_rows` when their window closes."""
    row = UsageRow(1, 1, 0, 1 << 20, 0, 0, 0, 0, 5)
    strays = [
        msg("node-x", UsageSample(1, 5, i, T0_MS + i * 10_000, 99, [row]))
        for i in range(SPEC.seconds // 10)
    ]
    return sorted([*msgs, *strays], key=lambda m: m.ts)  # (stable: each node's order kept)


def _input(tmp_path: Path) -> list[Record]:
    msgs = with_duplicates(with_bad_input(with_strays(build(tmp_path / "nodes", T0_MS, SPEC))))
    del msgs[len(msgs) // 2]  # a seq gap
    return [Record(i, m.key, m.value, m.ts) for i, m in enumerate(msgs)]


def _read(
    records: list[Record],
    revoke_after: set[int],
    batch: int = 300,
    abort_after: frozenset[int] = frozenset(),
) -> tuple[list[BillingRecord], Tally, list[int]]:
    """The service's loop on one partition: a batch, then a close and a commit; after the
    batches in `revoke_after` the partition is revoked and assigned back, read again from its
    commit. The commits after the batches in `abort_after` are refused (a membership lost):
    their records are dropped and the partition read again from the commit before. Also the
    offsets read again each time."""
    tally = Tally(WINDOW, InputStats())
    agg = tally.aggregator(0, 0)
    out: list[BillingRecord] = []
    again: list[int] = []
    pos = batches = 0
    committed = emitted = 0
    while pos < len(records):
        chunk = records[pos : pos + batch]
        tally.add(agg, 0, chunk)
        pos += len(chunk)
        handed = agg.advance()
        batches += 1
        aborted = batches in abort_after
        if not aborted:
            out += handed
            committed, emitted = agg.needed_offsets().get(0, pos), agg.emitted_until_ms
            tally.committed([(0, agg)])
        if aborted or batches in revoke_after:  # read again from the last commit
            (tally.abort if aborted else tally.revoke)(agg, 0)
            tally.input.damage.forget_source(0)
            agg = tally.aggregator(0, emitted)
            again.append(pos - committed)
            pos = committed
    out += agg.flush()
    counted = AggregateStats()
    for st in tally.stats([agg]):
        for name in st.__struct_fields__:
            setattr(counted, name, getattr(counted, name) + getattr(st, name))
    tally.gone = counted  # (the totals, for the comparison)
    tally.gone_future = tally.future_by_node([agg])
    return sorted(out, key=sort_key), tally, again


@pytest.mark.parametrize("revoke_after", [{2}, {3, 4}, {1, 4, 6}, {2, 3, 4, 5, 6, 7}])
def test_records_read_again_after_a_rebalance_count_once(
    tmp_path: Path, revoke_after: set[int]
) -> None:
    """A partition assigned back is read again from its commit: the same records, and every
    counter as one uninterrupted read counts it (the input's, the windows', the damage)."""
    records = _input(tmp_path)
    once, whole, none = _read(records, set())
    got, tally, again = _read(records, revoke_after)
    assert none == [] and len(again) == len(revoke_after) and min(again) > 0  # (read again)
    assert got == once
    assert tally.gone == whole.gone
    assert tally.gone.future_events == 1 and tally.gone.duplicates > 0
    assert tally.gone_future == whole.gone_future == {"node-a": 1}
    assert (tally.input.undecodable, tally.input.unknown_schema) == (1, 1)
    assert tally.input.damage.counts() == whole.input.damage.counts() == (0, 0, 0, 0, 1, 1)


@pytest.mark.parametrize("abort_after", [{2}, {3, 4}, {1, 5}])
def test_records_of_an_aborted_commit_count_once(tmp_path: Path, abort_after: set[int]) -> None:
    """A commit refused (the group dropped the replica): the records it carried are handed out
    again from the commit before, and counted then: every counter, `records` among them, as
    one uninterrupted read counts it (with `revoke`, the aborted records counted twice)."""
    records = _input(tmp_path)
    once, whole, _ = _read(records, set())
    got, tally, again = _read(records, {6}, abort_after=frozenset(abort_after))
    assert len(again) == len(abort_after) + 1 and min(again) > 0
    assert got == once
    assert tally.gone == whole.gone
    assert tally.gone.records == len(once)


def test_a_window_closed_again_counts_nothing_and_bills_the_same(tmp_path: Path) -> None:
    """`closed_before_ms`: the close across it is split there, and what the windows before
    it count is taken back; the records are those of a close in one go."""
    msgs = with_strays(build(tmp_path / "nodes", T0_MS, SPEC))

    def feed(agg: Aggregator) -> list[BillingRecord]:
        for i, m in enumerate(msgs):
            assert m.event is not None
            agg.add(m.node, m.event, offset=i, record_ts_ms=m.ts)
        return agg.advance() + agg.flush()

    whole = Aggregator(WINDOW)
    records = feed(whole)
    split = Aggregator(WINDOW, closed_before_ms=T0_MS + 120_000)
    assert feed(split) == records
    before = msgspec.structs.asdict(whole.stats)
    after = msgspec.structs.asdict(split.stats)
    assert after["records"] == before["records"] == len(records)
    # the stray samples at T0 + 0, 10, ..., 110 s are in the two windows closed again (T0
    # starts a window)
    assert before["unattributed_rows"] == SPEC.seconds // 10 == 20
    assert after["unattributed_rows"] == 20 - 12


def test_a_collectors_reported_drops_stay_after_its_partition_is_forgotten() -> None:
    damage = DamageReport()
    hb = Heartbeat(1, 7, 0, T0_MS, interval_ms=10_000, part=0, parts=1, containers=[], dropped=4)
    damage.see("n1", hb, source=1)
    later = Heartbeat(1, 7, 2, T0_MS, interval_ms=10_000, part=0, parts=1, containers=[], dropped=3)
    damage.see("n1", later, source=1)  # (a gap of one)
    damage.forget_source(1)  # (a partition assigned again)
    assert damage.dropped_by_collectors == 4
    assert damage.line().endswith("seq_gaps=1 seq_missing=1 (collectors reported 4 dropped)")


def test_a_head_gap_taken_back_by_a_read_again_stays_taken_back() -> None:
    """Two collectors of a node send side by side; the partition is read again from a commit
    between them. The head gap the read again counts is taken back, and so is the correction
    that later records made of it: seq_gaps=-1 before."""

    def hb(inc: int, seq: int, ts: int) -> Record:
        m = msg("n1", Heartbeat(1, inc, seq, ts, 10_000, 0, 1, []))
        return Record(0, m.key, m.value, m.ts)

    sent = [(1, 0), (1, 1), (2, 0), (1, 2), (2, 1), (2, 2), (1, 3), (2, 3)]
    records = [
        hb(inc, seq, T0_MS + 500 * i)._replace(offset=i) for i, (inc, seq) in enumerate(sent)
    ]
    tally = Tally(WINDOW, InputStats())
    agg = tally.aggregator(0, 0)
    tally.add(agg, 0, records[:6])
    tally.revoke(agg, 0)
    tally.input.damage.forget_source(0)
    tally.add(tally.aggregator(0, 0), 0, records[3:])  # from the commit at offset 3
    damage = tally.input.damage
    assert (damage.seq_gaps, damage.seq_missing, damage.line()) == (0, 0, "damage: none")


def test_the_summary_line_names_the_nodes_whose_events_came_from_the_future() -> None:
    st = AggregateStats(events=30, future_events=27)
    by_node = {"n1": 2, "n2": 9, "n3": 9, "n4": 1, "n5": 3, "n6": 2, "n7": 1}
    assert report("aggregate", InputStats(), [st], by_node, 0) == (
        "aggregate: 0 records events=30 future_events=27 "
        "(n2=9 n3=9 n5=3 n1=2 n6=2 and 2 more nodes); damage: none"
    )
    few = report("replay", InputStats(), [AggregateStats(future_events=3)], {"b": 1, "a": 2}, 4)
    assert few == "replay: 4 records future_events=3 (a=2 b=1); damage: none"


def test_a_node_ahead_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    agg = Aggregator(WINDOW)
    watch = DamageWatch(DamageReport(), WINDOW.max_skew_ms)
    for seq in range(3):
        ahead = UsageSample(1, 7, seq, T0_MS + 3_600_000, 0, [UsageRow(1, 1, 0, 1, 0, 0, 0, 0, 0)])
        agg.add("n2", ahead, record_ts_ms=T0_MS)
        with caplog.at_level(logging.WARNING):
            watch.check([agg])
    assert [r.getMessage() for r in caplog.records] == [
        "node n2: event refused, its time more than max_skew (30000 ms) after its record time "
        "(its clock runs ahead?); counted per node in future_events"
    ]


def test_the_summary_line_says_what_the_otlp_exporter_counted(tmp_path: Path) -> None:
    """After the last push: a collector that refuses every export; --drain still exits 0."""
    from otlp_receiver import OtlpReceiver

    write_local_log(tmp_path / "log", build(tmp_path / "nodes", T0_MS, Spec(seconds=90)))
    with OtlpReceiver() as receiver:
        receiver.fail_status = 400
        proc = hami("aggregate", "--log", str(tmp_path / "log"), *WINDOW_FLAGS, "--drain",
                    "--otlp", receiver.endpoint, "--csv", str(tmp_path / "o.csv"))  # fmt: skip
        attempts = receiver.attempts
    assert proc.returncode == 0, proc.stderr
    last = [ln for ln in proc.stderr.splitlines() if "aggregate: " in ln][-1]
    assert attempts >= 2  # (one at least while it ran, and the last)
    assert last.endswith(f"; damage: none; otlp: exports={attempts} failed_exports={attempts}")


# --- a rebalance on the real broker ----------------------------------------------------------


def _events(now: int) -> list[tuple[int, bytes, bytes]]:
    """(partition, key, value): on 0 node n1, whose container's sample keeps its commit back
    (read again at each assignment), a seq gap and undecodable bytes; on 1 node n2, only events
    an hour ahead (refused: its commit is past them, they are never read again) and a heartbeat
    saying it dropped 4."""
    gpu = [DeviceLimit(0, "GPU-1", 1 << 30, 50)]
    n1 = [
        CollectorStarted(v=1, inc=7, seq=0, ts=now, host="h", pid=1, log="/l"),
        ContainerAppeared(1, 7, 1, now, 0, pod_uid="p", container="c", path="/x", layout="v1.2",
                          devices=gpu),
        UsageSample(1, 7, 3, now, 0, [UsageRow(1, 100, 0, 1000, 0, 0, 0, 0, 10)]),
    ]  # fmt: skip
    ahead = now + 3_600_000
    n2 = [
        UsageSample(v=1, inc=9, seq=i, ts=ahead, cid=0, rows=[UsageRow(1, 1, 0, 1, 0, 0, 0, 0, 0)])
        for i in range(5)
    ]
    hb = Heartbeat(1, 9, 5, ahead, interval_ms=10_000, part=0, parts=1, containers=[], dropped=4)
    return [
        *((0, b"n1", encode(e)) for e in n1),
        (0, b"n1", b"\xc1garbage"),
        *((1, b"n2", encode(e)) for e in [*n2, hb]),
    ]


@pytest.mark.kafka
def test_a_rebalance_keeps_what_the_revoked_partitions_counted(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Another member joins the group and leaves (subscribed to another topic: both partitions
    are revoked and assigned back to the replica, twice); its summary line counts each record
    once, keeps the revoked partitions' counts and the collectors' reported drops."""
    group = f"{kafka_topic}.g"
    settings = AggregateSettings(
        window=WINDOW, kafka=kafka_bootstrap, topic=kafka_topic,
        billing_topic=f"{kafka_topic}.billing", group=group, log_dir=tmp_path,
    )  # fmt: skip

    async def scenario() -> None:
        await create_topic(kafka_bootstrap, kafka_topic, 2)
        await create_topic(kafka_bootstrap, f"{kafka_topic}.billing", 1)
        await create_topic(kafka_bootstrap, f"{kafka_topic}.other", 1)
        producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap)
        await producer.start()
        for partition, key, value in _events(int(time.time() * 1000)):
            await producer.send_and_wait(kafka_topic, value, key=key, partition=partition)
        await producer.stop()
        stop = asyncio.Event()
        replica = asyncio.create_task(run_kafka(settings, stop))
        deadline = time.monotonic() + 30
        while (await committed_metadata(kafka_bootstrap, group)).get(1, (0,))[0] != 6:
            assert time.monotonic() < deadline and not replica.done()
            await asyncio.sleep(0.2)
        other = AIOKafkaConsumer(
            f"{kafka_topic}.other", bootstrap_servers=kafka_bootstrap, group_id=group
        )
        await other.start()  # (joined: the replica's partitions were revoked, given back)
        await asyncio.sleep(2)
        await other.stop()  # and again
        deadline = time.monotonic() + 60
        while len(assignments()) < 3:
            assert time.monotonic() < deadline and not replica.done()
            await asyncio.sleep(0.2)
        stop.set()
        await replica

    mine = f"TopicPartition(topic='{kafka_topic}', partition=1)"  # (not the other member's)

    def assignments() -> list[logging.LogRecord]:
        return [
            r
            for r in caplog.records
            if r.getMessage().startswith("Setting newly") and mine in r.getMessage()
        ]

    with caplog.at_level(logging.INFO):
        asyncio.run(scenario())
    assert len(assignments()) == 3
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("aggregate: ")]
    assert line == (
        "aggregate: 0 records events=9 future_events=6 (n2=6) undecodable=1 unknown_schema=0; "
        "damage: corrupt_frames=0 missing_records=0 missing_segments=0 torn_tail_bytes=0 "
        "seq_gaps=1 seq_missing=1 (collectors reported 4 dropped)"
    )
