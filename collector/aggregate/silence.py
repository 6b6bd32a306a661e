"""How much record time a source read to its end has gone without a record.

A partition whose nodes have all fallen silent would keep its windows open for ever: nothing
in it moves its record time. The service therefore tells its aggregator the record time that
has come anyway (`Aggregator.idle`): the newest record time read from that partition, moved on
by the monotonic time from when that record was read to when the partition was last *seen* at
its end (a read of the local log that found nothing new, a Kafka fetch answered with nothing
beyond what was read). Time in which it was not seen (a broker outage, the aggregator stopped
or stalled) does not count: the records sent meanwhile are waiting to be read, and were billed
late when an aggregator that could not read for `idle` took the wall clock for silence.

No other partition's record time decides it (a node whose clock runs ahead in one partition
turned every other partition's nodes idle, their later events late), and no wall clock either
(events of a clock behind the aggregator's, a suspend, a stepped clock: each turned a node idle
at every read that found nothing new). The same close happens at the partition's next record
anyway, so live and replay agree.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

__all__ = ["Silence"]


class Silence:
    """Per source: the newest record time read, when it was read, and when the source was last
    seen at its end (monotonic)."""

    def __init__(self, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._monotonic = monotonic
        self._newest: dict[Hashable, tuple[int, float]] = {}
        self._seen_at_end: dict[Hashable, float] = {}

    def read(self, source: Hashable, record_ts_ms: int) -> None:
        """Records up to `record_ts_ms` (their newest time) were just read from `source`."""
        was = self._newest.get(source)
        if was is None or record_ts_ms > was[0]:
            self._newest[source] = (record_ts_ms, self._monotonic())

    def at_end(self, source: Hashable) -> None:
        """`source` was just seen to hold nothing beyond what was read."""
        self._seen_at_end[source] = self._monotonic()

    def now_ms(self, source: Hashable) -> int | None:
        """The record time `source` has reached, had it gone on sending; None before any of
        its records was read."""
        was = self._newest.get(source)
        if was is None:
            return None
        ts, read_at = was
        seen = self._seen_at_end.get(source, read_at)
        return ts + max(0, int((seen - read_at) * 1000))

    def forget(self, source: Hashable) -> None:
        self._newest.pop(source, None)
        self._seen_at_end.pop(source, None)
