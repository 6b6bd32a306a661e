"""The window settings and the time constants every part of the aggregator shares."""

from __future__ import annotations

from typing import Final

import msgspec

from .allocate import POLICIES, Policy

__all__ = ["MAX_TS", "NEVER", "RETAIN_GAPS", "WindowSettings"]

# Later (and minus it: earlier) than any event time.
NEVER: Final = 1 << 62
# Event times from this one on (9999-01-01T00:00:00Z) are refused: no clock gives them, and a
# window that holds one ends before the year 10 000 (windows are at most an hour, a value runs
# on at most 7 days), which every output's ISO-8601 time can still write. Everything derived from a
# time stays far inside NEVER and a record's bounds.
MAX_TS: Final = 253_370_764_800_000 - 1
# A container's name is kept this many max_gap after its last event (until ContainerGone at
# most), so a collector that stalls and resumes with changed rows only is still attributed
# without waiting for its next heartbeat.
RETAIN_GAPS: Final = 2
# Record timestamps are the collector's append or send time, a little after the event time.
RECORD_SLACK_MS: Final = 60_000


class WindowSettings(msgspec.Struct, frozen=True):
    window_ms: int = 60_000  # tumbling, aligned to the unix epoch
    lateness_ms: int = 10_000  # allowed lateness
    max_gap_ms: int = 90_000  # default 3 x heartbeat (heartbeat default 30 s)
    max_skew_ms: int = 300_000  # an event this far ahead of its record timestamp is dropped
    allocation_policy: Policy = "max"  # how a GPU's time is shared out (`allocate`)
    # A node silent this long (in record time) no longer holds its source's windows open.
    idle_ms: int = 600_000

    def __post_init__(self) -> None:
        if self.window_ms <= 0:
            raise ValueError(f"window_ms must be > 0, got {self.window_ms}")
        if self.lateness_ms < 0:
            raise ValueError(f"lateness_ms must be >= 0, got {self.lateness_ms}")
        if self.max_gap_ms <= 0:
            raise ValueError(f"max_gap_ms must be > 0, got {self.max_gap_ms}")
        if self.max_skew_ms < 0:
            raise ValueError(f"max_skew_ms must be >= 0, got {self.max_skew_ms}")
        if self.allocation_policy not in POLICIES:
            raise ValueError(f"allocation_policy must be one of {POLICIES}")
        if self.idle_ms <= 0:
            raise ValueError(f"idle_ms must be > 0, got {self.idle_ms}")

    @property
    def lookback_ms(self) -> int:
        """How far before a time T (in record time) the input must be read again to know the
        state at T: names are kept `RETAIN_GAPS x max_gap_ms` after their container's last
        event (values only `max_gap_ms`), and an event's record time can be up to
        `max_skew_ms` before its ts."""
        return RETAIN_GAPS * self.max_gap_ms + self.max_skew_ms

    @property
    def idle_after_ms(self) -> int:
        """`idle_ms`, but never less than a value's cap plus the lateness and a window: a node
        that turns idle closes windows up to that far past its newest event, so one back after
        a shorter silence would find them closed live (on the clock) and open in a replay (on
        its next record), and the two would differ."""
        return max(self.idle_ms, self.max_gap_ms + self.lateness_ms + self.window_ms)

    def history_from(self, at_ms: int) -> int:
        """The record time reading starts at to bill the windows from `at_ms` on as a reading
        of everything before would: the state in effect then (names, limits, values, which
        nodes are idle) comes from up to this far back."""
        return at_ms - max(self.lookback_ms, self.idle_after_ms) - RECORD_SLACK_MS

    def first_whole(self, at_ms: int) -> int:
        """The start of the first window at or after `at_ms`: a reading that starts at
        `at_ms` bills none before it (their input before `at_ms` was not read)."""
        return -(-at_ms // self.window_ms) * self.window_ms
