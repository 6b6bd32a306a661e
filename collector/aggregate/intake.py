"""Records in: each message decoded once and handed to its partition's `Aggregator`.

A `UsageSample` (nearly all of the traffic) whose every row is within bounds takes the short
way: `windows.packed.checked` validates it in msgspec, and the aggregator holds its bytes with
the header fields that check decoded (`Aggregator.add_sample`). Everything else (other kinds,
out-of-range values, undecodable bytes, a newer schema) goes through `events.decode` and
`Aggregator.add`, which count and report it as before. Both ways give the same records.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

from ..events import MAX_NAME, UnknownSchemaVersion, decode
from .damage import DamageReport
from .windows import Aggregator, packed

__all__ = ["InputStats", "add_kafka_records", "add_record"]

# RecursionError: `packed.checked` on a value nested too deeply (`events.decode` then says so)
_BAD: Final = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)
# A message is a msgpack array [tag, v, ...]; a sample's tag is a positive fixint (one byte).
_SAMPLE: Final = bytes([packed.tag_of])


@dataclass
class InputStats:
    """Input that was read but not aggregated, and damage seen in it: counted and reported,
    never silent."""

    undecodable: int = 0
    unknown_schema: int = 0
    damage: DamageReport = field(default_factory=DamageReport)

    @contextmanager
    def uncounted(self) -> Iterator[None]:
        """Records read inside were counted before (read again from a checkpoint by the same
        process): what they count here is taken back; the seqs they show are still seen."""
        before = (self.undecodable, self.unknown_schema)
        try:
            with self.damage.uncounted():
                yield
        finally:
            self.undecodable, self.unknown_schema = before


def add_record(
    agg: Aggregator,
    stats: InputStats,
    key: bytes | None,
    value: bytes | None,
    *,
    source: int,
    offset: int,
    record_ts_ms: int,
) -> None:
    node = _node(key)
    if value is None or node is None:  # a tombstone, or a key no node name can be
        stats.undecodable += 1
        return
    if value[1:2] != _SAMPLE or not _sample(agg, stats, node, value, source, offset, record_ts_ms):
        _event(agg, stats, node, value, source, offset, record_ts_ms)


def add_kafka_records(
    agg: Aggregator, stats: InputStats, source: int, records: Iterable[Any]
) -> None:
    """`add_record` for each of a partition's fetched aiokafka `ConsumerRecord`s, in order."""
    node: str | None = ""
    node_key: bytes | None = b""
    for m in records:
        key = m.key
        if key != node_key:  # a partition's records come from a few nodes, often in runs
            node_key = key
            node = _node(key)
        value = m.value
        if value is None or node is None:  # (see add_record)
            stats.undecodable += 1
            continue
        if value[1:2] != _SAMPLE or not _sample(
            agg, stats, node, value, source, m.offset, m.timestamp
        ):
            _event(agg, stats, node, value, source, m.offset, m.timestamp)


def _node(key: bytes | None) -> str | None:
    """The node a message is keyed by; None for a key longer than any node name."""
    if key is not None and len(key) > MAX_NAME:
        return None
    return (key or b"").decode("utf-8", "replace")


def _sample(
    agg: Aggregator,
    stats: InputStats,
    node: str,
    value: bytes,
    source: int,
    offset: int,
    record_ts_ms: int,
) -> bool:
    """The short way for a usage sample; False when `packed.checked` does not accept it."""
    try:
        s = packed.checked(value)
    except _BAD:
        return False
    stats.damage.see_seq(node, s.inc, s.seq, source)
    agg.add_sample(
        node,
        s.inc,
        s.seq,
        s.ts,
        s.cid,
        value,
        source=source,
        offset=offset,
        record_ts_ms=record_ts_ms,
    )
    return True


def _event(
    agg: Aggregator,
    stats: InputStats,
    node: str,
    value: bytes,
    source: int,
    offset: int,
    record_ts_ms: int,
) -> None:
    """The long way, for everything: decoded, counted when it cannot be."""
    try:
        event = decode(value)
    except UnknownSchemaVersion:
        stats.unknown_schema += 1
        return
    except _BAD:
        stats.undecodable += 1
        return
    stats.damage.see(node, event, source)
    agg.add(node, event, source=source, offset=offset, record_ts_ms=record_ts_ms)
