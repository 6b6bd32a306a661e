"""Kafka consumer side: the one builder of every consumer (aggregate, replay, report), and the
bounded read of a topic from a time to its current end that `replay` and `report` share.

Every consumer gets the same connection (`KafkaSecurity.client_kwargs()`: TLS, mutual TLS,
SASL over TLS), reads committed records only (the aggregator writes in transactions) and never
auto-commits. A group member (the aggregator) names its group; a range reader has none: it
assigns itself the topic's partitions and commits nothing, so it needs only Read and Describe
on the topic.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Container
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError, TopicAuthorizationFailedError, for_code
from aiokafka.protocol.metadata import MetadataRequest

from .kafka import wait_for_broker
from .security import KafkaSecurity

__all__ = ["ConsumerSettings", "NoSuchTopic", "TopicRange", "make_consumer", "read_range"]

# Kafka's error codes in a metadata response (org.apache.kafka.common.protocol.Errors).
_UNKNOWN_TOPIC, _TOPIC_AUTHORIZATION_FAILED = 3, 29


@dataclass(frozen=True)
class ConsumerSettings:
    bootstrap: str
    client_id: str
    security: KafkaSecurity = field(default_factory=KafkaSecurity)
    group: str | None = None  # none: partitions assigned by the reader, nothing committed
    # Static membership: a restarted member gets its partitions back at once.
    group_instance_id: str | None = None
    # Where a group with no committed offset starts (the aggregator positions them itself).
    auto_offset_reset: Literal["earliest", "latest"] = "earliest"
    start_timeout_s: float = 10.0  # how long a reader waits for the broker to answer


REBALANCE_TIMEOUT_MS = 120_000  # how long a rebalance waits for a member to rejoin


def make_consumer(s: ConsumerSettings) -> AIOKafkaConsumer:
    group: dict[str, Any] = {}
    if s.group is not None:
        group["group_id"] = s.group
        # A member revoking partitions waits for its transaction in flight to commit (the
        # aggregator's rebalance listener). aiokafka's default is the session timeout (10 s):
        # a commit that took longer got the member dropped from the group, its partitions
        # given out with the offsets from before the transaction, which then still committed
        # (aiokafka's own transactional offsets carry no generation to fence it; see
        # `fenced_offsets` for the commit that does): billed twice.
        group["rebalance_timeout_ms"] = REBALANCE_TIMEOUT_MS
        if s.group_instance_id is not None:
            group["group_instance_id"] = s.group_instance_id
    return AIOKafkaConsumer(
        bootstrap_servers=s.bootstrap,
        enable_auto_commit=False,
        isolation_level="read_committed",
        auto_offset_reset=s.auto_offset_reset,
        client_id=s.client_id,
        **group,
        **s.security.client_kwargs(),
    )


class NoSuchTopic(KafkaError):  # type: ignore[misc]
    """The topic to read does not exist; str() is one line."""

    def __str__(self) -> str:
        return str(self.args[0])


async def partitions_of(consumer: AIOKafkaConsumer, topic: str) -> list[TopicPartition]:
    """The topic's partitions, asking for this topic alone and never auto-creating it (a read
    must not create a topic with the broker's defaults). A missing Describe ACL is an error,
    not an empty topic: a metadata request for every topic silently leaves such topics out."""
    client = consumer._client  # noqa: SLF001 - aiokafka has no public metadata call
    response = await client.send(
        client.get_random_node(), MetadataRequest([topic], allow_auto_topic_creation=False)
    )
    for entry in response.to_object()["topics"]:
        if entry["topic"] != topic:
            continue
        code = entry["error_code"]
        if code == _TOPIC_AUTHORIZATION_FAILED:
            raise TopicAuthorizationFailedError(topic)
        if code == _UNKNOWN_TOPIC:
            raise NoSuchTopic(f"topic {topic} does not exist")
        if code:
            raise for_code(code)(f"topic {topic}")
        return [TopicPartition(topic, p["partition"]) for p in entry["partitions"]]
    raise NoSuchTopic(f"topic {topic} does not exist")


@dataclass
class TopicRange:
    """A topic read from the first offset at or after a time to the end it had at the start."""

    consumer: AIOKafkaConsumer
    partitions: list[TopicPartition]
    first: dict[TopicPartition, int]
    end: dict[TopicPartition, int]
    begin: dict[TopicPartition, int]  # the oldest offset each partition still holds
    first_ts: dict[TopicPartition, int | None]  # the record time at `first`, if any

    @property
    def total(self) -> int:
        return sum(self.end[tp] - self.first[tp] for tp in self.partitions)

    async def batches(
        self, finished: Container[int] = (), max_records: int = 5000
    ) -> AsyncIterator[list[ConsumerRecord[bytes, bytes]]]:
        """Batches until every partition is at its end or in `finished` (checked before each
        batch, so a caller may add to it between batches)."""
        c = self.consumer
        while pending := [
            tp
            for tp in self.partitions
            if tp.partition not in finished and await c.position(tp) < self.end[tp]
        ]:
            got = await c.getmany(*pending, timeout_ms=1000, max_records=max_records)
            yield [m for tp in pending for m in got.get(tp, ())]


@asynccontextmanager
async def read_range(
    settings: ConsumerSettings, topic: str, start_ms: int
) -> AsyncIterator[TopicRange]:
    """Wait for the broker (a refusal is BrokerUnreachable with its reason), assign every
    partition of `topic` and seek each to the first offset with a record time >= `start_ms`
    (the partition's end when none is)."""
    await wait_for_broker(settings.bootstrap, settings.start_timeout_s, settings.security)
    consumer = make_consumer(settings)
    await consumer.start()
    try:
        tps = sorted(await partitions_of(consumer, topic))
        consumer.assign(tps)
        found = await consumer.offsets_for_times({tp: max(start_ms, 0) for tp in tps})
        ends = await consumer.end_offsets(tps)  # read_committed: the last stable offsets
        begins = await consumer.beginning_offsets(tps)
        first, first_ts = {}, {}
        for tp in tps:
            at = found.get(tp)
            first[tp] = max(at.offset if at is not None else ends[tp], begins[tp])
            first_ts[tp] = at.timestamp if at is not None else None
            consumer.seek(tp, first[tp])
        yield TopicRange(consumer, tps, first, ends, begins, first_ts)
    finally:
        await consumer.stop()
