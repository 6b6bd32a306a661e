"""Late accounting as `collector/aggregate/windows/late.py` defines it, and the heartbeat vs
max_gap check."""

from __future__ import annotations

import logging

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_windows import Collector, one, row, run

from collector.aggregate.records import BillingRecord, record_order
from collector.aggregate.windows import Aggregator, WindowSettings
from collector.events import Event


def test_late_rows_of_one_key_never_count_the_same_time_twice() -> None:
    """The key had 9 s in the closed window (51 s .. 60 s); three late samples of it at 52, 53
    and 54 s hold 1 + 1 + 6 s there. (Counted as min(closed - ts, max_gap) each: 8 + 7 + 6.)"""
    c = Collector()
    events = [
        c.appeared(0),
        c.sample(0, row(2, 10)),
        c.sample(51_000, row(1, 100)),
        c.sample(75_000, row(2, 10)),  # watermark 65 s: [0, 60) closes
        c.sample(52_000, row(1, 200)),
        c.sample(53_000, row(1, 300)),
        c.sample(54_000, row(1, 400)),
        c.sample(140_000, row(2, 10)),
    ]
    records, agg = run(events)
    assert agg.stats.late_events == 3
    assert agg.stats.late_ms_dropped == 8_000
    assert agg.stats.late_ms_overbilled == 0
    assert one(records, 0).memory_byte_seconds == 10 * 60 + 100 * 9  # not revised
    assert one(records, 60_000).memory_byte_seconds == 10 * 60 + 400 * 60  # from 60 s on


def test_a_late_exit_counts_what_the_closed_window_billed_after_it() -> None:
    c = Collector()
    events = [
        c.appeared(0),
        c.sample(0, row(2, 10)),
        c.sample(10_000, row(1, 100)),
        c.sample(75_000, row(2, 10)),  # [0, 60) closes, billing pid 1 from 10 s to 60 s
        c.exited(30_000, 1),  # late: pid 1 had exited at 30 s
        c.sample(140_000, row(2, 10)),
    ]
    records, agg = run(events)
    assert agg.stats.late_events == 1
    assert agg.stats.late_ms_overbilled == 30_000
    assert agg.stats.late_ms_dropped == 0
    assert one(records, 0).memory_byte_seconds == 10 * 60 + 100 * 50  # not revised
    assert one(records, 60_000).memory_byte_seconds == 10 * 60  # ended from 60 s on


def test_a_late_heartbeat_that_drops_a_key_counts_its_overbilling_capped() -> None:
    c = Collector()
    events = [
        c.appeared(0),
        c.sample(0, row(2, 10)),
        c.sample(100_000, row(1, 100)),
        c.sample(195_000, row(2, 10)),  # watermark 185 s: windows up to 180 s close
        c.hb(150_000, row(2, 10)),  # late: pid 1 not stated any more at 150 s
        c.sample(260_000, row(2, 10)),
    ]
    _, agg = run(events)
    assert agg.stats.late_ms_overbilled == 30_000  # 150 s .. 180 s (its cap is 190 s)


@pytest.mark.parametrize("known", [False, True], ids=["new-key", "expired-key"])
def test_a_late_sample_before_a_late_heartbeat_that_ended_its_key_is_not_taken(
    known: bool,
) -> None:
    """pid 2 is sampled at 95 s and no longer stated by the heartbeat at 100 s: it ended
    there. The heartbeat arrives late (after [60, 120) closed), the 95 s sample later still
    (after [120, 180) closed); the sample must not bill pid 2 from the closed end on. With
    `known`, pid 2 was sampled at 5 s and had expired (5 s + 90 s) before the heartbeat."""
    c = Collector()
    early = [c.sample(t, row(1, 100)) for t in range(0, 95_000, 10_000)]
    if known:
        early.append(c.sample(5_000, row(2, 500)))
    late_sample = c.sample(95_000, row(1, 100), row(2, 500))
    late_hb = c.hb(100_000, row(1, 100))
    rest = [c.sample(t, row(1, 100)) for t in range(100_000, 400_000, 10_000)]
    events = [c.appeared(0), *early, *rest[:4], late_hb, *rest[4:10], late_sample, *rest[10:]]
    records, agg = run(events)
    assert agg.stats.late_events == (3 if known else 2)
    # [180, 240): pid 1 alone, 100 B for 60 s (the sample's pid 2 would add 500 B x 5 s)
    assert one(records, 180_000).memory_byte_seconds == 100 * 60
    assert one(records, 240_000).memory_byte_seconds == 100 * 60


def test_max_gap_below_the_heartbeat_interval_warns_once_and_counts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    c = Collector()
    events = [c.appeared(0), *[c.hb(s * 30_000, row(1, 100)) for s in range(5)]]
    with caplog.at_level(logging.WARNING, logger="collector.aggregate.windows.aggregator"):
        records, agg = run(events, WindowSettings(max_gap_ms=20_000))
    assert agg.stats.heartbeat_over_gap == 5
    warnings = [r for r in caplog.records if "more than max_gap" in r.getMessage()]
    assert len(warnings) == 1
    # the cost it warns of: 20 s of every 30 s billed
    assert sum(r.memory_byte_seconds for r in records) == 100 * 20 * 5


def test_max_gap_above_the_heartbeat_interval_is_quiet(caplog: pytest.LogCaptureFixture) -> None:
    c = Collector()
    with caplog.at_level(logging.WARNING):
        _, agg = run([c.appeared(0), c.hb(0, row(1, 1)), c.hb(30_000, row(1, 1))])
    assert agg.stats.heartbeat_over_gap == 0
    assert not caplog.records


LATE = WindowSettings(window_ms=10_000, lateness_ms=3_000, max_gap_ms=9_000, max_skew_ms=0)


@st.composite
def late_deliveries(draw: st.DrawFn) -> tuple[list[tuple[str, Event]], list[bool]]:
    """Two nodes in one source, each sampling, exiting and sending heartbeats; some events held
    back well past the lateness (a spool drained after an outage); and, per event, whether
    `advance()` runs after it."""
    msgs: list[tuple[str, Event]] = []
    for node in ("n1", "n2"):
        c = Collector(inc=3 if node == "n1" else 4)
        msgs.append((node, c.appeared(0)))
        t = 0
        for _ in range(draw(st.integers(3, 25))):
            t += draw(st.integers(200, 4_000))
            pid = draw(st.integers(1, 3))
            kind = draw(st.integers(0, 5))
            if kind <= 3:
                event: Event = c.sample(t, row(pid, draw(st.integers(1, 9)) * 100))
            elif kind == 4:
                event = c.exited(t, pid)
            else:
                event = c.hb(t, row(pid, 100))
            msgs.append((node, event))
        msgs.append((node, c.sample(t + 60_000, row(1, 1))))  # past every window of the run
    msgs.sort(key=lambda m: m[1].ts)
    for _ in range(draw(st.integers(1, 4))):  # held back, delivered later
        src = draw(st.integers(1, len(msgs) - 2))
        msgs.insert(draw(st.integers(src + 1, len(msgs) - 1)), msgs.pop(src))
    return msgs, draw(st.lists(st.booleans(), min_size=len(msgs), max_size=len(msgs)))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(delivered=late_deliveries())
def test_whether_an_event_is_late_does_not_depend_on_when_windows_were_closed(
    delivered: tuple[list[tuple[str, Event]], list[bool]],
) -> None:
    """The input and its order decide what is late, not when `advance()` ran (once a batch
    live, every few hundred records in a replay): the same records and late counts either way."""
    msgs, after = delivered

    def feed(advance_after: list[bool]) -> tuple[list[BillingRecord], int]:
        agg = Aggregator(LATE)
        out: list[BillingRecord] = []
        for offset, ((node, event), now) in enumerate(zip(msgs, advance_after, strict=True)):
            agg.add(node, event, offset=offset)
            if now:
                out += agg.advance()
        out += agg.advance() + agg.flush()
        # (late_ms_dropped is worked out at the close that applies a late event, from the
        # events that close sees: a diagnostic that can differ with the cadence, see README)
        return sorted(out, key=record_order), agg.stats.late_events

    every = feed([True] * len(msgs))
    assert feed(after) == every
    assert feed([False] * len(msgs)) == every
