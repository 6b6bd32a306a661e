"""Billing records (topic `hami.billing.v1`, CSV and JSONL files) and current-value gauges.

A record covers one tumbling window x node x pod UID x container x device UUID. The aggregator
integrates in integer milli-units (byte-milliseconds, percent-milliseconds); a record carries each
integral n as the exact decimal n/1000 (`seconds(n)`: the integer's digits with a decimal point
before the last three), so every encoding below prints it exactly, at any magnitude: CSV and
JSON as a number with three decimals, msgpack as that text. Every number in a record lies in
[0, RECORD_MAX] (`in_bounds`); the aggregator never builds one outside it.

`record_id` is derived from the record's identity and revision only (never from its values), so
a consumer can de-duplicate a record that a restart publishes again.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import re
from collections.abc import Callable, Mapping
from decimal import Decimal
from typing import Final

import msgspec

from ..csvtext import cell

__all__ = [
    "CSV_FIELDS",
    "KINDS",
    "RECORD_MAX",
    "RECORD_VERSION",
    "SINCE_VERSION",
    "BillingRecord",
    "Gauge",
    "checked",
    "csv_header",
    "csv_row",
    "decimal_text",
    "from_json",
    "from_msgpack",
    "in_bounds",
    "iso_ms",
    "iso_utc",
    "TimeOutOfRange",
    "jsonl_line",
    "make_record_id",
    "record_order",
    "seconds",
    "to_json",
    "to_msgpack",
]

# The largest number a record carries (in milli-units for the integrals): what a signed 64-bit
# integer holds, so any consumer can parse every field exactly.
RECORD_MAX: Final = (1 << 63) - 1

# The record version written now, and the fields added after version 1 with the version that
# added them: a record of an older version does not carry them (they decode as their default).
RECORD_VERSION: Final = 2
SINCE_VERSION: Final[dict[str, int]] = {"reserved_idle_gpu_seconds": 2}


def seconds(milli: int) -> Decimal:
    """The exact decimal `milli / 1000`, always with three decimals (`seconds(1500)` is 1.500)."""
    q, r = divmod(milli, 1000)
    return Decimal(f"{q}.{r:03d}") if milli >= 0 else -seconds(-milli)


def decimal_text(value: Decimal) -> str:
    """A record's decimal as text with three decimals, exactly (no float is involved)."""
    return f"{value:.3f}"


class BillingRecord(msgspec.Struct, frozen=True):
    """Usage of one container on one GPU during one window. Seconds are exact decimals: the
    integrated milli-units / 1000."""

    window_start_ms: int
    window_end_ms: int
    node: str
    pod_uid: str
    container: str
    device_uuid: str
    memory_byte_seconds: Decimal
    memory_limit_byte_seconds: Decimal
    nvml_memory_byte_seconds: Decimal
    sm_percent_seconds: Decimal
    sm_limit_percent_seconds: Decimal
    peak_memory_bytes: int
    observed_seconds: Decimal
    samples: int
    record_id: str
    namespace: str = ""
    pod: str = ""
    # The pod's owning workload (Deployment, StatefulSet, DaemonSet, CronJob, Job, ...; Pod for a
    # bare pod) and its allowlisted labels; empty while the pod's identity is unknown.
    workload_kind: str = ""
    workload: str = ""
    labels: dict[str, str] = {}
    # Always 0 today (late events are counted, not corrected); kept so corrections can be added
    # without a schema change.
    revision: int = 0
    # Fair share of the physical GPU (`windows.allocate`): `container` and `node` rows, one
    # `gpu` row (observed_seconds: time the GPU was heard from; allocated/used: the sums) and
    # one `idle` row (allocated/used: observed minus the sums) per GPU and window.
    kind: str = "container"
    gpu_model: str = ""  # NVML name, empty without an inventory
    gpu_memory_bytes: int = 0  # 0 without an inventory
    allocated_gpu_seconds: Decimal = Decimal("0.000")
    used_gpu_seconds: Decimal = Decimal("0.000")
    overcommitted: bool = False  # the GPU's shares were scaled down to its observed time
    # The record's schema version (schemas/billing.schema.json; the topic stays
    # hami.billing.v1): 1, or 2 from `reserved_idle_gpu_seconds` on (`SINCE_VERSION`). A
    # version 1 record decodes with that field 0 but did not measure it. Every writer sets it;
    # a record without one was written before versions existed, so it reads as 1, as a CSV
    # without the version 2 column and a Parquet part without `version` do.
    version: int = 1
    # Version 2: the part of allocated_gpu_seconds accrued while the container's SM
    # utilisation on the device was 0 (`windows.allocate`); on a `gpu` row the sum, `idle` 0.
    reserved_idle_gpu_seconds: Decimal = Decimal("0.000")


class Gauge(msgspec.Struct, frozen=True):
    """Current values of one container on one GPU (for OTLP gauges)."""

    node: str
    pod_uid: str
    container: str
    device_uuid: str
    memory_used_bytes: int
    memory_limit_bytes: int
    sm_percent: int
    nvml_memory_bytes: int


KINDS: Final = ("node", "gpu", "idle", "container")  # the order of a GPU's rows with no pod


def record_order(r: BillingRecord) -> tuple[int, str, str, str, str, int]:
    """The order records are written in, live and in replay alike (so their files match)."""
    return (
        r.window_start_ms,
        r.node,
        r.pod_uid,
        r.container,
        r.device_uuid,
        KINDS.index(r.kind),
    )


# The window size whose records' ids do not name it: the default keeps the ids it always had
# (other sizes' ids name their size since 2026-12-04).
UNSIZED_ID_WINDOW_MS: Final = 60_000


def make_record_id(
    window_start_ms: int,
    node: str,
    pod_uid: str,
    container: str,
    device_uuid: str,
    revision: int = 0,
    kind: str = "container",
    window_ms: int = UNSIZED_ID_WINDOW_MS,
) -> str:
    text = f"{window_start_ms}|{node}|{pod_uid}|{container}|{device_uuid}|{revision}"
    if kind in ("gpu", "idle"):  # container and node rows keep the ids they always had
        text += f"|{kind}"
    if window_ms != UNSIZED_ID_WINDOW_MS:
        # [t, t+60 s) and [t, t+300 s) are different records: a group started with a new size
        # publishes to the same topic, where one id would make a consumer (and compaction)
        # keep one of the two.
        text += f"|{window_ms}ms"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


_EPOCH: Final = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
# The times a record's ISO text can name: four-digit UTC years.
FIRST_MS: Final = -62_135_596_800_000  # 0001-01-01T00:00:00Z
LAST_MS: Final = 253_402_300_799_999  # 9999-12-31T23:59:59.999Z


class TimeOutOfRange(ValueError):
    """An ISO-8601 time that lies beyond the UTC years 0001 to 9999."""


_FRACTION: Final = re.compile(r"[.,](\d+)")


def iso_ms(text: str) -> int:
    """An ISO-8601 time in epoch milliseconds, ValueError if it is none. One without a UTC
    offset is UTC, never the local time of the machine that reads it. A time within a
    millisecond is the next millisecond (integer arithmetic, no float): the windows starting in
    `[from, to)` are then exactly those starting at or after `from` and before `to`."""
    when = dt.datetime.fromisoformat(text)
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    delta = when - _EPOCH
    us = (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
    # datetime keeps six decimals and drops the rest: a time past them lies after `us`
    fraction = _FRACTION.search(text)
    if fraction is not None and fraction.group(1)[6:].strip("0"):
        us += 1
    ms = -(-us // 1000)
    # An offset takes a time up to a day beyond the years datetime and a day folder name,
    # where every later use of it (a chart's axis, a folder's name) fails.
    if ms < FIRST_MS:
        raise TimeOutOfRange("before 0001-01-01T00:00:00Z")
    if ms > LAST_MS:
        raise TimeOutOfRange("after 9999-12-31T23:59:59.999Z")
    return ms


def iso_utc(ms: int) -> str:
    """`2026-11-29T22:37:00Z`; milliseconds are shown only when not zero."""
    seconds, millis = divmod(ms, 1000)
    text = dt.datetime.fromtimestamp(seconds, tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{text}.{millis:03d}Z" if millis else f"{text}Z"


# --- msgpack (Kafka) -----------------------------------------------------------------------

# Map encoding (field names on the wire): the billing topic is read by other teams' tools.
_msgpack_encoder: Final = msgspec.msgpack.Encoder()
_msgpack_decoder: Final = msgspec.msgpack.Decoder(BillingRecord)


# The fields a record of each version carries, none with a default: every writer sends them
# all, so a record that lacks one was cut, hand-made or written before kinds and allocation (the
# first records), and a report would bill its defaults (0) as measured; a CSV without their
# columns is refused too. `version` itself may be missing (records before versions: 1).
def _carried(version: int) -> type[msgspec.Struct]:
    fields = [
        (f, msgspec.Raw)  # present is all it checks: the values were decoded as the record's
        for f in BillingRecord.__struct_fields__
        if f != "version" and SINCE_VERSION.get(f, 1) <= version
    ]
    return msgspec.defstruct(f"CarriedByVersion{version}", fields)


_CARRIED: Final = {v: _carried(v) for v in range(1, RECORD_VERSION + 1)}
_carried_json: Final = {v: msgspec.json.Decoder(t).decode for v, t in _CARRIED.items()}
_carried_msgpack: Final = {v: msgspec.msgpack.Decoder(t).decode for v, t in _CARRIED.items()}


def _whole(
    record: BillingRecord, payload: bytes, decoders: Mapping[int, Callable[[bytes], object]]
) -> BillingRecord:
    """`record` if it is one its writer could have sent: a version this reader knows, every
    field of that version, a known kind, values `checked` takes; else ValueError (a
    msgspec.ValidationError naming the missing field)."""
    decode = decoders.get(record.version)
    if decode is None:
        raise ValueError(f"version {record.version} is not one of 1 to {RECORD_VERSION}")
    decode(payload)
    if record.kind not in KINDS:
        raise ValueError(f"kind {record.kind!r} is not one of {', '.join(KINDS)}")
    return checked(record)


def checked(record: BillingRecord) -> BillingRecord:
    """`record` if every number of it is one the aggregator can write, else ValueError: the
    codecs take NaN, infinities and negatives as decimals, and such a record would fail the
    report's arithmetic or bill a negative amount."""
    for name in BillingRecord.__struct_fields__:
        value = getattr(record, name)
        if isinstance(value, Decimal) and not value.is_finite():
            raise ValueError(f"{name} is not a finite number")
    try:
        ok = in_bounds(record)
    except ArithmeticError:  # an exponent beyond what Decimal's context computes with
        ok = False
    if not ok:
        raise ValueError(f"a number outside [0, {RECORD_MAX}] (seconds in milli-units)")
    # What no aggregator writes, and a bill would count: a window that ends where or before it
    # starts, a record no id names (one per id is billed).
    if record.window_end_ms <= record.window_start_ms:
        raise ValueError("window_end is not after window_start")
    if not record.record_id:
        raise ValueError("record_id is empty")
    return record


def in_bounds(record: BillingRecord) -> bool:
    """Every number of `record` lies in [0, RECORD_MAX] (integrals in milli-units)."""
    r = record
    ints = (
        r.window_start_ms,
        r.window_end_ms,
        r.peak_memory_bytes,
        r.samples,
        r.revision,
        r.gpu_memory_bytes,
    )
    decimals = (
        r.memory_byte_seconds,
        r.memory_limit_byte_seconds,
        r.nvml_memory_byte_seconds,
        r.sm_percent_seconds,
        r.sm_limit_percent_seconds,
        r.observed_seconds,
        r.allocated_gpu_seconds,
        r.used_gpu_seconds,
        r.reserved_idle_gpu_seconds,
    )
    return all(0 <= x <= RECORD_MAX for x in ints) and all(
        0 <= x * 1000 <= RECORD_MAX for x in decimals
    )


def to_msgpack(record: BillingRecord) -> bytes:
    return _msgpack_encoder.encode(record)


def from_msgpack(payload: bytes) -> BillingRecord:
    return _whole(_msgpack_decoder.decode(payload), payload, _carried_msgpack)


# --- CSV -----------------------------------------------------------------------------------

_SECONDS_FIELDS: Final = (
    "memory_byte_seconds",
    "memory_limit_byte_seconds",
    "nvml_memory_byte_seconds",
    "sm_percent_seconds",
    "sm_limit_percent_seconds",
)
CSV_FIELDS: Final[tuple[str, ...]] = (
    "window_start",
    "window_end",
    "node",
    "pod_uid",
    "container",
    "device_uuid",
    "namespace",
    "pod",
    "workload_kind",
    "workload",
    "labels",
    *_SECONDS_FIELDS,
    "peak_memory_bytes",
    "observed_seconds",
    "samples",
    "record_id",
    "revision",
    "kind",
    "gpu_model",
    "gpu_memory_bytes",
    "allocated_gpu_seconds",
    "used_gpu_seconds",
    "overcommitted",
    "reserved_idle_gpu_seconds",  # version 2: appended, so older files keep their columns
)


def csv_header() -> list[str]:
    return list(CSV_FIELDS)


def _labels_json(labels: dict[str, str]) -> str:
    """The labels as one JSON object in a CSV cell, keys sorted (the same bytes every time)."""
    return _json_encoder.encode(dict(sorted(labels.items()))).decode()


def csv_row(record: BillingRecord) -> list[str]:
    """One row in `CSV_FIELDS` order (quote it with the csv module)."""
    r = record
    return [
        iso_utc(r.window_start_ms),
        iso_utc(r.window_end_ms),
        cell(r.node),
        cell(r.pod_uid),
        cell(r.container),
        cell(r.device_uuid),
        cell(r.namespace),
        cell(r.pod),
        cell(r.workload_kind),
        cell(r.workload),
        _labels_json(r.labels),
        decimal_text(r.memory_byte_seconds),
        decimal_text(r.memory_limit_byte_seconds),
        decimal_text(r.nvml_memory_byte_seconds),
        decimal_text(r.sm_percent_seconds),
        decimal_text(r.sm_limit_percent_seconds),
        str(r.peak_memory_bytes),
        decimal_text(r.observed_seconds),
        str(r.samples),
        r.record_id,
        str(r.revision),
        r.kind,
        cell(r.gpu_model),
        str(r.gpu_memory_bytes),
        decimal_text(r.allocated_gpu_seconds),
        decimal_text(r.used_gpu_seconds),
        "true" if r.overcommitted else "false",
        decimal_text(r.reserved_idle_gpu_seconds),
    ]


# --- JSON lines ----------------------------------------------------------------------------

# Decimals as JSON numbers (their exact text), not strings.
_json_encoder: Final = msgspec.json.Encoder(decimal_format="number")


def to_json(record: BillingRecord) -> bytes:
    """The record as one JSON object, every field, decimals as exact JSON numbers."""
    return _json_encoder.encode(record)


_json_decoder: Final = msgspec.json.Decoder(BillingRecord)


def from_json(payload: bytes) -> BillingRecord:
    """The record of a JSON object (a billing message's value, a JSON Lines line); extra keys
    (a line's `window_start`/`window_end`) are skipped."""
    return _whole(_json_decoder.decode(payload), payload, _carried_json)


def jsonl_line(record: BillingRecord) -> bytes:
    """One JSON object and a trailing newline: the ISO window bounds first, then every record
    field. `msgspec.json.decode(line, type=BillingRecord)` gives the record back."""
    obj: dict[str, object] = {
        "window_start": iso_utc(record.window_start_ms),
        "window_end": iso_utc(record.window_end_ms),
    }
    obj.update(msgspec.structs.asdict(record))
    return _json_encoder.encode(obj) + b"\n"
