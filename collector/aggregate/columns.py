"""Billing records as Apache Arrow columns: the schema the Parquet sink writes and `report`
reads, derived from `BillingRecord` (one declaration of the record's fields).

pyarrow (the `report` extra) is imported only by the commands that need it."""

from __future__ import annotations

import typing
from collections.abc import Sequence
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import msgspec

from .records import BillingRecord

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["arrow_schema", "to_table"]


def _arrow_type(t: Any) -> pa.DataType:
    import pyarrow as pa

    if t is int:
        return pa.int64()
    if t is float or t is Decimal:
        # Record decimals (exact n/1000 in CSV, JSON and the topic) as doubles for analysis.
        return pa.float64()
    if t is bool:
        return pa.bool_()
    if t is str:
        return pa.string()
    if t == dict[str, str]:
        return pa.map_(pa.string(), pa.string())
    raise TypeError(f"no Arrow type for {t!r}")


def arrow_schema() -> pa.Schema:
    import pyarrow as pa

    hints = typing.get_type_hints(BillingRecord)
    return pa.schema([pa.field(n, _arrow_type(hints[n])) for n in BillingRecord.__struct_fields__])


def to_table(records: Sequence[BillingRecord]) -> pa.Table:
    """The records as one Arrow table in `arrow_schema()`."""
    import pyarrow as pa

    schema = arrow_schema()
    cols: dict[str, list[Any]] = {name: [] for name in schema.names}
    for r in records:
        for name, value in zip(schema.names, msgspec.structs.astuple(r), strict=True):
            cols[name].append(float(value) if isinstance(value, Decimal) else value)
    cols["labels"] = [list(d.items()) for d in cols["labels"]]
    return pa.table(cols, schema=schema)
