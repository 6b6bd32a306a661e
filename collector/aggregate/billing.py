"""The billing topic's wire format: one record per message, for any consumer.

Value: the record as a JSON object (`BillingRecord`, every field of its `version`), or msgpack with
the same field names when `billing_format = "msgpack"`. Key: `record_id`, so the compacted topic
keeps one message per record however often it is published again. Headers say what the value is:
`content-type` and `schema`. `schemas/billing.schema.json` is generated from the record type.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any, Final, Literal

import msgspec

from ..events import JSON_SCHEMA_DIALECT, too_deep
from .records import (
    KINDS,
    RECORD_MAX,
    RECORD_VERSION,
    SINCE_VERSION,
    BillingRecord,
    from_json,
    from_msgpack,
    to_json,
    to_msgpack,
)

SCHEMA_NAME: Final = "hami.billing.v1"
Format = Literal["json", "msgpack"]
CONTENT_TYPES: Final[dict[str, bytes]] = {
    "json": b"application/json",
    "msgpack": b"application/msgpack",
}


def billing_message(
    record: BillingRecord, fmt: Format = "json"
) -> tuple[bytes, bytes, list[tuple[str, bytes]]]:
    """(key, value, headers) of the message that carries `record`."""
    value = to_json(record) if fmt == "json" else to_msgpack(record)
    headers = [("content-type", CONTENT_TYPES[fmt]), ("schema", SCHEMA_NAME.encode())]
    return record.record_id.encode(), value, headers


def decode_billing(value: bytes) -> BillingRecord:
    """A billing value in either format (JSON starts with `{`, a msgpack map never does)."""
    try:
        if value[:1] == b"{":
            return from_json(value)
        return from_msgpack(value)
    except RecursionError:
        raise too_deep() from None


def json_schema() -> dict[str, Any]:
    """The published JSON Schema of a billing message value (schemas/billing.schema.json)."""
    schema: dict[str, Any] = msgspec.json.schema(BillingRecord)
    record = schema["$defs"]["BillingRecord"]
    # Every field of a record's version is always sent (defaults included), so a consumer may
    # rely on each of them; a field added by a later version is required from that version on
    # (the topic keeps the records of every version written to it).
    # Records from before versions carry none, and every reader takes them as version 1.
    required = BillingRecord.__struct_fields__
    record["required"] = [f for f in required if f not in SINCE_VERSION and f != "version"]
    record["additionalProperties"] = False
    record["properties"]["version"] = {"type": "integer", "minimum": 1, "maximum": RECORD_VERSION}
    record["properties"]["kind"]["enum"] = list(KINDS)
    # (what no reader takes: `checked`; a window's end after its start it cannot say)
    record["properties"]["record_id"]["minLength"] = 1
    record["allOf"] = [
        {
            "if": {"required": ["version"], "properties": {"version": {"minimum": v}}},
            "then": {"required": sorted(f for f, since in SINCE_VERSION.items() if since == v)},
        }
        for v in sorted(set(SINCE_VERSION.values()))
    ]
    for name, prop in record["properties"].items():
        if prop.get("format") == "decimal":
            # Sent as a JSON number with three decimals: the exact integral n/1000 (records.py),
            # n at most RECORD_MAX.
            record["properties"][name] = {
                "type": "number",
                "minimum": 0,
                "maximum": float(Decimal(RECORD_MAX) / 1000),
            }
        elif prop.get("type") == "integer" and name != "version":
            record["properties"][name] = {"type": "integer", "minimum": 0, "maximum": RECORD_MAX}
    schema["$schema"] = JSON_SCHEMA_DIALECT
    schema["title"] = SCHEMA_NAME
    schema["description"] = (
        "One billing record per Kafka message on the billing topic, keyed by record_id; "
        "headers content-type: application/json and schema: hami.billing.v1; "
        "the message's timestamp is window_start_ms. "
        + " ".join((BillingRecord.__doc__ or "").split())
    )
    return schema
