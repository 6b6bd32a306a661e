"""Running intervals from Kubernetes: a container's limits and allocation are billed only while
it runs.

A `ContainerRun` says that from `at` (the time Kubernetes recorded: `startedAt`, `finishedAt`,
the pod's deletion) the container runs or not. It goes on the track's timeline at `at`, clamped
to `[ts - lateness, ts]` (`ts`: the event's own time): no earlier than the aggregator can still
change, since with the node's events in order its windows close at least `lateness` behind its
newest event, so the place of the change on the timeline depends on the stream and the settings
alone (live and replay agree). An end moved later by the clamp bills the time in between: it is
counted in `stats.presence_clamped` (events) and `stats.presence_clamped_ms`. A late event (its
`ts` before the closed end) takes effect at the closed end, as every late event does.

While a track's gate (`Track.run`) is False, presence adds no time (`integrate`): no limits, no
allocation, no observed time; usage keeps being billed as measured. None (no `ContainerRun` yet,
or a collector without the pod watch) does not gate. Every heartbeat restates the gate
(`ContainerState.running`), so a consumer that starts mid-stream (a restart, a replay's
look-back) has it within one heartbeat. A restatement is taken only when it is newer in the
collector's own order (a larger seq) than the change that set the gate: a `ContainerRun` sent
after a heartbeat may lie before it in time (a `finishedAt` the watch reported late), and the
heartbeat, which did not know it yet, must not undo it.
"""

from __future__ import annotations

from ...events import ContainerRun
from .state import Entry, Track
from .stats import AggregateStats

__all__ = ["entry", "restate", "switch"]


def entry(
    event: ContainerRun,
    closed: int | None,
    lateness: int,
    arrival: int,
    offset: int,
    stats: AggregateStats,
) -> Entry:
    """The timeline entry of a `ContainerRun`, at its clamped time."""
    ts = event.ts
    t = min(max(event.at, ts - lateness), ts)
    if closed is not None and t < closed:
        t = closed
    if not event.running and t > event.at:
        stats.presence_clamped += 1
        stats.presence_clamped_ms += t - event.at
    return (t, t, event.seq, arrival, event, offset)


def switch(tr: Track, p: ContainerRun, seq: int, off: int) -> None:
    tr.run = p.running
    tr.run_seq = seq
    tr.run_off = off


def restate(tr: Track, running: bool | None, seq: int, off: int) -> None:
    """A heartbeat's `running`: taken when newer in the collector's order than the gate."""
    if running is not None and seq > tr.run_seq:
        tr.run = running
        tr.run_seq = seq
        tr.run_off = off
