"""How much record time a source read to its end has gone without a record.

A partition whose nodes have all fallen silent would keep its windows open for ever: nothing
in it moves its record time. The service therefore tells its aggregator the record time that
has come anyway (`Aggregator.idle`): the newest record time read from that partition, moved on
by the monotonic time since that record was read. No other partition's record time decides it
(a node whose clock runs ahead in one partition turned every other partition's nodes idle,
their later events late), and no wall clock either (events of a clock behind the aggregator's
wall clock, a suspend, a stepped clock: each turned a node idle at every read that found
nothing new). The same close happens at the partition's next record anyway, so live and replay
agree.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

__all__ = ["Silence"]


class Silence:
    """Per source: the newest record time read, and the monotonic time it was read at."""

    def __init__(self, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._monotonic = monotonic
        self._newest: dict[Hashable, tuple[int, float]] = {}

    def read(self, source: Hashable, record_ts_ms: int) -> None:
        """Records up to `record_ts_ms` (their newest time) were just read from `source`."""
        was = self._newest.get(source)
        if was is None or record_ts_ms > was[0]:
            self._newest[source] = (record_ts_ms, self._monotonic())

    def now_ms(self, source: Hashable) -> int | None:
        """The record time `source` has reached by now if it were still sending; None before
        any of its records was read."""
        was = self._newest.get(source)
        if was is None:
            return None
        ts, at = was
        return ts + int((self._monotonic() - at) * 1000)

    def forget(self, source: Hashable) -> None:
        self._newest.pop(source, None)
