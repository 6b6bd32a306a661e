"""Transactional offset commits that carry the consumer's group membership (TxnOffsetCommit
v3: generation, member id and group instance id, KIP-447), so the group coordinator refuses
the commit of a member the group no longer has.

An aggregator replica publishes its records and commits its partitions' offsets in one
transaction. A member whose revocation waits for that transaction longer than the rebalance
timeout is dropped from the group, and its partitions are given out with the offsets from
before the transaction. aiokafka (0.14) sends TxnOffsetCommit v0, which names the group but
not the member: the dropped member's transaction still committed, and the partitions' new owner
published the same windows again (billed twice). With v3 the coordinator answers
ILLEGAL_GENERATION, UNKNOWN_MEMBER_ID or FENCED_INSTANCE_ID; the transaction fails as aborted
(`GroupMembershipLost`), and its records are never read by a `read_committed` consumer.

This module declares v3 with aiokafka's own protocol types and puts it in place of the v0
request on one transactional producer, reading the membership of one consumer each time the
request is built (a retried request carries the membership of its retry).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.client import CoordinationType
from aiokafka.errors import GroupAuthorizationFailedError, KafkaError
from aiokafka.producer.sender import TxnOffsetCommitHandler
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import Int16, Int32, Int64, Schema

from .flexible import STRING, TAGS, per_partition

__all__ = ["GroupMembershipLost", "InstanceFenced", "Membership", "commit_offsets_as_member"]

# Kafka's error codes for a commit by a member the group does not have (now)
_NOT_A_MEMBER = {22: "ILLEGAL_GENERATION", 25: "UNKNOWN_MEMBER_ID", 82: "FENCED_INSTANCE_ID"}

# (generation, member id, group instance id): what the coordinator checks
Membership = tuple[int, str, str | None]


class GroupMembershipLost(KafkaError):  # type: ignore[misc]
    """The group coordinator refused this replica's transactional offsets: the group gave its
    partitions to another member while the transaction was in flight. The transaction is
    aborted; the partitions' new owner publishes their records."""


class InstanceFenced(KafkaError):  # type: ignore[misc]
    """The group coordinator refused this replica's transactional offsets because another
    process with its group instance id (its `instance`: a copied StatefulSet) has joined in its
    place. The transaction is aborted; this one must stop, not rejoin."""


class _TxnOffsetCommitResponseV3(Response):  # type: ignore[misc]
    API_KEY = 28
    API_VERSION = 3
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        per_partition(("partition_index", Int32), ("error_code", Int16)),
        TAGS,
    )


class _TxnOffsetCommitRequestV3(RequestStruct):  # type: ignore[misc]
    API_KEY = 28
    API_VERSION = 3
    FLEXIBLE_VERSION = True
    RESPONSE_TYPE = _TxnOffsetCommitResponseV3
    SCHEMA = Schema(
        ("transactional_id", STRING),
        ("group_id", STRING),
        ("producer_id", Int64),
        ("producer_epoch", Int16),
        ("generation_id", Int32),
        ("member_id", STRING),
        ("group_instance_id", STRING),
        per_partition(
            ("partition_index", Int32),
            ("committed_offset", Int64),
            ("committed_leader_epoch", Int32),
            ("committed_metadata", STRING),
        ),
        TAGS,
    )


class _TxnOffsetCommit(Request[_TxnOffsetCommitRequestV3]):  # type: ignore[misc]
    API_KEY = 28

    def __init__(
        self,
        ids: tuple[str, str, int, int],
        membership: Membership,
        topics: dict[str, list[tuple[int, int, str]]],
    ) -> None:
        self._ids = ids
        self._membership = membership
        self._topics = topics

    def build(
        self, request_struct_class: type[_TxnOffsetCommitRequestV3]
    ) -> _TxnOffsetCommitRequestV3:
        topics: list[
            tuple[str, list[tuple[int, int, int, str, dict[int, bytes]]], dict[int, bytes]]
        ]
        topics = [
            (name, [(p, offset, -1, meta, {}) for p, offset, meta in parts], {})
            for name, parts in self._topics.items()
        ]
        return request_struct_class(*self._ids, *self._membership, topics, {})


class _Handler(TxnOffsetCommitHandler):  # type: ignore[misc]
    def __init__(
        self, sender: Any, offsets: dict[Any, Any], group_id: str, member: Membership
    ) -> None:
        super().__init__(sender, offsets, group_id)
        self._member = member

    def create_request(self) -> _TxnOffsetCommit:
        txn = self._sender._txn_manager
        topics: dict[str, list[tuple[int, int, str]]] = {}
        for tp, om in sorted(self._offsets.items()):
            topics.setdefault(tp.topic, []).append((tp.partition, om.offset, om.metadata))
        ids = (txn.transactional_id, self._group_id, txn.producer_id, txn.producer_epoch)
        return _TxnOffsetCommit(ids, self._member, topics)

    def handle_response(self, resp: Any) -> float | None:
        for topic, partitions, _ in resp.topics:
            for partition, code, _ in partitions:
                if code in _NOT_A_MEMBER:
                    self._refused(f"{topic} partition {partition}", _NOT_A_MEMBER[code])
                    return None

        # Every other answer as aiokafka's own handler takes it (its v0 response's shape).
        class _V0:
            errors = [(t, [(p, code) for p, code, _ in ps]) for t, ps, _ in resp.topics]

        result: float | None = super().handle_response(_V0)
        return result

    def _refused(self, partition: str, error: str) -> None:
        generation, member, instance = self._member
        refused = f"group {self._group_id} refused the offsets of {partition}"
        if error == "FENCED_INSTANCE_ID":
            self.refuse(
                f"{refused} ({error}: another process of instance {instance} is in the group "
                "in this one's place)",
                InstanceFenced,
            )
            return
        # (aiokafka forgets a member the coordinator no longer knows before it rejoins)
        who = f"member {member} of generation {generation}" if member else "this replica"
        self.refuse(f"{refused} ({error}: {who} is no longer in the group)")

    def refuse(self, why: str, error: type[KafkaError] = GroupMembershipLost) -> None:
        """Fail the transaction as `error` (`why`, then what follows)."""
        txn = self._sender._txn_manager
        # aiokafka forgets on an error what the transaction holds, and its abort then sends
        # nothing: the records would stay pending on the broker (every read_committed reader
        # of the billing topic held at them) until the transaction timed out. Kept, so that
        # the abort ends it.
        holds, group = set(txn.txn_partitions), txn._txn_consumer_group
        txn.error_transaction(
            error(f"{why}: the transaction is aborted, the partitions' new owner bills them")
        )
        txn.txn_partitions.update(holds)
        txn._txn_consumer_group = group
        # The waiter holds the error too; the caller gets it from its offsets and aborts,
        # which replaces the waiter: taken here, or asyncio logs it as never retrieved.
        txn.wait_for_transaction_end().exception()


def commit_offsets_as_member(producer: AIOKafkaProducer, consumer: AIOKafkaConsumer) -> None:
    """Make `producer`'s `send_offsets_to_transaction` send TxnOffsetCommit v3 with
    `consumer`'s group membership at the time of each request."""
    membership = _membership_of(consumer)
    sender = producer._sender
    if not callable(getattr(sender, "_do_txn_offset_commit", None)):
        # (a later aiokafka: its commits would go out unfenced, unnoticed)
        raise RuntimeError("aiokafka's sender has no _do_txn_offset_commit to replace")

    async def txn_offset_commit(offsets: dict[Any, Any], group_id: str) -> None:
        # (aiokafka's `Sender._do_txn_offset_commit`, with the request above)
        if not offsets:
            return
        member = membership()
        if member[0] < 0:
            # aiokafka has forgotten the membership: it learnt that the group dropped this
            # replica (a session that ran out while the process was stopped, a commit held
            # past the rebalance timeout).
            # A group left empty meanwhile takes generation -1 offsets from anyone, and this
            # transaction, made before its partitions moved on, would commit over what their
            # next owner had committed and published.
            _Handler(sender, offsets, group_id, member).refuse(
                f"group {group_id} dropped this replica (its session or a rebalance ran out: "
                "it is no longer in the group), so its offsets were not sent"
            )
            return
        try:
            node_id = await sender._find_coordinator(CoordinationType.GROUP, group_id)
        except GroupAuthorizationFailedError as exc:
            sender._txn_manager.error_transaction(exc)
            return
        await _Handler(sender, offsets, group_id, member).do(node_id)

    sender._do_txn_offset_commit = txn_offset_commit


def _membership_of(consumer: AIOKafkaConsumer) -> Callable[[], Membership]:
    def membership() -> Membership:
        coordinator = consumer._coordinator
        if coordinator is None or not hasattr(coordinator, "generation"):
            return -1, "", None  # not in a group: refused (`commit_offsets_as_member`)
        return coordinator.generation, coordinator.member_id, coordinator._group_instance_id

    return membership
