"""Billing records for a report, as one Arrow table: from CSV or JSON Lines files, the billing
topic, or a Parquet folder (`aggregate --parquet`), only the windows starting in [from, to).

CSV, JSONL and Kafka records are decoded one by one with the record codecs; Parquet is read
column-wise, only the columns the report needs, and only the day partitions of the range."""

from __future__ import annotations

import csv
import os
import re
import stat
import typing
from collections.abc import Iterable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from .. import csvtext
from ..aggregate.columns import to_table
from ..aggregate.records import (
    CSV_FIELDS,
    KINDS,
    RECORD_MAX,
    RECORD_VERSION,
    SINCE_VERSION,
    BillingRecord,
    checked,
    from_json,
    iso_ms,
    seconds,
)
from ..events import too_deep
from .summary import TIMES

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.parquet as pq

__all__ = [
    "LoadError",
    "csv_records",
    "from_parquet",
    "from_records",
    "jsonl_records",
]


class LoadError(Exception):
    """Input that cannot be read as billing records; one line."""


_HINTS = typing.get_type_hints(BillingRecord)
_INT = {n for n, t in _HINTS.items() if t is int}
_FLOAT = {n for n, t in _HINTS.items() if t is float}


def _csv_record(row: dict[str | None, Any]) -> BillingRecord:
    # csv.DictReader fills a short row with None and puts a long row's extra fields under None:
    # a row cut off (a file still being written, a disk that filled up) or one that is no row
    # of this header, never a record with fields left out.
    if None in row:
        header = len(row) - 1
        raise ValueError(f"the row has {header + len(row[None])} fields, the header {header}")
    if None in row.values():
        given = sum(v is not None for v in row.values())
        raise ValueError(f"the row has {given} of the header's {len(row)} fields")
    # CSV has no version column: a file without a later version's column holds records of the
    # version before it (its columns are only ever appended).
    missing = [v for f, v in SINCE_VERSION.items() if f not in row]
    obj: dict[str, Any] = {"version": min(missing) - 1 if missing else RECORD_VERSION}
    for name, text in row.items():
        if name == "window_start":
            obj["window_start_ms"] = iso_ms(text)
        elif name == "window_end":
            obj["window_end_ms"] = iso_ms(text)
        elif name in _INT:
            obj[name] = int(text)
        elif name in _FLOAT:
            obj[name] = float(text)
        elif name == "labels":
            obj[name] = msgspec.json.decode(text or "{}")
        elif name == "overcommitted":
            if text not in ("true", "false"):  # (what the sink writes; "maybe" read as false)
                raise ValueError(f"overcommitted {csvtext.text(text)[:20]!r} is not true or false")
            obj[name] = text == "true"
        elif name in CSV_FIELDS:
            obj[name] = csvtext.text(text)
    record = msgspec.convert(obj, BillingRecord)
    if record.kind not in KINDS:  # (the JSON and msgpack codecs check it as they decode)
        raise ValueError(f"kind {record.kind!r} is not one of {', '.join(KINDS)}")
    return checked(record)


def _read_csv(path: Path) -> Iterator[BillingRecord]:
    try:
        with path.open(newline="", encoding="utf-8") as f:
            rows = csv.DictReader(f)
            if rows.fieldnames is not None:  # (an empty file: no records yet)
                _billing_header(path, rows.fieldnames)
            for row in rows:
                try:
                    yield _csv_record(row)
                except (ValueError, TypeError, msgspec.ValidationError, msgspec.DecodeError) as e:
                    raise LoadError(f"{path}:{rows.line_num}: not a billing record: {e}") from None
                except RecursionError:  # (a labels cell nested a thousand levels deep)
                    raise LoadError(
                        f"{path}:{rows.line_num}: not a billing record: {too_deep()}"
                    ) from None
            # Every row is written with its line end: a last row without one was cut inside
            # its last field ("12.345" read as 12.3), which no other check can see.
            if rows.line_num > 1 and not _ends_a_line(f):
                raise LoadError(
                    f"{path}:{rows.line_num}: not a billing record: the file ends inside the row "
                    "(no line end: cut off)"
                )
    except UnicodeDecodeError:  # the bytes are not shown: one line, whatever they are
        raise LoadError(f"{path}: not a billing record CSV: not UTF-8 text") from None
    except csv.Error as e:
        raise LoadError(f"{path}: not a billing record CSV: {e}") from None
    except OSError as e:
        raise LoadError(f"{path}: {e.strerror}") from None


def _ends_a_line(f: typing.TextIO) -> bool:
    """Whether the file `f` (read to its end) ends with a line end."""
    raw = f.buffer
    size = raw.seek(0, os.SEEK_END)
    raw.seek(size - 1)
    return bool(raw.read(1) in (b"\n", b"\r"))


def _billing_header(path: Path, names: typing.Sequence[str]) -> None:
    """A billing CSV's header: every column of the first record version, later versions'
    columns or not, nothing else (any other file gave an empty bill, exit 0)."""
    unknown = [n for n in names if n not in CSV_FIELDS]
    lacking = [n for n in CSV_FIELDS if n not in names and n not in SINCE_VERSION]
    if lacking:
        what = f"no {lacking[0]} column"
    elif unknown:
        what = f"an unknown column {unknown[0]!r}"
    elif len(set(names)) != len(names):
        what = "a column twice"
    else:
        return
    raise LoadError(f"{path}: not a billing record CSV: its header has {what}")


def _read_jsonl(path: Path) -> Iterator[BillingRecord]:
    try:
        with path.open("rb") as f:
            for i, line in enumerate(f, start=1):
                if line.strip():
                    try:
                        record = from_json(line)
                    except (ValueError, msgspec.ValidationError, msgspec.DecodeError) as e:
                        raise LoadError(f"{path}:{i}: not a billing record: {e}") from None
                    except RecursionError:
                        raise LoadError(f"{path}:{i}: not a billing record: {too_deep()}") from None
                    yield record
    except OSError as e:
        raise LoadError(f"{path}: {e.strerror}") from None


def from_records(records: Iterable[BillingRecord], from_ms: int, to_ms: int) -> pa.Table:
    """The records of [from, to) as `Summary.add` takes them: times as their exact
    milliseconds, straight from the decimals."""
    return to_table([r for r in records if from_ms <= r.window_start_ms < to_ms], TIMES)


def _open(path: Path) -> Path:
    """`path` if it is a regular file (or a symlink to one); a folder, /dev/null or a FIFO
    said "no such file" of a file that is there."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise LoadError(f"{path}: no such file") from None
    except OSError as e:
        raise LoadError(f"{path}: {e.strerror}") from None
    if stat.S_ISDIR(mode):
        raise LoadError(f"{path}: is a directory")
    if not stat.S_ISREG(mode):
        raise LoadError(f"{path}: not a regular file")
    return path


def csv_records(paths: Iterable[Path]) -> Iterator[BillingRecord]:
    return (r for p in paths for r in _read_csv(_open(p)))


def jsonl_records(paths: Iterable[Path]) -> Iterator[BillingRecord]:
    return (r for p in paths for r in _read_jsonl(_open(p)))


def _parquet_type_ok(actual: pa.DataType, expected: pa.DataType) -> bool:
    import pyarrow as pa

    if pa.types.is_string(expected):  # dictionary-encoded or large strings read as strings
        if pa.types.is_dictionary(actual):
            actual = actual.value_type
        return bool(pa.types.is_string(actual) or pa.types.is_large_string(actual))
    return bool(actual.equals(expected))


_DECIMALS = {n for n, t in _HINTS.items() if t is Decimal}
# The double the Parquet sink writes for the largest seconds a record holds, RECORD_MAX / 1000
# (the double nearest it, 2^63 / 1000): a larger double is no record's, a smaller one is.
_SECONDS_MAX = float(seconds(RECORD_MAX))


def _any(mask: pa.Array | pa.ChunkedArray) -> bool:
    """Whether any of `mask` is true; a null (a value a missing column reads as) is not."""
    import pyarrow.compute as pc

    result: object = pc.any(mask, skip_nulls=True, min_count=0).as_py()
    return result is True


def _null_label(labels: pa.Array | pa.ChunkedArray) -> bool:
    """Whether a map of `labels` has a null value (a record's labels are strings; its key
    cannot be null in Parquet)."""
    import pyarrow as pa

    for chunk in labels.chunks if isinstance(labels, pa.ChunkedArray) else [labels]:
        first, last = chunk.offsets[0].as_py(), chunk.offsets[-1].as_py()
        if chunk.items.slice(first, last - first).null_count:  # (`items` ignores a slice)
            return True
    return False


def _parquet_check(batch: pa.RecordBatch) -> str | None:
    """Why `batch` holds a number no record can, as `checked` says it; None if it holds none.
    Null is what a missing column reads as: allowed only for a field a record of its version
    does not carry (`SINCE_VERSION`; no version reads as 1)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    names = batch.schema.names
    version = (
        pc.fill_null(batch.column("version"), 1)
        if "version" in names
        else pa.array([1] * batch.num_rows, pa.int64())
    )
    for name in names:
        if name == "version":
            continue
        nulls = pc.is_null(batch.column(name))
        if name in SINCE_VERSION:
            nulls = pc.and_(nulls, pc.greater_equal(version, SINCE_VERSION[name]))
        if _any(nulls):
            return f"{name} is null"
    if "labels" in names and _null_label(batch.column("labels")):
        return "a label's value is null"
    if _any(pc.or_(pc.less(version, 1), pc.greater(version, RECORD_VERSION))):
        return f"a version not one of 1 to {RECORD_VERSION}"
    if "kind" in names and _any(pc.invert(pc.is_in(batch.column("kind"), pa.array(KINDS)))):
        return f"a kind not one of {', '.join(KINDS)}"
    # (window_end_ms is not read: the report places a record by its window start alone)
    if "record_id" in names and _any(pc.equal(pc.utf8_length(batch.column("record_id")), 0)):
        return "record_id is empty"
    numbers = [n for n in names if n in _DECIMALS or (n in _INT and n != "version")]
    for name in numbers:
        if name in _DECIMALS and _any(pc.invert(pc.is_finite(batch.column(name)))):
            return f"{name} is not a finite number"
    for name in numbers:
        col = batch.column(name)
        most = _SECONDS_MAX if name in _DECIMALS else RECORD_MAX
        if _any(pc.or_(pc.less(col, 0), pc.greater(col, most))):
            return f"a number outside [0, {RECORD_MAX}] (seconds in milli-units)"
    return None


def _arrow_error(path: str, e: Exception) -> LoadError:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    for prefix in (f"Could not open Parquet input source '{path}': ", f"{path}: "):
        text = text.removeprefix(prefix)
    if isinstance(e, OSError) and e.strerror:
        text = e.strerror
    return LoadError(f"{path}: not a billing record Parquet file: {text}")


_DAY = re.compile(r"day=\d{4}-\d{2}-\d{2}")


def from_parquet(
    root: Path,
    from_ms: int,
    to_ms: int,
    columns: list[str],
    batch_rows: int = 1 << 20,
    read_elsewhere: Iterable[str] = (),
) -> Iterator[pa.Table]:
    """The day partitions that can hold [from, to), then a row filter on the window start;
    a table per day, so memory stays bounded by a day whatever the range.

    One record per `record_id`, the last one read (a second aggregator group writing to the
    same folder writes every window again: its parts doubled the bill); a record's copies are
    in one day's folder, its window start's. `read_elsewhere`: the ids of records the report
    has from other inputs, which win.

    Read part by part (`ParquetFile`, no dataset scanner: an aggregator writes about a part per
    window it closes, and the scanner's set-up per part cost twice the read of a small one), so
    that a damaged part (cut short, not Parquet, a column of another type) or a number no
    record can hold (null, NaN, infinite, negative, above RECORD_MAX) is a LoadError naming it,
    as a CSV or JSONL line is. The numbers are checked a table at a time, not a part at a time
    (the check's cost is per call); a table that fails is checked again part by part to name
    the first part at fault, before any later part's damage is reported."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from ..aggregate.columns import arrow_schema
    from ..aggregate.parquet import day_of

    if not root.is_dir():
        raise LoadError(f"{root}: not a directory")
    if from_ms >= to_ms:
        return
    # The day folders there are, not every day of the range: `--from 1970-01-01` would
    # otherwise look for 20 000 folders.
    first, last = day_of(from_ms), day_of(to_ms - 1)
    try:
        days = sorted(
            e.name
            for e in os.scandir(root)
            if _DAY.fullmatch(e.name) and first <= e.name[4:] <= last
        )
    except OSError as e:
        raise LoadError(f"{root}: {e.strerror}") from None
    # (a FIFO of that name blocked the read for good: each is a regular file, or one line)
    files = [[str(_open(f)) for f in sorted((root / d).glob("part-*.parquet"))] for d in days]
    expected = arrow_schema()
    wanted = columns
    columns = [*columns, "record_id"] if "record_id" not in columns else columns
    # Strings stay dictionary-encoded as Parquet stores them: filters and group-bys then move
    # small integers, not the strings of every row (not a record's id: one a row).
    strings = [
        n for n in columns if pa.types.is_string(expected.field(n).type) and n != "record_id"
    ]
    with_ids = pa.schema(
        [
            pa.field(n, pa.dictionary(pa.int32(), pa.string()))
            if n in strings
            else expected.field(n)
            for n in columns
        ]
    )
    without_ids = pa.schema([f for f in with_ids if f.name in wanted])
    target = with_ids
    pending: list[tuple[str, pa.RecordBatch]] = []
    elsewhere = pa.array(sorted(set(read_elsewhere)), pa.string())

    def unique(table: pa.Table) -> pa.Table:
        ids = table["record_id"]
        if len(elsewhere):
            table = table.filter(pc.invert(pc.is_in(ids, value_set=elsewhere)))
            ids = table["record_id"]
        if pc.count_distinct(ids, mode="all").as_py() < table.num_rows:
            at = pa.table({"id": ids, "at": pa.array(range(table.num_rows), pa.int64())})
            last = at.group_by("id", use_threads=False).aggregate([("at", "max")])["at_max"]
            table = table.take(pc.take(last, pc.sort_indices(last)))  # (in the order read)
        return table.select(wanted)

    def checked_table() -> pa.Table:
        table = pa.Table.from_batches([b for _, b in pending], schema=target)
        if _parquet_check(table) is not None:
            for path, batch in pending:
                why = _parquet_check(batch)
                if why is not None:
                    raise LoadError(f"{path}: not a billing record: {why}")
        # Each part has dictionaries of its own; the report's group-by takes one per column.
        return _milliseconds(table.unify_dictionaries())

    def opened(path: str) -> pq.ParquetFile:
        part = pq.ParquetFile(path, read_dictionary=strings)
        physical = part.schema_arrow
        for name in columns:
            i = physical.get_field_index(name)
            want = expected.field(name).type
            if i >= 0 and not _parquet_type_ok(physical.field(i).type, want):
                got = physical.field(i).type
                raise LoadError(
                    f"{path}: not a billing record Parquet file: {name} is {got}, not {want}"
                )
        if physical.get_field_index("window_start_ms") < 0:
            raise LoadError(f"{path}: not a billing record Parquet file: no window_start_ms")
        return part

    def failed(path: str, e: Exception) -> LoadError:
        if pending:
            checked_table()  # an earlier part's number first, as read in order
        return e if isinstance(e, LoadError) else _arrow_error(path, e)

    for paths in files:
        # A day's parts are opened first: their window starts say whether two of them can
        # hold one record (only parts whose ranges overlap can: a second group's, or the
        # replicas of one, each with its own nodes), and only then are the ids read.
        parts: list[tuple[str, pq.ParquetFile]] = []
        fault: tuple[str, Exception] | None = None
        for path in paths:
            try:
                parts.append((path, opened(path)))
            except (pa.ArrowException, OSError, LoadError) as e:
                fault = (path, e)  # (raised once the parts before it are read)
                break
        spans = [_window_starts(part) for _, part in parts]
        ids = bool(len(elsewhere)) or _overlapping(spans)
        target = with_ids if ids else without_ids
        for (path, part), span in zip(parts, spans, strict=True):
            try:
                physical = part.schema_arrow
                present = [n for n in target.names if physical.get_field_index(n) >= 0]
                # every window start in [from, to) (the usual part, of one close): no filter
                inside = span is not None and from_ms <= span[0] and span[1] < to_ms
                for batch in part.iter_batches(batch_size=batch_rows, columns=present):
                    if not inside:
                        start = batch.column("window_start_ms")
                        batch = batch.filter(
                            pc.and_(pc.greater_equal(start, from_ms), pc.less(start, to_ms))
                        )
                    if not batch.num_rows:
                        continue
                    pending.append((path, _conform(batch, target)))
            except (pa.ArrowException, OSError, LoadError) as e:
                raise failed(path, e) from None
        if fault is not None:
            raise failed(*fault) from None
        if pending:
            table = checked_table()
            yield unique(table) if ids else table
            pending = []


def _window_starts(part: pq.ParquetFile) -> tuple[int, int] | None:
    """The least and greatest window start of the part, by its statistics (None: unknown)."""
    meta = part.metadata
    leaves = [meta.schema.column(j).path for j in range(meta.num_columns)]
    i = leaves.index("window_start_ms")  # (a leaf's index: `labels` is a map of two)
    least = most = None
    for g in range(meta.num_row_groups):
        stats = meta.row_group(g).column(i).statistics
        if stats is None or not stats.has_min_max or stats.null_count:
            return None
        least = stats.min if least is None else min(least, stats.min)
        most = stats.max if most is None else max(most, stats.max)
    return None if least is None or most is None else (least, most)


def _overlapping(spans: list[tuple[int, int] | None]) -> bool:
    """Whether two parts of these window-start spans may hold a window start in common (one
    writer closes its windows in order: its parts never do)."""
    if any(span is None for span in spans):
        return len(spans) > 1
    ordered = sorted(span for span in spans if span is not None)
    return any(b[0] <= a[1] for a, b in zip(ordered, ordered[1:], strict=False))


def _milliseconds(table: pa.Table) -> pa.Table:
    """`table` with its `TIMES` as `Summary.add` takes them: each double as its nearest
    millisecond (the decimal's own below 2^51 ms; above, the double has lost it), at most
    RECORD_MAX, so the largest record reads as CSV and JSON give it (its double is 2^63 ms)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    most = pa.scalar(RECORD_MAX, pa.uint64())
    for name in TIMES.intersection(table.column_names):
        # unsigned: 2^63 ms, a valid double, is one past int64
        ms = pc.cast(pc.round(pc.multiply(table[name], 1000)), pa.uint64())
        ms = pc.cast(pc.min_element_wise(ms, most), pa.int64())
        table = table.set_column(table.schema.get_field_index(name), name, ms)
    return table


def _conform(batch: pa.RecordBatch, target: pa.Schema) -> pa.RecordBatch:
    """`batch` with `target`'s columns, in its order and types: a column a part lacks (a
    field later than its records' version) reads as null, as the dataset reader made it."""
    import pyarrow as pa

    arrays = []
    for field in target:
        i = batch.schema.get_field_index(field.name)
        if i < 0:
            arrays.append(pa.nulls(batch.num_rows, field.type))
            continue
        column = batch.column(i)
        arrays.append(column if column.type.equals(field.type) else column.cast(field.type))
    return pa.RecordBatch.from_arrays(arrays, schema=target)
