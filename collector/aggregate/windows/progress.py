"""Event-time progress per source (Kafka partition or local log): the watermark, and the next
offset to read.

The watermark is the minimum over the sources seen of their largest event ts, minus
`lateness_ms`; `Aggregator.advance()` closes every window whose end is at or below it. Nothing
depends on when `advance()` is called, so a replay that batches its input differently from the
live run gives the same records.

Future events: with `record_ts_ms` (the transport's record time) given, an event whose ts is more
than `max_skew_ms` after it is dropped and counted in `stats.future_events`. It is a comparison
of two recorded times, never the wall clock, so a replay decides exactly as the live run did.
"""

from __future__ import annotations

from .settings import NEVER

__all__ = ["Progress"]


class Progress:
    """Per source: the offset after the last one added, and the largest event ts counted."""

    __slots__ = ("_skew", "_src")

    def __init__(self, max_skew_ms: int) -> None:
        self._skew = max_skew_ms
        # per source: [next offset, largest event ts (-NEVER until one counts)]
        self._src: dict[int, list[int]] = {}

    def offset(self, source: int, offset: int) -> None:
        """Every record read, whatever becomes of its event."""
        src = self._src.get(source)
        if src is None:
            self._src[source] = [offset + 1, -NEVER]
        elif offset >= src[0]:
            src[0] = offset + 1

    def too_far_ahead(self, ts: int, record_ts_ms: int | None) -> bool:
        return record_ts_ms is not None and ts > record_ts_ms + self._skew

    def event(self, source: int, ts: int) -> None:
        """An event that counts for the watermark (after `offset()` for its record)."""
        src = self._src[source]
        if ts > src[1]:
            src[1] = ts

    def watermark_top(self) -> int | None:
        """The smallest of the sources' largest event ts (None before any event counts)."""
        tops = [top for _, top in self._src.values() if top != -NEVER]
        return min(tops) if tops else None

    def newest(self) -> int | None:
        """The largest event ts of all sources (None before any event counts)."""
        tops = [top for _, top in self._src.values() if top != -NEVER]
        return max(tops) if tops else None

    def now(self, source: int) -> int:
        """The largest event ts of `source`."""
        return self._src[source][1]

    def next_offsets(self) -> dict[int, int]:
        """Per source, sorted: the offset after the last one added."""
        return {src: s[0] for src, s in sorted(self._src.items())}
