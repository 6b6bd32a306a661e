"""A group's committed offsets as the broker holds them once every transaction that committed
offsets for it has been applied (OffsetFetch v7, `require_stable`, KIP-447).

An aggregator replica commits its partitions' offsets inside the transaction that publishes
their records. `commit_transaction()` returns when the transaction is committed, but the
broker applies its offsets to the group a moment later, when the commit markers are written. A
replica assigned such a partition in between and reading the offsets the way aiokafka's
`list_consumer_group_offsets` does (OffsetFetch v3, no `require_stable`) gets the offsets from
before that transaction, and publishes its windows again. With `require_stable` the broker
answers UNSTABLE_OFFSET_COMMIT for such a partition instead, and the caller asks again.

aiokafka (0.14) builds OffsetFetch up to v3 only; this module declares v7 with aiokafka's own
protocol types and sends it through the admin client's connection to the group coordinator.
"""

from __future__ import annotations

from typing import Any

from aiokafka.errors import for_code
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import Boolean, CompactArray, Int16, Int32, Int64, Schema
from aiokafka.structs import OffsetAndMetadata, TopicPartition

from .flexible import STRING, TAGS, per_partition

__all__ = ["UNSTABLE_OFFSET_COMMIT", "UnstableOffsets", "fetch_stable_offsets"]

UNSTABLE_OFFSET_COMMIT = 88  # Kafka's error code: a transaction's offsets are not applied yet


class UnstableOffsets(Exception):
    """Some partition's offsets wait for a committed transaction to be applied: ask again."""


class _OffsetFetchResponseV7(Response):  # type: ignore[misc]
    API_KEY = 9
    API_VERSION = 7
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        per_partition(
            ("partition_index", Int32),
            ("committed_offset", Int64),
            ("committed_leader_epoch", Int32),
            ("metadata", STRING),
            ("error_code", Int16),
        ),
        ("error_code", Int16),
        TAGS,
    )


class _OffsetFetchRequestV7(RequestStruct):  # type: ignore[misc]
    API_KEY = 9
    API_VERSION = 7
    FLEXIBLE_VERSION = True
    RESPONSE_TYPE = _OffsetFetchResponseV7
    SCHEMA = Schema(
        ("group_id", STRING),
        (
            "topics",
            CompactArray(("name", STRING), ("partition_indexes", CompactArray(Int32)), TAGS),
        ),
        ("require_stable", Boolean),
        TAGS,
    )


class _StableOffsetFetch(Request[_OffsetFetchRequestV7]):  # type: ignore[misc]
    API_KEY = 9

    def __init__(self, group: str, topics: list[tuple[str, list[int]]] | None) -> None:
        self._group = group
        self._topics = topics

    def build(self, request_struct_class: type[_OffsetFetchRequestV7]) -> _OffsetFetchRequestV7:
        topics: list[tuple[str, list[int], dict[int, bytes]]] | None = None
        if self._topics is not None:
            topics = [(t, ps, {}) for t, ps in self._topics]
        return request_struct_class(self._group, topics, True, {})


async def fetch_stable_offsets(
    admin: Any, group: str, tps: list[TopicPartition] | None
) -> dict[TopicPartition, OffsetAndMetadata]:
    """Committed offsets and metadata of `tps` (None: every partition the group committed), as
    `AIOKafkaAdminClient.list_consumer_group_offsets` gives them (offset -1: never committed),
    but never from before a committed transaction's offsets: UnstableOffsets then."""
    topics: list[tuple[str, list[int]]] | None = None
    if tps is not None:
        by_topic: dict[str, list[int]] = {}
        for tp in tps:
            by_topic.setdefault(tp.topic, []).append(tp.partition)
        topics = sorted(by_topic.items())
    coordinator = await admin.find_coordinator(group)
    response = await admin._send_request(_StableOffsetFetch(group, topics), coordinator)
    if response.error_code:
        raise for_code(response.error_code)(f"committed offsets of group {group}")
    found: dict[TopicPartition, OffsetAndMetadata] = {}
    for topic, partitions, _ in response.topics:
        for partition, offset, _epoch, metadata, error_code, _ in partitions:
            if error_code == UNSTABLE_OFFSET_COMMIT:
                raise UnstableOffsets(f"{topic} partition {partition} of group {group}")
            if error_code:
                raise for_code(error_code)(f"committed offset of {topic} partition {partition}")
            found[TopicPartition(topic, partition)] = OffsetAndMetadata(offset, metadata or "")
    return found
