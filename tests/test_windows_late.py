"""Late accounting as `collector/aggregate/windows/late.py` defines it, and the heartbeat vs
max_gap check."""

from __future__ import annotations

import logging

import pytest
from test_windows import Collector, one, row, run

from collector.aggregate.windows import WindowSettings


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
