"""What one `aggregate` process counted, across rebalances: each record it read and each window
it closed, once.

A rebalance takes a partition's `Aggregator` away; one assigned back later starts a new one from
the group's checkpoint (the earliest offset an open window still needs), so it reads again
records this process had read, and closes again windows it had closed, to rebuild its windows.
`Tally` keeps, per partition and across assignments, the offset after the last record this
process read and the end of the windows it closed: what is read or closed again below them
counts nothing (`Aggregator.uncounted`, `InputStats.uncounted`), and what a revoked aggregator
counted stays in the totals. Another process (a restart, another replica) that reads the same
records counts them in its own summary line.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from typing import Any

from .intake import InputStats, add_kafka_records
from .windows import AggregateStats, Aggregator, WindowSettings
from .windows.stats import OUTPUT_COUNTS

__all__ = ["Tally", "future_by_node"]


class Tally:
    def __init__(self, window: WindowSettings, stats: InputStats) -> None:
        self.window = window
        self.input = stats
        self.gone = AggregateStats()  # the counts of aggregators whose partition was revoked
        self.gone_future: dict[str, int] = {}
        self.read_to: dict[int, int] = {}  # per partition: the offset after the last one read
        self.closed_to: dict[int, int] = {}  # per partition: the end of the windows closed
        # per partition: what its aggregator had handed out (`OUTPUT_COUNTS`) at its last commit
        self.handed: dict[int, dict[str, int]] = {}

    def aggregator(self, partition: int, emitted_until_ms: int) -> Aggregator:
        """A partition's aggregator at its assignment."""
        self.handed.pop(partition, None)
        return Aggregator(
            self.window,
            emitted_until_ms=emitted_until_ms,
            closed_before_ms=self.closed_to.get(partition),
        )

    def add(self, agg: Aggregator, partition: int, msgs: Sequence[Any]) -> None:
        """A partition's fetched records, in order: those this process read before are handed
        to `agg` uncounted."""
        if not msgs:
            return
        again = self.read_to.get(partition, 0)
        cut = bisect_left(msgs, again, key=lambda m: m.offset) if msgs[0].offset < again else 0
        if cut:
            with agg.uncounted(), self.input.uncounted():
                add_kafka_records(agg, self.input, partition, msgs[:cut])
        if cut < len(msgs):
            add_kafka_records(agg, self.input, partition, msgs[cut:] if cut else msgs)
            self.read_to[partition] = msgs[-1].offset + 1

    def revoke(self, agg: Aggregator, partition: int) -> None:
        """Keep what `agg` counted, and how far it closed."""
        for name in AggregateStats.__struct_fields__:
            setattr(self.gone, name, getattr(self.gone, name) + getattr(agg.stats, name))
        for node, n in agg.future_by_node.items():
            self.gone_future[node] = self.gone_future.get(node, 0) + n
        closed = agg.closed_until_ms
        if closed is not None:
            self.closed_to[partition] = max(closed, self.closed_to.get(partition, closed))

    def committed(self, live: Iterable[tuple[int, Aggregator]]) -> None:
        """The records the (partition, aggregator) pairs handed out are committed."""
        for partition, agg in live:
            self.handed[partition] = {n: getattr(agg.stats, n) for n in OUTPUT_COUNTS}

    def abort(self, agg: Aggregator, partition: int) -> None:
        """`revoke` after a transaction that was aborted: the records `agg` handed out since its
        last commit are handed out again by the partition's next aggregator, and count there."""
        for name in OUTPUT_COUNTS:
            setattr(agg.stats, name, self.handed.get(partition, {}).get(name, 0))
        self.revoke(agg, partition)

    def stats(self, live: Iterable[Aggregator]) -> list[AggregateStats]:
        return [self.gone, *(agg.stats for agg in live)]

    def future_by_node(self, live: Iterable[Aggregator]) -> dict[str, int]:
        return future_by_node(live, self.gone_future)


def future_by_node(
    aggs: Iterable[Aggregator], before: dict[str, int] | None = None
) -> dict[str, int]:
    """The events refused as from the future per node, of `aggs` (and `before`) together."""
    total = dict(before or {})
    for agg in aggs:
        for node, n in agg.future_by_node.items():
            total[node] = total.get(node, 0) + n
    return total
