"""The aiokafka features the pipeline relies on, against the real broker of scripts/kafka.sh."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
import uuid
from collections import defaultdict
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.structs import OffsetAndMetadata, OffsetAndTimestamp, TopicPartition
from broker import PrivateBroker

from collector.aggregate.service import committed_offsets
from collector.transport.stable_offsets import UnstableOffsets, fetch_stable_offsets

pytestmark = pytest.mark.kafka


async def drain(consumer: AIOKafkaConsumer, timeout_s: float = 30) -> list[ConsumerRecord]:
    """Everything up to the current end of every assigned partition.

    Reading up to end_offsets (the last stable offset under read_committed) instead of
    "until N records arrived" also proves that nothing unexpected sits behind them.
    """
    async with asyncio.timeout(timeout_s):
        while not consumer.assignment():
            await asyncio.sleep(0.05)
        tps = consumer.assignment()
        ends = await consumer.end_offsets(list(tps))
        out: list[ConsumerRecord] = []
        while True:
            positions = {tp: await consumer.position(tp) for tp in tps}
            if all(positions[tp] >= ends[tp] for tp in tps):
                return out
            for records in (await consumer.getmany(timeout_ms=200)).values():
                out.extend(records)


async def fetch(consumer: AIOKafkaConsumer, tp: TopicPartition) -> list[ConsumerRecord]:
    """The next non-empty batch of tp, once the group has assigned it."""
    async with asyncio.timeout(30):
        while True:
            if tp in consumer.assignment():
                fetched = await consumer.getmany(tp, timeout_ms=200)
                batch: list[ConsumerRecord] = fetched.get(tp, [])
                if batch:
                    return batch
            else:
                await asyncio.sleep(0.05)


def consumer(bootstrap: str, *topics: str, **kw: object) -> AIOKafkaConsumer:
    kw.setdefault("auto_offset_reset", "earliest")
    kw.setdefault("enable_auto_commit", False)
    return AIOKafkaConsumer(*topics, bootstrap_servers=bootstrap, **kw)


async def test_idempotent_gzip_producer_roundtrip(kafka_bootstrap: str, kafka_topic: str) -> None:
    producer = AIOKafkaProducer(
        bootstrap_servers=kafka_bootstrap,
        enable_idempotence=True,
        compression_type="gzip",
        linger_ms=20,
    )
    sent = [(f"node-{i % 7}".encode(), f"sample-{i}".encode()) for i in range(300)]
    async with producer:
        futures = [await producer.send(kafka_topic, value=v, key=k) for k, v in sent]
        metas = await asyncio.gather(*futures)
    assert len({m.partition for m in metas}) > 1  # auto-created with num.partitions=3

    async with consumer(kafka_bootstrap, kafka_topic) as c:
        got = await drain(c)
    assert sorted((r.key, r.value) for r in got) == sorted(sent)
    by_key: dict[bytes, list[ConsumerRecord]] = defaultdict(list)
    for r in got:
        by_key[r.key].append(r)
    for key, records in by_key.items():
        assert len({r.partition for r in records}) == 1
        sent_order = [v for k, v in sent if k == key]
        assert [r.value for r in sorted(records, key=lambda r: r.offset)] == sent_order


async def test_transactions_with_consumer_offsets(kafka_bootstrap: str, kafka_topic: str) -> None:
    src, dst, group = f"{kafka_topic}-in", f"{kafka_topic}-out", f"g-{uuid.uuid4().hex}"
    src_tp = TopicPartition(src, 0)
    async with AIOKafkaProducer(bootstrap_servers=kafka_bootstrap) as p:
        for i in range(10):
            await p.send_and_wait(src, f"in-{i}".encode(), partition=0)

    txp = AIOKafkaProducer(
        bootstrap_servers=kafka_bootstrap,
        transactional_id=f"tx-{uuid.uuid4().hex}",
        compression_type="gzip",
        linger_ms=20,
    )
    src_consumer = consumer(
        kafka_bootstrap, src, group_id=group, isolation_level="read_committed", max_poll_records=5
    )
    t0 = time.monotonic()
    async with txp, src_consumer:
        # start() already waited for FindCoordinator + InitProducerId, which creates
        # __transaction_state on a fresh broker.
        await txp.begin_transaction()
        print(f"transactional producer ready after {time.monotonic() - t0:.2f}s")
        batch = await fetch(src_consumer, src_tp)
        assert [r.value for r in batch] == [f"in-{i}".encode() for i in range(5)]
        for r in batch:
            await txp.send(dst, b"out-" + r.value, partition=0)
        await txp.send_offsets_to_transaction({src_tp: batch[-1].offset + 1}, group)
        await txp.commit_transaction()

        # Written to the log (awaited), then aborted: offsets and records must vanish.
        async with txp.transaction():
            pass  # an empty transaction must also work
        await txp.begin_transaction()
        await asyncio.gather(*[await txp.send(dst, b"aborted", partition=0) for _ in range(3)])
        await txp.send_offsets_to_transaction({src_tp: 10}, group)
        await txp.abort_transaction()

        async with txp.transaction():
            await txp.send(dst, b"after-abort", partition=0)

        assert await src_consumer.committed(src_tp) == 5

    expected = [f"out-in-{i}".encode() for i in range(5)] + [b"after-abort"]
    async with consumer(kafka_bootstrap, dst, isolation_level="read_committed") as c:
        assert [r.value for r in await drain(c)] == expected
    async with consumer(kafka_bootstrap, dst, isolation_level="read_uncommitted") as c:
        uncommitted = [r.value for r in await drain(c)]
    assert uncommitted.count(b"aborted") == 3

    # A restarted member of the group resumes right after the transactionally committed offset.
    async with consumer(kafka_bootstrap, src, group_id=group) as c:
        batch = await fetch(c, src_tp)
        assert batch[0].offset == 5


async def test_offsets_of_a_pending_transaction_are_never_read_as_the_committed_ones(
    kafka_bootstrap: str, kafka_topic: str
) -> None:
    """A replica taking over a partition reads its committed offsets: while a transaction that
    committed offsets is not applied yet, aiokafka's own read (OffsetFetch v3) gives the offsets
    from before it (that replica then published its windows again), `fetch_stable_offsets`
    (v7, require_stable) says they are unstable; applied, both give them."""
    group = f"g-{uuid.uuid4().hex}"
    tp = TopicPartition(kafka_topic, 0)
    async with AIOKafkaProducer(bootstrap_servers=kafka_bootstrap) as p:
        await p.send_and_wait(kafka_topic, b"x", partition=0)
    txp = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, transactional_id=group)
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        async with txp:
            async with txp.transaction():
                await txp.send_offsets_to_transaction({tp: 1}, group)
            await txp.begin_transaction()
            await txp.send_offsets_to_transaction({tp: OffsetAndMetadata(7, "next")}, group)
            # pending: the old read gives what was before, the stable one refuses
            assert (await admin.list_consumer_group_offsets(group, partitions=[tp]))[tp].offset == 1
            with pytest.raises(UnstableOffsets):
                await fetch_stable_offsets(admin, group, [tp])
            await txp.commit_transaction()
        async with asyncio.timeout(30):
            while True:  # applied once the markers are written
                with contextlib.suppress(UnstableOffsets):
                    found = await fetch_stable_offsets(admin, group, [tp])
                    break
                await asyncio.sleep(0.05)
        assert found == {tp: OffsetAndMetadata(7, "next")}
        assert await fetch_stable_offsets(admin, group, None) == found
        assert await committed_offsets(admin, group, [tp]) == found
        never = TopicPartition(kafka_topic, 1)
        assert (await fetch_stable_offsets(admin, group, [never]))[never].offset == -1
    finally:
        await admin.close()


async def test_offsets_for_times(kafka_bootstrap: str, kafka_topic: str) -> None:
    tp = TopicPartition(kafka_topic, 0)
    # In the past: 4.x rejects timestamps > 1 h in the future (log.message.timestamp.after.max.ms).
    base = int(time.time() * 1000) - 3_600_000
    async with AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, compression_type="gzip") as p:
        for i in range(10):
            await p.send(kafka_topic, f"{i}".encode(), partition=0, timestamp_ms=base + i * 1000)
        await p.flush()

    async with consumer(kafka_bootstrap) as c:
        found = await c.offsets_for_times({tp: base + 2500, TopicPartition(kafka_topic, 1): base})
        assert found[tp] == OffsetAndTimestamp(3, base + 3000)
        assert found[TopicPartition(kafka_topic, 1)] is None  # empty partition
        assert (await c.offsets_for_times({tp: base}))[tp] == OffsetAndTimestamp(0, base)
        assert (await c.offsets_for_times({tp: base + 10_000}))[tp] is None


async def committed_with_metadata(bootstrap: str, group: str, tp: TopicPartition) -> object:
    """aiokafka's consumer.committed() drops the metadata; the admin client keeps it."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        return (await admin.list_consumer_group_offsets(group, partitions=[tp])).get(tp)
    finally:
        await admin.close()


async def test_commit_metadata(kafka_bootstrap: str, kafka_topic: str) -> None:
    tp, group = TopicPartition(kafka_topic, 0), f"g-{uuid.uuid4().hex}"
    async with AIOKafkaProducer(bootstrap_servers=kafka_bootstrap) as p:
        for i in range(4):
            await p.send_and_wait(kafka_topic, f"{i}".encode(), partition=0)

    meta = '{"node":"gpu-node-7","window":"2024-06-01T00:00Z"}'
    async with consumer(kafka_bootstrap, kafka_topic, group_id=group) as c:
        batch = await fetch(c, tp)
        await c.commit({tp: (batch[-1].offset + 1, meta)})
        assert await c.committed(tp) == 4  # offset only
        # Private API, same OffsetFetch round trip, keeps the metadata.
        assert await c._coordinator.fetch_committed_offsets([tp]) == {
            tp: OffsetAndMetadata(4, meta)
        }
    assert await committed_with_metadata(kafka_bootstrap, group, tp) == OffsetAndMetadata(4, meta)


async def test_restart_keeps_topics_and_offsets(
    own_broker: PrivateBroker, kafka_topic: str
) -> None:
    # A broker of its own: the shared one, restarted, would fail the tests running meanwhile.
    kafka_bootstrap = own_broker.bootstrap
    tp, group = TopicPartition(kafka_topic, 0), f"g-{uuid.uuid4().hex}"
    async with AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, enable_idempotence=True) as p:
        for i in range(3):
            await p.send_and_wait(kafka_topic, f"{i}".encode(), partition=0)
    async with consumer(kafka_bootstrap, kafka_topic, group_id=group) as c:
        await fetch(c, tp)
        await c.commit({tp: (2, "before-restart")})

    await asyncio.to_thread(own_broker.stop)
    assert await asyncio.to_thread(own_broker.start) == kafka_bootstrap

    # The coordinator loads the offsets topic after a restart; until then it answers with
    # nothing (the aggregator waits for it the same way: service.committed_offsets).
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        found = await committed_offsets(admin, group, [tp])
    finally:
        await admin.close()
    assert found == {tp: OffsetAndMetadata(2, "before-restart")}
    async with consumer(kafka_bootstrap, kafka_topic, group_id=group) as c:
        batch = await fetch(c, tp)
        assert [r.value for r in batch] == [b"2"]


def test_start_waits_for_a_launch_slow_to_become_the_broker(
    own_broker: PrivateBroker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On a loaded machine the launched process can still be bash's fork or setsid, with no
    # kafka.Kafka in its cmdline, when the script first looks: that is not an exit. A setsid
    # that waits a second, under another cmdline, before it becomes the broker makes it certain.
    args, real = tmp_path / "args", shutil.which("setsid")
    shim = tmp_path / "setsid"
    shim.write_text(
        "#!/bin/bash\n"
        f"printf '%s\\0' \"$@\" >{args}\n"
        f'exec bash -c \'sleep 1; mapfile -d "" -t a <{args}; exec {real} "${{a[@]}}"\'\n'
    )
    shim.chmod(0o755)
    own_broker.stop()
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert own_broker.start() == own_broker.bootstrap
