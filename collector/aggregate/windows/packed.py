"""A `UsageSample` held as the message bytes it came in, until its window closes.

Entries wait `max_skew_ms + lateness_ms` and more before they are applied and stay in the
history `HISTORY_GAPS x max_gap_ms` after: as decoded rows (a struct and its integer objects,
about 300 bytes a row) they were most of the aggregator's memory; as msgpack they are about 30
bytes a row. So a sample is decoded twice, both times by msgspec in C: once when it arrives
(`checked`), to validate it, and again at close (`rows`), as plain tuples that the per-row loop
unpacks (`apply.apply_tuples`).

`CheckedSample` is `UsageSample` with the bounds of `apply.row_ok` on every row and rows of
exactly the fields `UsageRow` declares, derived from those declarations (one declaration per
fact). Only a message it accepts is held as bytes, so the loop at close needs no bounds check
and can unpack each row; any other sample (an out-of-range value, a row with more fields than
this code knows) goes through `events.decode` and is held decoded, with every check, as
before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Final, TypeAlias

import msgspec

from ...events import MAX_BYTES, MAX_PERCENT, SCHEMA_VERSION, UsageRow, UsageSample

__all__ = ["CheckedSample", "Row", "checked", "rows", "sample", "tag_of"]

# A `UsageRow` as a tuple of its fields, in order.
Row: TypeAlias = tuple[int, int, int, int, int, int, int, int, int]
# The bounds `apply.row_ok` checks, per field of `UsageRow`.
_BOUNDS: Final = {"total": MAX_BYTES, "monitor": MAX_BYTES, "sm_util": MAX_PERCENT}


def _row_type(bounded: bool) -> Any:
    fields = msgspec.structs.fields(UsageRow)
    assert set(_BOUNDS) <= {f.name for f in fields}
    types = [
        Annotated[f.type, msgspec.Meta(ge=0, le=_BOUNDS[f.name])]
        if bounded and f.name in _BOUNDS
        else f.type
        for f in fields
    ]
    return tuple.__class_getitem__(tuple(types))


def _sample_type(bounded: bool) -> Any:
    """`UsageSample` with rows of tuples; `bounded`: with `row_ok`'s bounds and the version."""
    config = UsageSample.__struct_config__
    fields: list[tuple[str, Any]] = []
    for f in msgspec.structs.fields(UsageSample):
        if f.name == "v" and bounded:  # a newer version goes through events.decode
            fields.append((f.name, Annotated[f.type, msgspec.Meta(le=SCHEMA_VERSION)]))
        elif f.name == "rows":
            fields.append((f.name, list[_row_type(bounded)]))  # type: ignore[misc]
        else:
            fields.append((f.name, f.type))
    return msgspec.defstruct(
        "CheckedSample" if bounded else "PackedSample",
        fields,
        tag=config.tag,
        tag_field=config.tag_field,
        array_like=True,
        frozen=True,
        gc=False,
    )


CheckedSample: Final = _sample_type(True)
_checked: Final = msgspec.msgpack.Decoder(CheckedSample)
# At close the bytes are known to be a CheckedSample: decoded again without the checks.
_rows: Final = msgspec.msgpack.Decoder(_sample_type(False))
_sample: Final = msgspec.msgpack.Decoder(UsageSample)


def _tag() -> int:
    tag = UsageSample.__struct_config__.tag
    assert isinstance(tag, int)
    return tag


# A message is a msgpack array whose first element is the kind's tag.
tag_of: Final = _tag()


# checked(raw): `raw` as a `CheckedSample`; raises msgspec.ValidationError or DecodeError when
# it is not one (then `events.decode` says what it is). The decoder's own method: no call of ours
# in between, once per message.
checked: Final[Callable[[bytes], Any]] = _checked.decode


def rows(raw: bytes) -> list[Row]:
    """The rows of bytes `checked` accepted, as tuples in `UsageRow`'s field order."""
    out: list[Row] = _rows.decode(raw).rows
    return out


def sample(raw: bytes) -> UsageSample:
    """The bytes `checked` accepted, decoded as the event (the rarely taken paths: late events,
    gauges)."""
    return _sample.decode(raw)
