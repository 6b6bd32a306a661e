"""How much record time a source read to its end has gone without a record.

A partition whose nodes have all fallen silent would keep its windows open for ever: nothing
in it moves its record time. The service therefore tells its aggregator the record time that
has come anyway (`Aggregator.idle`): the newest record time read from that partition, moved on
by the monotonic time from when that record was read to when the partition was last *seen* at
its end (a read of the local log that found nothing new, a Kafka fetch answered with nothing
beyond what was read), counting only sightings close together. Time in which it was not seen
(a broker outage, the aggregator stopped or stalled) does not count: the records sent
meanwhile are waiting to be read, and were billed late when an aggregator that could not read
for `idle` took that time for silence.

No other partition's record time decides it (a node whose clock runs ahead in one partition
turned every other partition's nodes idle, their later events late), and no wall clock either
(events of a clock behind the aggregator's, a suspend, a stepped clock: each turned a node idle
at every read that found nothing new). The same close happens at the partition's next record
anyway, so live and replay agree.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import Final

__all__ = ["Silence"]


# Sightings further apart than this do not count the time between them: a fetch answered
# after the aggregator was stopped says where the partition stood when the broker answered, not
# that it stayed there all that while (the records sent meanwhile come with the next fetch).
SIGHTING_GAP_MAX_S: Final = 5.0


class Silence:
    """Per source: the newest record time read, and the silence counted since (monotonic time
    between sightings at its end, each at most `SIGHTING_GAP_MAX_S` after the one before)."""

    def __init__(self, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._monotonic = monotonic
        # newest record time read; silence counted since (ms); last read or sighting
        self._state: dict[Hashable, tuple[int, int, float]] = {}

    def read(self, source: Hashable, record_ts_ms: int) -> None:
        """Records up to `record_ts_ms` (their newest time) were just read from `source`."""
        was = self._state.get(source)
        if was is None or record_ts_ms > was[0]:
            self._state[source] = (record_ts_ms, 0, self._monotonic())

    def at_end(self, source: Hashable) -> None:
        """`source` was just seen to hold nothing beyond what was read."""
        was = self._state.get(source)
        if was is None:
            return
        ts, quiet_ms, last = was
        now = self._monotonic()
        if now - last <= SIGHTING_GAP_MAX_S:
            quiet_ms += int((now - last) * 1000)
        self._state[source] = (ts, quiet_ms, now)

    def now_ms(self, source: Hashable) -> int | None:
        """The record time `source` has reached, had it gone on sending; None before any of
        its records was read."""
        was = self._state.get(source)
        return None if was is None else was[0] + was[1]

    def forget(self, source: Hashable) -> None:
        self._state.pop(source, None)
