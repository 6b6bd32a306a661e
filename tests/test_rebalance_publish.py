"""A rebalance while a replica is publishing (real broker, two replicas in one process): the
partition taken away mid-transaction leaves with the offsets of the records that transaction
published, so its next owner does not publish them again. aiokafka runs the rebalance listener
in its own task, at any await of the replica's loop; here the first billing send is held long
enough (10 s, past a heartbeat; 15 s, past the session timeout) for the second replica's join
to take a partition during it."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from streams import (
    WINDOW,
    build,
    create_topic,
    csv_lines,
    final_report,
    produce,
    read_billing,
    read_csv,
    recent_t0,
    reference,
    replica,
    sort_key,
)
from test_file_replicas import wait_group_empty

from collector.aggregate import service
from collector.aggregate.damage import CheckpointError
from collector.aggregate.service import AggregateSettings, run_kafka
from collector.transport import consumer as consumer_module

pytestmark = pytest.mark.kafka


def _replica(
    bootstrap: str, topic: str, tmp_path: Path, instance: str, drain: bool = False
) -> AggregateSettings:
    """Replica `instance` of group `<topic>.g` billing to `<topic>.billing`, CSV in tmp_path."""
    return AggregateSettings(
        window=WINDOW, kafka=bootstrap, topic=topic, billing_topic=f"{topic}.billing",
        group=f"{topic}.g", log_dir=tmp_path, csv=str(tmp_path / f"{instance}.csv"),
        instance=instance, drain=drain,
    )  # fmt: skip


REAL_SEND = AIOKafkaProducer.send


async def a_held_while_b_joins(
    bootstrap: str,
    topic: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    msgs: list[Any],
    hold_s: float,
) -> tuple[asyncio.Task[Any], asyncio.Task[Any], asyncio.Event, asyncio.Event]:
    """Replicas "a" and "b" of one group over `msgs` on 2 partitions: a's first
    transaction with records is held `hold_s` at its first billing send, and b starts while it
    is. Returns a, b, the event that stops both, and the event set when the hold is over."""
    billing = f"{topic}.billing"
    held, over = asyncio.Event(), asyncio.Event()

    async def send(self: AIOKafkaProducer, to: str, *args: Any, **kwargs: Any) -> Any:
        if to == billing and not held.is_set():
            held.set()
            await asyncio.sleep(hold_s)
            over.set()
        return await REAL_SEND(self, to, *args, **kwargs)

    await create_topic(bootstrap, topic, 2)
    await create_topic(bootstrap, billing, 1)
    await produce(bootstrap, topic, msgs)
    monkeypatch.setattr(AIOKafkaProducer, "send", send)
    stop = asyncio.Event()
    a = asyncio.create_task(run_kafka(_replica(bootstrap, topic, tmp_path, "a"), stop))
    await asyncio.wait_for(held.wait(), 60)
    b = asyncio.create_task(run_kafka(_replica(bootstrap, topic, tmp_path, "b"), stop))
    return a, b, stop, over


async def drain_once_empty(bootstrap: str, topic: str, tmp_path: Path) -> None:
    """One replica drains what is left, as in a redeployment (once the static members'
    sessions have expired: until then each keeps its partitions)."""
    AIOKafkaProducer.send = REAL_SEND  # type: ignore[method-assign]
    await wait_group_empty(bootstrap, f"{topic}.g")
    await run_kafka(_replica(bootstrap, topic, tmp_path, "a", drain=True), asyncio.Event())


def billed_once(bootstrap: str, topic: str, msgs: list[Any]) -> None:
    """Every record of `msgs` is on the billing topic, once."""
    got = sorted(asyncio.run(read_billing(bootstrap, f"{topic}.billing")), key=sort_key)
    ids = [r.record_id for r in got]
    assert len(ids) == len(set(ids)), f"{len(ids) - len(set(ids))} records published twice"
    assert got == sorted(reference(msgs), key=sort_key)


@pytest.mark.parametrize("hold_s", [10.0, 15.0])
def test_a_partition_revoked_mid_publish_is_billed_once(
    kafka_bootstrap: str,
    kafka_topic: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    hold_s: float,
) -> None:
    """15 s: longer than the session timeout, which aiokafka takes for the rebalance timeout
    unless told otherwise; the member was dropped mid-commit and its partitions given out
    with the offsets from before it."""

    msgs = build(tmp_path / "nodes", recent_t0(300))

    async def scenario() -> None:
        a, b, stop, over = await a_held_while_b_joins(
            kafka_bootstrap, kafka_topic, tmp_path, monkeypatch, msgs, hold_s
        )
        await over.wait()  # a's transaction goes on once the hold is over
        await asyncio.sleep(5)  # b catches up on what it was given
        stop.set()
        await asyncio.gather(a, b)
        await drain_once_empty(kafka_bootstrap, kafka_topic, tmp_path)

    asyncio.run(scenario())
    billed_once(kafka_bootstrap, kafka_topic, msgs)


def test_a_commit_held_past_the_rebalance_timeout_is_refused_not_billed_twice(
    kafka_bootstrap: str,
    kafka_topic: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """ "a"'s first transaction with records is held longer than the rebalance timeout (8 s
    here, 120 s in service) while "b" joins: the group drops a and gives b every partition
    with the offsets from before a's transaction. a's offsets then name a member the group no
    longer has, and the coordinator refuses them: a's transaction is aborted, the records it
    had written to its file are cut back, and a rejoins the group and goes on; every window
    is billed once, on the topic and across the two files. With aiokafka's own TxnOffsetCommit
    (v0, no member) a's transaction committed: 80 records twice."""
    monkeypatch.setattr(consumer_module, "REBALANCE_TIMEOUT_MS", 8_000)
    msgs = build(tmp_path / "nodes", recent_t0(300))
    group = f"{kafka_topic}.g"

    async def scenario() -> list[str]:
        a, b, stop, over = await a_held_while_b_joins(
            kafka_bootstrap, kafka_topic, tmp_path, monkeypatch, msgs, 20.0
        )
        await over.wait()
        deadline = time.monotonic() + 60
        while "this replica rejoins the group" not in caplog.text:
            assert time.monotonic() < deadline and not a.done(), caplog.text[-3000:]
            await asyncio.sleep(0.1)
        await asyncio.sleep(8)  # a rejoins, the two share the partitions and catch up
        stop.set()
        await asyncio.gather(a, b)
        # what the two files hold when both have stopped: what they committed
        files = read_csv(tmp_path / "a.csv") + read_csv(tmp_path / "b.csv")
        billed = await read_billing(kafka_bootstrap, f"{kafka_topic}.billing")
        assert sorted(files) == sorted(csv_lines(billed)), "the files differ from the topic"
        await drain_once_empty(kafka_bootstrap, kafka_topic, tmp_path)
        return files

    with caplog.at_level(logging.INFO):
        files = asyncio.run(scenario())
    # (read as soon as the drain ends: a's abort ended its transaction; had it been left to
    # time out, the drain's records would not be readable yet)
    billed_once(kafka_bootstrap, kafka_topic, msgs)
    assert len(files) == len(set(files)), f"{len(files) - len(set(files))} CSV lines twice"
    (line,) = [r.getMessage() for r in caplog.records if "rejoins the group" in r.getMessage()]
    # Refused by the coordinator, or (once aiokafka has learnt that the group dropped the
    # member) before it is asked.
    assert line.startswith("GroupMembershipLost: "), line
    assert (
        f"group {group} refused the offsets of {kafka_topic} partition" in line
        or f"group {group} dropped this replica" in line
    ), line
    assert "is no longer in the group)" in line
    assert line.endswith(
        ": the transaction is aborted, the partitions' new owner bills them; this replica "
        "rejoins the group"
    ), line
    assert "never retrieved" not in caplog.text  # the one line, no asyncio traceback
    # Each replica's summary counts the records it handed out once: a's aborted ones were
    # handed out again after it rejoined.
    summaries = [r.getMessage() for r in caplog.records if r.getMessage().startswith("aggr")]
    assert len(summaries) == 3, summaries  # a, b, the drain
    for summary in summaries:
        written, counters = final_report(summary)
        assert counters.get("records", 0) == written, summary


def test_a_drain_that_gains_a_partition_reads_it_to_its_end(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `--drain` replica "a" shares the partitions with a live "b"; b goes away and a gains
    its partition mid-drain. Its drain waited for the end offsets of its first assignment only,
    then flushed every partition it held: the gained one's windows were billed from the first
    batch read of it (smaller values, exit 0, damage none)."""
    t0 = recent_t0(300)
    # node-b on partition 0, which the round robin gives to "a" (member ids sort by instance);
    # node-a and node-c on partition 1, twice the backlog: a reads its own to the end first
    msgs = build(tmp_path / "nodes", t0, nodes=("node-a", "node-b", "node-c"))
    billing = f"{kafka_topic}.billing"
    group = f"{kafka_topic}.g"

    def settings(instance: str, drain: bool = False) -> AggregateSettings:
        return _replica(kafka_bootstrap, kafka_topic, tmp_path, instance, drain)

    real_getmany = AIOKafkaConsumer.getmany
    real_caught_up = service._caught_up
    real_aggregator = service.Tally.aggregator
    assigned: list[str] = []  # who got a partition: "b", "a", then "gained" (a, once b left)

    own: list[int] = []  # the partitions a was first given
    started: list[bool] = []  # a read the gained partition

    async def getmany(self: AIOKafkaConsumer, *tps: Any, **kwargs: Any) -> Any:
        kwargs["max_records"] = 50  # a backlog takes many turns of the loop
        if "gained" in assigned and not tps:
            # One batch of the gained partition, then a's own to their end: a backlog on the
            # gained one that outlasts them, whatever order aiokafka fetches in.
            mine = [tp for tp in self.assignment() if tp.partition in own]
            theirs = [tp for tp in self.assignment() if tp.partition not in own]
            if not started:
                got = await real_getmany(self, *theirs, **kwargs)
                started.append(bool(got))
                return got
            ends = await self.end_offsets(mine)
            if any([await self.position(tp) < ends[tp] for tp in mine]):
                return await real_getmany(self, *mine, **kwargs)
        return await real_getmany(self, *tps, **kwargs)

    async def caught_up(consumer: Any, ends: dict[Any, int]) -> bool:
        return "gained" in assigned and await real_caught_up(consumer, ends)

    async def scenario() -> None:
        await create_topic(kafka_bootstrap, kafka_topic, 2)
        await create_topic(kafka_bootstrap, billing, 1)
        assert await produce(kafka_bootstrap, kafka_topic, msgs) == {
            "node-a": 1,
            "node-b": 0,
            "node-c": 1,
        }
        monkeypatch.setattr(AIOKafkaConsumer, "getmany", getmany)
        monkeypatch.setattr(service, "_caught_up", caught_up)
        who = ["a"]

        tallies: list[int] = []  # b's, then a's

        def aggregator(self: Any, partition: int, emitted_until_ms: int) -> Any:
            if id(self) not in tallies:
                tallies.append(id(self))
            if tallies.index(id(self)) == 0:
                assigned.append("b")
            else:
                assigned.append(who[0])
                if who[0] == "a":
                    own.append(partition)
            return real_aggregator(self, partition, emitted_until_ms)

        monkeypatch.setattr(service.Tally, "aggregator", aggregator)

        async def until(what: str) -> None:
            while what not in assigned:
                await asyncio.sleep(0.1)

        stop_b = asyncio.Event()
        b = asyncio.create_task(run_kafka(settings("b"), stop_b))
        await asyncio.wait_for(until("b"), 60)
        a = asyncio.create_task(run_kafka(settings("a", drain=True), asyncio.Event()))
        await asyncio.wait_for(until("a"), 60)
        stop_b.set()
        await b
        who[0] = "gained"  # a's next assignment holds b's partition (after b's session ends)
        await asyncio.wait_for(a, 120)
        monkeypatch.undo()
        await wait_group_empty(kafka_bootstrap, group)
        await run_kafka(settings("a", drain=True), asyncio.Event())

    asyncio.run(scenario())
    got = sorted(asyncio.run(read_billing(kafka_bootstrap, billing)), key=sort_key)
    assert len(got) == len({r.record_id for r in got})
    assert got == sorted(reference(msgs), key=sort_key)


def test_a_drain_that_loses_a_partition_drains_the_rest(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `--drain` replica "a" holds both partitions when a live "b" joins and takes one: the
    drain went on asking the position of the partition it no longer held and stopped with
    `IllegalStateError` (exit 1). It drains the one it keeps; b's goes on in b."""
    t0 = recent_t0(300)
    msgs = build(tmp_path / "nodes", t0)
    billing = f"{kafka_topic}.billing"
    group = f"{kafka_topic}.g"

    def settings(instance: str, drain: bool = False) -> AggregateSettings:
        return _replica(kafka_bootstrap, kafka_topic, tmp_path, instance, drain)

    real_caught_up = service._caught_up
    real_aggregator = service.Tally.aggregator
    given: list[int] = []  # how many partitions each assignment of a gave it
    tallies: list[int] = []  # a's, then b's

    async def caught_up(consumer: Any, ends: dict[Any, int]) -> bool:
        return len(given) > 2 and await real_caught_up(consumer, ends)

    def aggregator(self: Any, partition: int, emitted_until_ms: int) -> Any:
        if id(self) not in tallies:
            tallies.append(id(self))
        if tallies.index(id(self)) == 0:
            given.append(partition)
        return real_aggregator(self, partition, emitted_until_ms)

    async def scenario() -> None:
        await create_topic(kafka_bootstrap, kafka_topic, 2)
        await create_topic(kafka_bootstrap, billing, 1)
        await produce(kafka_bootstrap, kafka_topic, msgs)
        monkeypatch.setattr(service, "_caught_up", caught_up)
        monkeypatch.setattr(service.Tally, "aggregator", aggregator)
        a = asyncio.create_task(run_kafka(settings("a", drain=True), asyncio.Event()))
        while len(given) < 2:  # a holds both
            await asyncio.sleep(0.1)
        stop_b = asyncio.Event()
        b = asyncio.create_task(run_kafka(settings("b"), stop_b))
        await asyncio.wait_for(a, 120)  # given a third time: the one partition a keeps
        stop_b.set()
        await b
        monkeypatch.undo()
        await wait_group_empty(kafka_bootstrap, group)
        await run_kafka(settings("a", drain=True), asyncio.Event())

    asyncio.run(scenario())
    assert len(given) == 3
    got = sorted(asyncio.run(read_billing(kafka_bootstrap, billing)), key=sort_key)
    assert len(got) == len({r.record_id for r in got})
    assert got == sorted(reference(msgs), key=sort_key)


def test_a_checkpoint_that_stays_unstable_stops_the_replica_with_one_line(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    """A transaction that committed offsets for the group stays open (its producer was killed
    inside it): the replica waits for it, and past its wait stops with CheckpointError (exit 4)
    rather than start from offsets that are about to change."""
    group = f"{kafka_topic}.g"
    tp = TopicPartition(kafka_topic, 0)

    async def scenario() -> None:
        await create_topic(kafka_bootstrap, kafka_topic, 1)
        await produce(kafka_bootstrap, kafka_topic, build(tmp_path / "nodes", recent_t0(60))[:5])
        txp = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, transactional_id=group + "-x")
        async with txp:
            await txp.begin_transaction()
            await txp.send_offsets_to_transaction({tp: 1}, group)
            settings = AggregateSettings(
                window=WINDOW, kafka=kafka_bootstrap, topic=kafka_topic, group=group,
                billing_topic=f"{kafka_topic}.billing", log_dir=tmp_path, drain=True,
                checkpoint_wait_s=3,
            )  # fmt: skip
            started = time.monotonic()
            with pytest.raises(CheckpointError) as caught:
                await run_kafka(settings, asyncio.Event())
            assert 3 <= time.monotonic() - started < 30
            await txp.abort_transaction()
        assert str(caught.value).startswith(
            f"committed offsets of group {group} not available after 3 s: "
        )

    asyncio.run(scenario())


def test_a_replica_taking_over_stays_alive_while_its_checkpoint_is_unstable(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replica "b" goes away long after start-up and "a" is assigned its partition while a
    transaction holds the group's offsets unstable: a waits for them with the partitions
    paused. a's input loop goes on turning through the wait: /healthz does not restart the
    replica taking over. The wait (12 s) is longer than the session (10 s): a that waited in
    the rebalance listener, where aiokafka sends no heartbeat, was dropped from the group, and
    its next commit refused (GroupMembershipLost); now it stays a member and commits."""
    group = f"{kafka_topic}.g"
    tps = [TopicPartition(kafka_topic, p) for p in (0, 1)]
    waits: list[tuple[float, float | None]] = []
    real_committed = service.committed_offsets

    async def committed(admin: Any, group: str, asked: Any, wait_s: float) -> Any:
        if asked is None:  # start-up, before joining
            return await real_committed(admin, group, asked, wait_s)
        waits.append((time.monotonic(), None))
        found = await real_committed(admin, group, asked, wait_s)
        waits[-1] = (waits[-1][0], time.monotonic())
        return found

    def settings(instance: str) -> AggregateSettings:
        return replica(kafka_bootstrap, kafka_topic, tmp_path, instance)

    async def scenario() -> tuple[float, float]:
        await create_topic(kafka_bootstrap, kafka_topic, 2)
        await create_topic(kafka_bootstrap, f"{kafka_topic}.billing", 1)
        monkeypatch.setattr(service, "committed_offsets", committed)
        a_settings, stop_a, stop_b = settings("a"), asyncio.Event(), asyncio.Event()
        a = asyncio.create_task(run_kafka(a_settings, stop_a))
        await asyncio.sleep(8)
        b = asyncio.create_task(run_kafka(settings("b"), stop_b))
        await asyncio.sleep(10)  # b joined: one partition each
        stop_b.set()
        await b
        settled = len(waits)
        txp = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, transactional_id=group + "-x")
        async with txp:
            await txp.begin_transaction()
            await txp.send_offsets_to_transaction(dict.fromkeys(tps, 0), group)
            while len(waits) == settled:  # b's session expires, a is given both partitions
                await asyncio.sleep(0.1)
            oldest = 0.0
            held_until = time.monotonic() + 12
            while time.monotonic() < held_until:
                oldest = max(oldest, time.monotonic() - a_settings.liveness.last_beat)
                await asyncio.sleep(0.2)
            await txp.abort_transaction()
        while waits[-1][1] is None:
            await asyncio.sleep(0.1)
        await asyncio.sleep(service.COMMIT_INTERVAL_S + 2)  # a commits as a member
        stop_a.set()
        await a
        started, ended = waits[-1]
        assert ended is not None
        return ended - started, oldest

    waited, oldest = asyncio.run(scenario())
    assert waited >= 12
    assert oldest < 2, f"a's input loop stood still {oldest:.1f} s during the takeover"


async def _stable_with(bootstrap: str, group: str, members: int, timeout_s: float = 60) -> None:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            _, _, state, _, _, got = (await admin.describe_consumer_groups([group]))[0].groups[0]
            if state == "Stable" and len(got) == members:
                return
            assert time.monotonic() < deadline, f"group {group}: {state}, {len(got)} members"
            await asyncio.sleep(0.5)
    finally:
        await admin.close()


def test_a_replica_left_with_no_partition_sends_no_gauges_of_the_lost_one(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    """Replica "z" aggregates the one partition alone and pushes its containers' gauges; "a"
    joins and takes it (the range assignor gives it to the member that sorts first). z, left
    holding nothing, pushes nothing until it stops; its last push, at shutdown, sent the lost
    partition's gauges again, at their values of minutes before, beside the new owner's."""
    from otlp_receiver import OtlpReceiver

    from collector.aggregate.otlp import GAUGES

    msgs = build(tmp_path / "nodes", recent_t0(300))
    group = f"{kafka_topic}.g"

    def gauge_points(received: Any) -> int:
        metrics = received.metrics()
        return sum(len(metrics[g.name].points) for g in GAUGES if g.name in metrics)

    async def scenario(receiver: OtlpReceiver) -> None:
        await create_topic(kafka_bootstrap, kafka_topic, 1)
        await create_topic(kafka_bootstrap, f"{kafka_topic}.billing", 1)
        await produce(kafka_bootstrap, kafka_topic, msgs)
        stop_z, stop_a = asyncio.Event(), asyncio.Event()
        settings = _replica(kafka_bootstrap, kafka_topic, tmp_path, "z")
        settings.otlp = receiver.endpoint
        z = asyncio.create_task(run_kafka(settings, stop_z))
        deadline = time.monotonic() + 60
        while not any(gauge_points(r) for r in receiver.received):
            assert time.monotonic() < deadline and not z.done(), "z pushed no gauges"
            await asyncio.sleep(0.2)
        a_settings = _replica(kafka_bootstrap, kafka_topic, tmp_path, "a")
        a = asyncio.create_task(run_kafka(a_settings, stop_a))
        await _stable_with(kafka_bootstrap, group, 2)
        stop_z.set()
        await z
        stop_a.set()
        await a

    with OtlpReceiver() as receiver:
        asyncio.run(scenario(receiver))
        last = receiver.received[-1]
    assert read_csv(tmp_path / "z.csv"), "z billed nothing before a joined"
    assert gauge_points(last) == 0
