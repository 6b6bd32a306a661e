"""Parts of Kafka's flexible-version messages (KIP-482) that aiokafka does not build itself,
declared once with aiokafka's protocol types (`stable_offsets`, `fenced_offsets`)."""

from __future__ import annotations

from typing import Any

from aiokafka.protocol.types import CompactArray, CompactString, TaggedFields

__all__ = ["STRING", "TAGS", "per_partition"]

STRING = CompactString("utf-8")  # (nullable: None encodes as null)
TAGS = ("tags", TaggedFields)  # every flexible struct ends with its tagged fields


def per_partition(*fields: tuple[str, Any]) -> tuple[str, CompactArray]:
    """The `topics` array of a request or response: per topic its name, then per partition
    `fields`."""
    return (
        "topics",
        CompactArray(("name", STRING), ("partitions", CompactArray(*fields, TAGS)), TAGS),
    )
