"""Billing records as Apache Arrow columns: the schema the Parquet sink writes and `report`
reads, derived from `BillingRecord` (one declaration of the record's fields).

pyarrow (the `report` extra) is imported only by the commands that need it."""

from __future__ import annotations

import typing
from collections.abc import Collection, Sequence
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import msgspec

from .records import BillingRecord

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["arrow_schema", "to_table"]


def _arrow_type(t: Any, milli: bool = False) -> pa.DataType:
    import pyarrow as pa

    if t is int or (milli and t is Decimal):
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


_HINTS: dict[str, Any] = typing.get_type_hints(BillingRecord)


def arrow_schema(milli: Collection[str] = ()) -> pa.Schema:
    """The records' schema; the decimal fields named in `milli` as int64 milliseconds."""
    import pyarrow as pa

    return pa.schema(
        [pa.field(n, _arrow_type(_HINTS[n], n in milli)) for n in BillingRecord.__struct_fields__]
    )


def milliseconds(value: Decimal) -> int:
    """A record's seconds as integer milliseconds, exactly (a record's are n/1000; a decimal
    with more places is rounded half-even)."""
    return round(value.scaleb(3))


def to_table(records: Sequence[BillingRecord], milli: Collection[str] = ()) -> pa.Table:
    """The records as one Arrow table in `arrow_schema(milli)`: the decimals in `milli` as
    their exact integer milliseconds (a double gives n/1000 back only below 2^51),
    the others as doubles."""
    import pyarrow as pa

    schema = arrow_schema(milli)
    cols: dict[str, list[Any]] = {name: [] for name in schema.names}
    for r in records:
        for name, value in zip(schema.names, msgspec.structs.astuple(r), strict=True):
            cols[name].append(value)
    for name, values in cols.items():
        if _HINTS[name] is Decimal:
            cols[name] = list(map(milliseconds if name in milli else float, values))
    cols["labels"] = [list(d.items()) for d in cols["labels"]]
    return pa.table(cols, schema=schema)
