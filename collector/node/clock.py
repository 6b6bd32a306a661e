"""Event time of one collector incarnation: the wall clock read once at start, then monotonic.

The aggregator orders a node's events by (ts, seq) and integrates values over event time, so
event time must never go backwards and its durations must be real ones. The wall clock gives
neither (NTP steps it, an operator sets it), the monotonic clock gives both. A step of the wall
clock is detected (wall - event time moves by more than `STEP_TOLERANCE_MS`), reported, and
absorbed: event time keeps running on the monotonic clock. A restart anchors the new
incarnation on the wall clock of that moment, or just after the previous incarnation's last event
if that is later.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

# NTP slews the realtime and the monotonic clock alike; only a step moves one against the other.
STEP_TOLERANCE_MS = 1000


class Clock(Protocol):
    def wall_ns(self) -> int: ...
    def mono_ns(self) -> int: ...


class SystemClock:
    def wall_ns(self) -> int:
        return time.time_ns()

    def mono_ns(self) -> int:
        return time.monotonic_ns()


@dataclass(frozen=True)
class Step:
    """The wall clock moved by `ms` (negative: back) against event time; `offset_ms` is how
    far the wall clock now is from event time."""

    ms: int
    offset_ms: int


class EventClock:
    def __init__(self, clock: Clock | None = None, *, after_ms: int | None = None) -> None:
        """`after_ms`: the last event time of the previous incarnation, where known; the new
        one starts after it even if the wall clock is behind (a step back absorbed before the
        restart), so two incarnations never cover the same stretch of time."""
        self.clock: Clock = clock or SystemClock()
        wall_ms = self.clock.wall_ns() // 1_000_000
        self._mono0_ns = self.clock.mono_ns()
        self._wall0_ms = wall_ms if after_ms is None else max(wall_ms, after_ms + 1)
        self.offset_ms = wall_ms - self._wall0_ms  # wall - event time as of the last step
        self.steps = 0

    def now(self) -> tuple[int, Step | None]:
        """Event time in unix ms, and the step of the wall clock seen since the last call."""
        mono = self.clock.mono_ns()
        wall_ms = self.clock.wall_ns() // 1_000_000
        ts = self._wall0_ms + (mono - self._mono0_ns) // 1_000_000
        offset = wall_ms - ts
        if abs(offset - self.offset_ms) <= STEP_TOLERANCE_MS:
            return ts, None
        step = Step(offset - self.offset_ms, offset)
        self.offset_ms = offset
        self.steps += 1
        return ts, step
