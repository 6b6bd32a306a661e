"""Hostile numbers end at the reader and are refused by the aggregator from any producer:
never billed, never encoded, never a crash, in every sink. And every billed number is exact."""

from __future__ import annotations

import csv
import io
from decimal import Decimal
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from otlp_receiver import OtlpReceiver
from test_windows import Collector, dev, row, state

from collector.aggregate.otlp import OtlpExporter
from collector.aggregate.records import (
    CSV_FIELDS,
    RECORD_MAX,
    BillingRecord,
    csv_row,
    decimal_text,
    from_json,
    from_msgpack,
    in_bounds,
    jsonl_line,
    make_record_id,
    seconds,
    to_json,
    to_msgpack,
)
from collector.aggregate.sinks import CsvSink, JsonlSink
from collector.aggregate.windows import Aggregator, WindowSettings
from collector.aggregate.windows.settings import MAX_TS
from collector.events import (
    MAX_BYTES,
    ContainerState,
    DeviceLimit,
    DeviceUsageRow,
    Event,
    UsageRow,
    decode,
    encode,
)

S = WindowSettings()
T0 = 1_800_000_000_000
U64 = (1 << 64) - 1


def run(events: list[Event]) -> tuple[list[BillingRecord], Aggregator]:
    agg = Aggregator(S)
    out: list[BillingRecord] = []
    for i, e in enumerate(events):
        agg.add("n1", decode(encode(e)), offset=i, record_ts_ms=T0 + i * 1000)
        out += agg.advance()
    return out + agg.flush(), agg


def test_a_wrapped_counter_next_to_a_normal_process_bills_the_normal_one_exactly() -> None:
    """HAMi #1181: one process's total wrapped below zero on the device another one uses. The
    sum used to exceed 2**64 - 1 and the record could not be encoded (aggregate exited 1)."""
    c = Collector()
    wrapped = UsageRow(2, 1002, 0, U64 - 5, 0, 0, U64 - 5, 0, 0)
    events: list[Event] = [
        c.appeared(T0, devices=[dev(limit=8 << 30)]),
        c.heartbeat(T0, state(1, row(1, 1000), wrapped, devices=[dev(limit=8 << 30)])),
        c.sample(T0 + 30_000, row(1, 1000), wrapped),
        c.heartbeat(T0 + 60_000, state(1, row(1, 1000), wrapped, devices=[dev(limit=8 << 30)])),
        c.gone(T0 + 90_000),
    ]
    records, agg = run(events)
    records = [r for r in records if r.kind == "container"]
    assert [r.memory_byte_seconds for r in records] == [Decimal(60_000), Decimal(30_000)]
    assert [r.peak_memory_bytes for r in records] == [1000, 1000]
    assert agg.stats.refused_values == 3
    for r in records:
        assert from_msgpack(to_msgpack(r)) == r


def test_a_heartbeat_that_states_one_cid_twice_is_applied_in_order() -> None:
    """The two states had one sort key down to their payloads: sorting them compared two
    ContainerStates, a TypeError that stopped the aggregator at every restart. The later
    state is taken, as if the heartbeat had stated it alone, and the other counted refused."""

    def stream(*states: ContainerState) -> list[Event]:
        c = Collector()
        return [c.appeared(T0), c.sample(T0, row(1, 100)), c.heartbeat(T0 + 1000, *states),
                c.sample(T0 + 90_000, row(1, 300))]  # fmt: skip

    twice, agg = run(stream(state(1, row(1, 100), pod="a"), state(1, row(1, 200), pod="b")))
    once, _ = run(stream(state(1, row(1, 200), pod="b")))
    assert twice == once
    assert agg.stats.refused_values == 1
    # 100 B for 1 s, 200 B until the last sample, then 300 B for max_gap (90 s)
    billed = sum(r.memory_byte_seconds for r in once if r.kind == "container")
    assert billed == 100 + 200 * 89 + 300 * 90


def test_an_impossible_limit_is_billed_as_none_and_counted() -> None:
    c = Collector()
    huge = [DeviceLimit(0, "GPU-0", U64, 1 << 40)]
    records, agg = run([c.appeared(T0, devices=huge), c.sample(T0, row(1, 5)), c.gone(T0 + 60_000)])
    (r,) = [r for r in records if r.kind == "container"]
    assert (r.memory_limit_byte_seconds, r.sm_limit_percent_seconds) == (0, 0)
    assert r.memory_byte_seconds == 300
    assert agg.stats.refused_values == 1


def test_an_impossible_sm_limit_zeroes_the_memory_limit_gauge_too() -> None:
    """The gauge shows the limit the records bill: none, before and after it is integrated."""
    c = Collector()
    agg = Aggregator(S)
    devices = [dev(0, limit=8 << 30, sm=20_000), dev(1, limit=4 << 30, sm=50)]
    agg.add("n1", c.appeared(0, devices=devices))
    agg.add("n1", c.sample(1_000, row(1, 5)))
    limits = [("GPU-0", 0), ("GPU-1", 4 << 30)]
    assert [(g.device_uuid, g.memory_limit_bytes) for g in agg.gauges()] == limits  # pending
    agg.add("n1", c.sample(200_000, row(1, 5)))
    agg.advance()
    agg.add("n1", c.sample(200_500, row(1, 5)))
    assert [(g.device_uuid, g.memory_limit_bytes) for g in agg.gauges()] == limits  # integrated
    assert agg.stats.refused_values == 1


def test_a_record_beyond_the_bounds_is_refused_not_built() -> None:
    """Bounded rows can still add up past 2**63 - 1 milli-units in a long enough window."""
    wide = WindowSettings(window_ms=1 << 40, max_gap_ms=1 << 40)
    agg = Aggregator(wide)
    c = Collector()
    rows = [row(p, MAX_BYTES) for p in range(64)]
    agg.add("n1", c.appeared(0))
    agg.add("n1", c.sample(0, *rows))
    agg.add("n1", c.gone(1 << 39))
    assert [r for r in agg.flush() if r.kind == "container"] == []
    assert agg.stats.refused_records == 1


# --- fuzz: hostile values through encode -> decode -> window -> record -> every sink ------

hostile = st.one_of(
    st.integers(-(1 << 63), U64),
    st.sampled_from([0, 1, MAX_BYTES, MAX_BYTES + 1, (1 << 63) - 1, 1 << 63, U64, -1, -(1 << 63)]),
    st.integers(0, 1 << 20),
)


@st.composite
def hostile_stream(draw: st.DrawFn) -> list[Event]:
    c = Collector()
    events: list[Event] = []
    for i in range(draw(st.integers(1, 25))):
        ts = T0 + i * 7_000 + draw(st.integers(0, 6_999))
        if draw(st.integers(0, 20)) == 0:
            ts = draw(hostile)
        cid = draw(st.integers(1, 2))
        limits = [DeviceLimit(d, f"GPU-{d}", draw(hostile), draw(hostile)) for d in range(2)]
        rows = [
            UsageRow(
                p, p, draw(st.integers(0, 2)), draw(hostile), 0, 0, 0, draw(hostile), draw(hostile)
            )
            for p in range(draw(st.integers(0, 3)))
        ]
        kind = draw(st.integers(0, 4))
        if kind == 0:
            events.append(c.appeared(ts, cid=cid, devices=limits))
        elif kind == 1:
            events.append(c.sample(ts, *rows, cid=cid))
        elif kind == 2:
            events.append(c.heartbeat(ts, state(cid, *rows, devices=limits)))
        elif kind == 3:
            events.append(c.limits(ts, limits, cid=cid))
        else:
            nrows = [DeviceUsageRow("GPU-0", draw(hostile), draw(hostile), draw(hostile))]
            events.append(c.node(ts, *nrows))
    return events


@pytest.fixture(scope="module")
def receiver() -> OtlpReceiver:
    with OtlpReceiver() as r:
        yield r


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(events=hostile_stream())
def test_hostile_event_values_reach_no_sink(
    events: list[Event], tmp_path: Path, receiver: OtlpReceiver
) -> None:
    agg = Aggregator(S)
    records: list[BillingRecord] = []
    for i, e in enumerate(events):
        agg.add("n1", decode(encode(e)), offset=i, record_ts_ms=T0 + i * 7_000)
        records += agg.advance()
    gauges = agg.gauges()
    records += agg.flush()
    assert all(in_bounds(r) for r in records)
    for g in gauges:
        assert (
            min(g.memory_used_bytes, g.memory_limit_bytes, g.sm_percent, g.nvml_memory_bytes) >= 0
        )
        assert max(g.memory_used_bytes, g.memory_limit_bytes, g.nvml_memory_bytes) <= RECORD_MAX
    for r in records:
        assert from_msgpack(to_msgpack(r)) == r
        assert msgspec.json.decode(jsonl_line(r), type=BillingRecord) == r
        assert msgspec.json.decode(to_json(r), type=BillingRecord) == r
    path = tmp_path / "b.csv"
    path.unlink(missing_ok=True)
    with CsvSink(path) as sink, JsonlSink(tmp_path / "b.jsonl", resume_at=0) as jsonl:
        sink.write(records)
        jsonl.write(records)
    rows = list(csv.reader(io.StringIO(path.read_text())))[1:]
    assert rows == [csv_row(r) for r in records]
    exporter = OtlpExporter(receiver.endpoint, timeout_s=5)
    try:
        exporter.record_window(records)
        exporter.set_gauges(gauges)
        assert exporter.flush() is True
    finally:
        exporter.shutdown()


@pytest.mark.parametrize(
    "wide", [False, True], ids=["default-windows", "31-day-windows-7-day-gap"]
)
def test_the_last_event_time_taken_is_written_by_every_sink_and_the_next_is_refused(
    tmp_path: Path, wide: bool
) -> None:
    """Event times are refused from 9999-01-01 on: the windows of the last one taken, even
    31-day ones (wider than the config allows, an hour) with the longest cap, end before the
    year 10 000, which the CSV and JSONL sinks
    write as ISO-8601 (an event in the year 11 476 used to be billed and crash both)."""
    day = 86_400_000
    settings_ = WindowSettings(window_ms=31 * day, max_gap_ms=7 * day) if wide else S
    last = MAX_TS
    for ts, taken in ((last, True), (last + 1, False)):
        agg = Aggregator(settings_)
        c = Collector()
        for i, e in enumerate([c.appeared(ts), c.sample(ts, row(1, 1000))]):
            agg.add("n1", e, offset=i, record_ts_ms=ts)
        records = [r for r in agg.flush() if r.kind == "container"]
        assert agg.stats.refused_values == (0 if taken else 2)
        if not taken:
            assert records == []
            continue
        assert records and max(r.window_end_ms for r in records) < MAX_TS + 1 + 365 * day
        csv_path, jsonl_path = tmp_path / f"{wide}.csv", tmp_path / f"{wide}.jsonl"
        with CsvSink(csv_path) as sink, JsonlSink(jsonl_path, resume_at=0) as jsonl:
            sink.write(records)
            jsonl.write(records)
        rows = list(csv.DictReader(io.StringIO(csv_path.read_text())))
        assert len(rows) == len(records)
        assert {r["window_end"][:4] for r in rows} == {"9999"}
        assert len(jsonl_path.read_text().splitlines()) == len(records)


# --- exact decimals -----------------------------------------------------------------------


def rec(milli: int) -> BillingRecord:
    return BillingRecord(
        window_start_ms=T0,
        window_end_ms=T0 + 60_000,
        node="n1",
        pod_uid="u",
        container="c",
        device_uuid="GPU-0",
        memory_byte_seconds=seconds(milli),
        memory_limit_byte_seconds=seconds(milli + 1),
        nvml_memory_byte_seconds=seconds(milli + 7),
        sm_percent_seconds=seconds(milli // 3),
        sm_limit_percent_seconds=seconds(999),
        peak_memory_bytes=1,
        observed_seconds=seconds(milli % 100_000),
        samples=1,
        record_id=make_record_id(T0, "n1", "u", "c", "GPU-0"),
    )


@given(
    milli=st.one_of(
        # 1e9 byte-seconds up to the most a record holds (RECORD_MAX milli-units, 9.2e15)
        st.integers(10**12, RECORD_MAX - 7),
        st.sampled_from([10**12, 2_250_000_000_000_123, RECORD_MAX - 8, RECORD_MAX - 7]),
    )
)
def test_seconds_are_exact_in_csv_jsonl_and_msgpack_from_1e9_to_the_bound(milli: int) -> None:
    r = rec(milli)
    text = csv_row(r)[CSV_FIELDS.index("memory_byte_seconds")]
    q, m = divmod(milli, 1000)
    assert text == f"{q}.{m:03d}" == decimal_text(r.memory_byte_seconds)
    assert int(text.replace(".", "")) == milli
    assert f'"memory_byte_seconds":{text},' in jsonl_line(r).decode()
    assert msgspec.json.decode(jsonl_line(r), type=BillingRecord) == r
    assert from_msgpack(to_msgpack(r)) == r == from_json(jsonl_line(r))


def test_a_record_past_the_bound_is_refused_by_every_decode() -> None:
    r = rec(RECORD_MAX - 6)  # (its NVML integral, + 7, is one past)
    for read, value in ((from_msgpack, to_msgpack(r)), (from_json, jsonl_line(r))):
        with pytest.raises(ValueError, match="outside"):
            read(value)
