"""The intake's short way for usage samples (`windows.packed`, `intake`) changes no answer: a
sample is held as its bytes only when every check of the long way would pass, and a stream fed
through the intake gives the records and counters of the same stream decoded and added."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_windows import Collector, dev, row, state

from collector.aggregate.intake import InputStats, add_kafka_records, add_record
from collector.aggregate.records import BillingRecord
from collector.aggregate.windows import Aggregator, WindowSettings
from collector.aggregate.windows.apply import row_ok
from collector.aggregate.windows.packed import checked, rows, sample
from collector.events import (
    MAX_BYTES,
    MAX_PERCENT,
    SCHEMA_VERSION,
    Event,
    UnknownSchemaVersion,
    UsageRow,
    UsageSample,
    decode,
    encode,
)

S = WindowSettings()
T0 = 1_800_000_020_000
I64 = st.integers(-(1 << 63), (1 << 63) - 1)
# values near every bound of row_ok, and anywhere in msgpack's integer range
EDGY = st.one_of(
    st.sampled_from([-1, 0, 1, MAX_PERCENT, MAX_PERCENT + 1, MAX_BYTES, MAX_BYTES + 1]),
    st.integers(0, 1 << 40),
    I64,
)
ROWS = st.lists(st.lists(EDGY, min_size=9, max_size=9), max_size=5)


def _msg(v: int, rows_: list[list[int]], extra_row_field: bool, extra_field: bool) -> bytes:
    body: list[Any] = [5, v, 3, 11, T0, 1]
    body.append([r + [7] if extra_row_field else r for r in rows_])
    if extra_field:
        body.append("later")
    return msgspec.msgpack.encode(body)


@settings(max_examples=400, deadline=None)
@given(
    v=st.sampled_from([0, SCHEMA_VERSION, SCHEMA_VERSION + 1]),
    rows_=ROWS,
    extra_row_field=st.booleans(),
    extra_field=st.booleans(),
)
def test_checked_accepts_exactly_the_samples_every_row_check_passes(
    v: int, rows_: list[list[int]], extra_row_field: bool, extra_field: bool
) -> None:
    raw = _msg(v, rows_, extra_row_field, extra_field)
    try:
        event: Event | None = decode(raw)
    except (UnknownSchemaVersion, msgspec.ValidationError):
        event = None
    try:
        fast = checked(raw)
    except msgspec.ValidationError:
        fast = None
    if event is None:
        assert fast is None
        return
    assert isinstance(event, UsageSample)
    every_row_ok = all(row_ok(r) for r in event.rows)
    assert (fast is not None) == (every_row_ok and not (extra_row_field and rows_))
    if fast is not None:
        assert (fast.v, fast.inc, fast.seq, fast.ts, fast.cid) == (
            event.v,
            event.inc,
            event.seq,
            event.ts,
            event.cid,
        )
        assert rows(raw) == [tuple(msgspec.structs.astuple(r)) for r in event.rows]
        assert sample(raw) == event


Feed = Callable[[Aggregator, InputStats, list[tuple[int, bytes]]], None]


def _records(
    feed: Feed, msgs: list[tuple[int, bytes]]
) -> tuple[list[BillingRecord], Any, InputStats]:
    agg = Aggregator(S)
    stats = InputStats()
    out: list[BillingRecord] = []
    for i in range(0, len(msgs), 7):  # batches, with advance() between them like the service
        feed(agg, stats, msgs[i : i + 7])
        out += agg.advance()
    out += agg.flush()
    return out, msgspec.structs.asdict(agg.stats), stats


def _decoded(agg: Aggregator, stats: InputStats, batch: list[tuple[int, bytes]]) -> None:
    """The long way for every message: decode, then `Aggregator.add`."""
    for off, raw in batch:
        try:
            event = decode(raw)
        except UnknownSchemaVersion:
            stats.unknown_schema += 1
            continue
        except (msgspec.DecodeError, msgspec.ValidationError):
            stats.undecodable += 1
            continue
        stats.damage.see("n1", event)
        agg.add("n1", event, offset=off, record_ts_ms=T0 + off * 1000)


def _intake(agg: Aggregator, stats: InputStats, batch: list[tuple[int, bytes]]) -> None:
    for off, raw in batch:
        add_record(agg, stats, b"n1", raw, source=0, offset=off, record_ts_ms=T0 + off * 1000)


class _Record:
    __slots__ = ("key", "offset", "timestamp", "value")

    def __init__(self, off: int, raw: bytes) -> None:
        self.key = b"n1"
        self.offset = off
        self.timestamp = T0 + off * 1000
        self.value = raw


def _kafka(agg: Aggregator, stats: InputStats, batch: list[tuple[int, bytes]]) -> None:
    add_kafka_records(agg, stats, 0, [_Record(off, raw) for off, raw in batch])


STEP = st.tuples(
    st.integers(0, 3),  # 0..2: a sample, 3: a hostile or broken message
    st.integers(1, 3),  # the sample's rows, or which hostile message
    EDGY,
    st.integers(-1, MAX_PERCENT + 1),
    st.integers(-30, 5),  # seconds back or forth: late, out of order, duplicates
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(STEP, min_size=1, max_size=60), dup=st.integers(0, 4))
def test_the_intake_gives_the_records_of_the_decoded_stream(
    steps: list[tuple[int, int, int, int, int]], dup: int
) -> None:
    c = Collector()
    msgs = [encode(c.appeared(T0, devices=[dev(0, limit=8 << 30), dev(1, limit=8 << 30)]))]
    t = T0
    for kind, pid, total, sm, jump in steps:
        t = max(T0, t + 1000 + jump * 1000)
        if kind < 3:
            # pids 1..pid; the first on device 0, the others on a device that varies: the
            # same rows as before, rows that differ from the second one on, or fewer rows
            rows_ = [
                row(p, total, 0 if p == 1 else kind % 2, total // 2, sm) for p in range(1, pid + 1)
            ]
            msgs.append(encode(c.sample(t, *rows_)))
        elif pid == 1:
            msgs.append(b"\x97\x05\xff")  # a sample's first bytes, then garbage
        elif pid == 2:
            msgs.append(encode(c.sample(t, UsageRow(pid, 9, 0, 5, 0, 0, 0, 5, 5))))
            msgs.append(_msg(SCHEMA_VERSION + 1, [[1, 2, 0, 5, 0, 0, 0, 5, 5]], False, False))
        else:
            msgs.append(encode(c.hb(t, row(1, total, 0, 0, sm))))
    msgs += msgs[dup : dup + 3]  # redelivered
    stream = list(enumerate(msgs))
    want = _records(_decoded, stream)
    assert _records(_intake, stream) == want
    assert _records(_kafka, stream) == want


# A kilobyte nested a thousand levels deep, where msgspec gives up with RecursionError: as the
# value of a usage sample's `cid` (the short way's decoder meets it) and as a field appended to a
# ContainerGone (the long way's decoder skips unknown fields by walking them).
DEEP = [
    b"\x96\x02\x01\x00\x00\x00" + b"\x91" * 1000 + b"\x00",
    b"\x97\x02\x01\x00\x00\x00\x05" + b"\x91" * 1000 + b"\x00",
]


@pytest.mark.parametrize("bad", [[None, None], DEEP], ids=["tombstones", "nested-too-deeply"])
def test_a_message_that_is_no_event_is_counted_as_undecodable(bad: list[bytes | None]) -> None:
    """A null value (a tombstone some tool wrote to the usage topic), or a value nested too
    deeply to decode, is no event: counted with the undecodable ones, and the rest of the
    stream gives its records (never a crash, which would stop the service on the same offset
    at every restart)."""
    c = Collector()
    msgs = [encode(c.appeared(T0, devices=[dev(0, limit=8 << 30)]))]
    msgs += [encode(c.sample(T0 + s * 1000, row(1, 100 + s, 0, 7, 3))) for s in range(1, 9)]
    stream = list(enumerate(msgs))
    with_bad: list[tuple[int, Any]] = [*stream[:3], (100, bad[0]), *stream[3:], (101, bad[1])]
    want, want_stats, _ = _records(_decoded, stream)
    assert want
    for feed in (_intake, _kafka):
        got, got_stats, stats = _records(feed, with_bad)
        assert (got, got_stats) == (want, want_stats)
        assert (stats.undecodable, stats.unknown_schema) == (2, 0)


def _two_rows(c: Collector, t: int, total: int) -> bytes:
    return encode(c.sample(t, row(1, total, 0, 7, 3), row(2, 2 * total, 1, 9, 4)))


def _dropped(how: str) -> list[bytes]:
    """A container sampling the same two rows every second, one of its keys dropped in the
    middle in the way `how`, then the same two rows again."""
    c = Collector()
    devices = [dev(0, limit=8 << 30), dev(1, limit=8 << 30)]
    msgs = [encode(c.appeared(T0, devices=devices))]
    t = T0
    for s in range(5):
        t = T0 + s * 1000
        msgs.append(_two_rows(c, t, 100 + s))
    t += 1000
    if how == "heartbeat":  # restates pid 1 only: pid 2's key ends
        msgs.append(encode(c.heartbeat(t, state(1, row(1, 100, 0, 7, 3), devices=devices))))
    elif how == "exit":
        msgs.append(encode(c.exited(t, 2)))
    elif how == "expiry":  # silent for longer than max_gap
        t += S.max_gap_ms + 5000
    elif how == "gone":
        msgs.append(encode(c.gone(t)))
        msgs.append(encode(c.appeared(t + 500, devices=devices)))
    elif how == "limits":  # device 1 leaves the table: its rows are unattributed
        msgs.append(encode(c.limits(t, devices[:1])))
    elif how == "late":  # a late sample of pid 2 after its window closed
        for s in range(1, 80):
            msgs.append(encode(c.sample(t + s * 1000, row(1, 5, 0, 7, 3))))
        t += 80_000
        msgs.append(encode(c.sample(T0 + 61_000, row(2, 999, 1, 9, 4))))
    for s in range(1, 6):
        msgs.append(_two_rows(c, t + s * 1000, 300 + s))
    return msgs


@pytest.mark.parametrize("how", ["heartbeat", "exit", "expiry", "gone", "limits", "late"])
def test_a_dropped_key_is_never_updated_through_the_layout(how: str) -> None:
    """`Track.layout` holds live value lists: every way a key ends must forget it, or the
    same rows after it would update a list the track no longer holds."""
    stream = list(enumerate(_dropped(how)))
    want = _records(_decoded, stream)
    assert want[0]
    assert want == _records(_intake, stream) == _records(_kafka, stream)


def test_a_partition_read_again_from_another_replicas_offset_is_no_seq_gap() -> None:
    """A partition read by this replica up to offset 100, by another from 101 to 499, then
    assigned to this one again at the other's position: where it comes in again is not a gap
    (the service forgets the partition's seq state at each assignment), while a real gap in
    another partition stays counted."""
    c, other = Collector(inc=5), Collector(inc=6)
    vals = [encode(c.sample(T0 + i * 1000, row(1, 100, 0, 7, 3))) for i in range(600)]
    stats = InputStats()

    def read(source: int, values: list[bytes], offsets: range) -> None:
        agg = Aggregator(WindowSettings())
        for off in offsets:
            add_record(agg, stats, b"n1" if source == 0 else b"n2", values[off],
                       source=source, offset=off, record_ts_ms=T0)  # fmt: skip

    read(0, vals, range(0, 101))
    gapped = [encode(other.sample(T0 + i * 1000, row(1, 100, 0, 7, 3))) for i in range(10)]
    read(1, gapped, range(0, 3))
    read(1, gapped, range(5, 10))  # offsets 3 and 4 never arrive: seq 3, 4 missing
    stats.damage.forget_source(0)  # assigned again
    read(0, vals, range(380, 600))
    assert (stats.damage.seq_gaps, stats.damage.seq_missing) == (1, 2)
    read(0, vals, range(590, 600))  # re-read by the same reader: duplicates, not gaps
    assert (stats.damage.seq_gaps, stats.damage.seq_missing) == (1, 2)
