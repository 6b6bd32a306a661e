"""Running intervals from Kubernetes: a container's limits and allocation are billed only while
it runs.

A `ContainerRun` says that from `at` (the time Kubernetes recorded: `startedAt`, `finishedAt`,
the pod's deletion) the container runs or not. Its place on the track's timeline is `at`,
clamped to `[ts - lateness, ts]` (`ts`: the event's own time): no earlier than the aggregator
can still change, since with the node's events in order its windows close at least `lateness`
behind its newest event, so the place of the change on the timeline depends on the stream and
the settings alone (live and replay agree). An end moved later by the clamp bills the time in
between: it is counted in `stats.presence_clamped` (events) and `stats.presence_clamped_ms`.

A change whose place lies before the end of the windows the input read so far lets close (a
late event, or input reordered within the lateness) takes effect at that end, whether
`advance()` has closed those windows yet or not, so nothing depends on when it runs. There it
is taken only when it is newer in the collector's order (a larger seq) than what set the gate:
a later change or restatement that was applied first knew better, and a redelivered duplicate
(after a restart) changes nothing.

While a track's gate (`Track.run`) is False, presence adds no time (`integrate`): no limits, no
allocation, no observed time; usage keeps being billed as measured. None (no `ContainerRun` yet,
or a collector without the pod watch) does not gate. Every heartbeat restates the gate
(`ContainerState.running`), so a consumer that starts mid-stream (a restart, a replay's
look-back) has it within one heartbeat. A restatement is taken only when it is newer in the
collector's own order (a larger seq) than the change that set the gate: a `ContainerRun` sent
after a heartbeat may lie before it in time (a `finishedAt` the watch reported late), and the
heartbeat, which did not know it yet, must not undo it. A change in its place is always taken:
the collector sends a container's changes in the order of their `at`.
"""

from __future__ import annotations

from ...events import ContainerRun
from .state import Entry, Track
from .stats import AggregateStats

__all__ = ["clear", "entry", "late", "restate", "switch"]


def entry(
    event: ContainerRun,
    bound: int | None,
    lateness: int,
    arrival: int,
    offset: int,
    stats: AggregateStats,
) -> Entry:
    """The timeline entry of a `ContainerRun`: effective at its clamped place, or at `bound`
    (the end of the windows the input read so far lets close) when that is later; the entry's
    event time is the place, so a change moved to `bound` takes the late path (`late`)."""
    ts = event.ts
    place = min(max(event.at, ts - lateness), ts)
    t = place if bound is None or place >= bound else bound
    if not event.running and t > event.at:
        stats.presence_clamped += 1
        stats.presence_clamped_ms += t - event.at
    return (t, place, event.seq, arrival, event, offset)


def switch(tr: Track, p: ContainerRun, seq: int, off: int) -> None:
    """A change in its place: taken."""
    tr.run = p.running
    tr.run_seq = seq
    tr.run_off = off


def late(tr: Track, p: ContainerRun, seq: int, off: int) -> None:
    """A change moved later than its place: taken when newer in the collector's order."""
    if seq > tr.run_seq:
        switch(tr, p, seq, off)


def restate(tr: Track, running: bool | None, seq: int, off: int) -> None:
    """A heartbeat's `running`: taken when newer in the collector's order than the gate."""
    if running is not None and seq > tr.run_seq:
        tr.run = running
        tr.run_seq = seq
        tr.run_off = off


def clear(tr: Track) -> None:
    """No gate: what a new track has (a name forgotten, a gate read before a name lapsed)."""
    tr.run = None
    tr.run_seq = tr.run_off = -1
