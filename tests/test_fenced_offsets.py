"""Transactional offsets of a replica the group has dropped, against the real broker.

A replica stopped longer than its session (a frozen node, a long pause) is dropped from the
group; aiokafka learns it at its next heartbeat and forgets the membership (generation -1, no
member id: what `close()` leaves too). A group left empty meanwhile (its partitions' next owner
gone as well) takes offsets of generation -1 from anyone: the dropped replica's transaction,
built before its partitions moved on, committed over the offsets their next owner had
committed, with records that owner had already published.
"""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError
from aiokafka.structs import OffsetAndMetadata
from streams import create_topic

from collector.transport.fenced_offsets import (
    GroupMembershipLost,
    InstanceFenced,
    commit_offsets_as_member,
)

pytestmark = pytest.mark.kafka


async def _wait_empty(bootstrap: str, group: str) -> None:
    """Until the coordinator has dropped every member (the session timeout, 10 s)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        async with asyncio.timeout(60):
            while (await admin.describe_consumer_groups([group]))[0].groups[0][2] != "Empty":
                await asyncio.sleep(0.5)
    finally:
        await admin.close()


async def _committed(bootstrap: str, group: str, tp: TopicPartition) -> int | None:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group)
    await consumer.start()
    try:
        committed: int | None = await consumer.committed(tp)
        return committed
    finally:
        await consumer.stop()


def test_a_replica_the_empty_group_dropped_commits_nothing(
    kafka_bootstrap: str, kafka_topic: str
) -> None:
    group = f"{kafka_topic}.g"
    tp = TopicPartition(kafka_topic, 0)

    async def scenario() -> BaseException | None:
        await create_topic(kafka_bootstrap, kafka_topic, 1)
        consumer = AIOKafkaConsumer(
            kafka_topic, bootstrap_servers=kafka_bootstrap, group_id=group,
            group_instance_id=f"{group}-0", enable_auto_commit=False,
        )  # fmt: skip
        producer = AIOKafkaProducer(
            bootstrap_servers=kafka_bootstrap, transactional_id=f"{group}-0"
        )
        await consumer.start()
        await producer.start()
        try:
            async with asyncio.timeout(60):
                while not consumer.assignment():
                    await consumer.getmany(timeout_ms=200)
            commit_offsets_as_member(producer, consumer)
            await producer.begin_transaction()
            await producer.send_offsets_to_transaction({tp: OffsetAndMetadata(5, "")}, group)
            await producer.commit_transaction()  # a member: committed
            await consumer.stop()  # its membership forgotten, as after a lost heartbeat
            await _wait_empty(kafka_bootstrap, group)
            await producer.begin_transaction()
            try:
                await producer.send_offsets_to_transaction(
                    {tp: OffsetAndMetadata(3, "")}, group
                )
                await producer.commit_transaction()
            except GroupMembershipLost as exc:
                await producer.abort_transaction()
                return exc
            return None
        finally:
            await producer.stop()

    error = asyncio.run(scenario())
    assert isinstance(error, GroupMembershipLost), repr(error)
    assert f"group {group} dropped this replica (its session or a rebalance ran out" in str(error)
    assert asyncio.run(_committed(kafka_bootstrap, group, tp)) == 5


def test_a_replica_whose_instance_joined_in_its_place_is_fenced_not_dropped(
    kafka_bootstrap: str, kafka_topic: str
) -> None:
    """A second process with a replica's `instance` (a copied StatefulSet) joins in its place.
    The first one's offsets are refused as `InstanceFenced`, not `GroupMembershipLost`: the
    aggregator takes the latter for a membership it lost and rejoins, cutting its files back,
    which two processes of one instance share."""
    group = f"{kafka_topic}.g"
    tp = TopicPartition(kafka_topic, 0)

    def member() -> AIOKafkaConsumer:
        return AIOKafkaConsumer(
            kafka_topic, bootstrap_servers=kafka_bootstrap, group_id=group,
            group_instance_id=f"{group}-0", enable_auto_commit=False,
        )  # fmt: skip

    async def assigned(consumer: AIOKafkaConsumer) -> None:
        async with asyncio.timeout(60):
            while not consumer.assignment():
                await consumer.getmany(timeout_ms=200)

    async def scenario() -> BaseException | None:
        await create_topic(kafka_bootstrap, kafka_topic, 1)
        first, second = member(), member()
        producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, transactional_id=group)
        await first.start()
        await producer.start()
        try:
            await assigned(first)
            commit_offsets_as_member(producer, first)
            await second.start()
            await assigned(second)
            await producer.begin_transaction()
            try:
                await producer.send_offsets_to_transaction({tp: OffsetAndMetadata(3, "")}, group)
                await producer.commit_transaction()
            except KafkaError as exc:
                await producer.abort_transaction()
                return exc
            return None
        finally:
            await producer.stop()
            await second.stop()
            await first.stop()

    error = asyncio.run(scenario())
    assert isinstance(error, InstanceFenced), repr(error)
    assert not isinstance(error, GroupMembershipLost)
    assert str(error) == (
        f"InstanceFenced: group {group} refused the offsets of {kafka_topic} partition 0 "
        f"(FENCED_INSTANCE_ID: another process of instance {group}-0 is in the group in this "
        "one's place): the transaction is aborted, the partitions' new owner bills them"
    )
    assert asyncio.run(_committed(kafka_bootstrap, group, tp)) is None
