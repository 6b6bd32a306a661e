"""The collector's scan schedule (`collector/node/schedule.py`), driven with exact times."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from collector.node.schedule import ScanSchedule


def starts(
    interval: float, lengths: list[float], stalls: dict[int, float] | None = None
) -> list[float]:
    """When each scan starts, for scans of these lengths; `stalls[k]` holds scan k back that long
    after it was due (the process stopped while it waited)."""
    schedule = ScanSchedule(interval, 0.0)
    now, seen = 0.0, []
    for k, length in enumerate(lengths):
        now += (stalls or {}).get(k, 0.0)
        schedule.start(now)
        seen.append(round(now, 9))
        now += length
        now += schedule.wait(now)
    return seen


def test_scans_shorter_than_the_interval_keep_to_the_grid() -> None:
    assert starts(1.0, [0.3, 0.9, 0.01, 0.5, 0.3]) == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_a_slow_scan_is_followed_at_once_and_the_grid_holds() -> None:
    assert starts(1.0, [1.5, 0.1, 0.1, 0.1]) == [0.0, 1.5, 2.0, 3.0]


def test_scans_longer_than_the_interval_run_back_to_back() -> None:
    # Not one interval after each other (2.2 s apart): the node is scanned as often as it can be.
    assert starts(1.0, [1.2] * 8) == [0.0, 1.2, 2.4, 3.6, 4.8, 6.0, 7.2, 8.4]


def test_a_stopped_process_scans_once_on_resuming_and_the_grid_restarts_there() -> None:
    # Stopped right after the first scan until 6.01 s (the end-to-end test's case), then 4.5 s:
    # each resume is one scan, the next a whole interval after it.
    assert starts(2.0, [0.01] * 3, {1: 4.01}) == [0.0, 6.01, 8.01]
    assert starts(2.0, [0.01] * 3, {1: 2.51}) == [0.0, 4.51, 6.51]


def test_a_stop_shorter_than_an_interval_past_due_keeps_the_grid() -> None:
    assert starts(2.0, [0.01] * 3, {1: 0.51}) == [0.0, 2.51, 4.0]


@given(
    st.lists(st.floats(0.0, 3.0), min_size=1, max_size=40),
    st.dictionaries(st.integers(0, 39), st.floats(0.0, 10.0), max_size=5),
)
def test_never_two_scans_at_once_after_a_stop_and_never_idle_while_behind(
    lengths: list[float], stalls: dict[int, float]
) -> None:
    interval = 1.0
    schedule = ScanSchedule(interval, 0.0)
    now = 0.0
    for k, length in enumerate(lengths):
        now += stalls.get(k, 0.0)
        late = now - schedule.due
        schedule.start(now)
        now += length
        delay = schedule.wait(now)
        assert 0.0 <= delay <= interval + 1e-9
        if k in stalls and late > interval and length < interval:
            # Resumed from a stop: the next scan is a whole interval after this one began.
            assert abs((now + delay) - (now - length) - interval) < 1e-9
        if length >= interval and late <= 0:
            assert delay == 0.0  # behind because the scan overran: no waiting
        now += delay
