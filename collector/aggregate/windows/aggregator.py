"""The Aggregator facade: events in (`add`), billing records out (`advance`, `flush`), restart
offsets and gauges. Each concept lives in its own module of this package; this one wires them:

* input: `Progress` (per-source offsets, watermark, future events) -> `Incarnations`
  (de-duplication, supersession) -> a `Track` per container (events pending until their window
  closes; late ones counted by `late.count_late`);
* closing: `close.run` per track (in-order `apply`, `late.apply_late`, `Integrator`) ->
  `Output` -> records; then tracks and incarnations nobody needs are forgotten;
* `checkpoint.needed_offsets` and `gauges.gauges` read the tracks.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from ...events import (
    CollectorStarted,
    ContainerAppeared,
    ContainerGone,
    ContainerRun,
    DeviceInventory,
    Event,
    Heartbeat,
    LimitsChanged,
    NodeDeviceSample,
    PodIdentity,
    ProcessExited,
    ProcessStarted,
    UsageSample,
)
from ..records import BillingRecord, Gauge
from . import runs
from .apply import retire_devices
from .checkpoint import needed_offsets
from .close import run
from .gauges import gauges
from .identity import Identities
from .incarnations import Incarnations
from .integrate import Integrator
from .inventory import Inventory
from .late import count_late
from .nodeguard import NodeConflict, NodeGuard
from .output import Output
from .progress import Progress
from .settings import MAX_TS, NEVER, RETAIN_GAPS, WindowSettings
from .state import NODE_CID, SUPERSEDE, Track
from .stats import OUTPUT_COUNTS, AggregateStats

__all__ = ["Aggregator"]

log = logging.getLogger(__name__)


class Aggregator:
    """Integrates events into billing records; see the package docstring for the semantics."""

    def __init__(
        self,
        settings: WindowSettings,
        *,
        emitted_until_ms: int = 0,
        closed_before_ms: int | None = None,
    ) -> None:
        """closed_before_ms: the end of the windows an earlier aggregator of this process closed
        on this input (a partition assigned back after a rebalance): closing them again counts
        nothing (see `uncounted`), as the records read again count nothing."""
        self.settings = settings
        self.stats = AggregateStats()
        self._closed_before = closed_before_ms
        self._w = settings.window_ms
        self._lateness = settings.lateness_ms
        self._gap = settings.max_gap_ms
        self._suppress = emitted_until_ms
        self._closed: int | None = None
        self._flushed: int | None = None  # the time `flush` ran every value to
        self._tracks: dict[tuple[str, int, int], Track] = {}
        self._incs = Incarnations()
        self._guard = NodeGuard(self._incs, self.stats)
        self._progress = Progress(
            settings.max_skew_ms,
            settings.idle_after_ms,
            settings.max_gap_ms + settings.lateness_ms + settings.window_ms,
            settings.lateness_ms,
        )
        self._arrival = 0
        # How far behind the closed end state is kept (`prune`): an event older is past every
        # value's cap and every incarnation's de-duplication.
        self._horizon = settings.max_gap_ms + settings.lateness_ms + settings.window_ms
        self._newest = -NEVER  # the newest ts of an event in the progress (`progress.newest`)
        # A pod's identity outlives its last restatement as long as a container's name does.
        self._identities = Identities(
            self._w, self._lateness, RETAIN_GAPS * self._gap + self._lateness + self._w
        )
        self._inv = Inventory(settings.max_gap_ms)
        output = Output(
            self._w,
            emitted_until_ms,
            self.stats,
            self._identities,
            settings.allocation_policy,
            self._inv,
        )
        self._ig = Integrator(settings, self.stats, output)

    @property
    def emitted_until_ms(self) -> int:
        """End of the last closed window (at least the `emitted_until_ms` it started with)."""
        closed = self._closed
        return self._suppress if closed is None or closed < self._suppress else closed

    # --- input ---------------------------------------------------------------------------

    def add(
        self,
        node: str,
        event: Event,
        *,
        source: int = 0,
        offset: int = 0,
        record_ts_ms: int | None = None,
    ) -> None:
        eff = self._admit(node, event.inc, event.seq, event.ts, source, offset, record_ts_ms)
        if eff is None:
            return
        ts = event.ts
        inc = event.inc
        seq = event.seq
        stats = self.stats
        self._arrival += 1
        if isinstance(event, UsageSample):
            tr = self._tracks.get((node, inc, event.cid))
            if tr is None:
                tr = self._track(node, inc, event.cid, source)
            tr.pending.append((eff, ts, seq, self._arrival, event, offset))
        elif isinstance(event, Heartbeat):
            if event.interval_ms > self._gap:
                self._heartbeat_over_gap(node, event.interval_ms)
            # No collector states a cid twice in one heartbeat: the later state is taken and
            # the other refused (both would have one sort key, down to their payloads).
            states = {state.cid: state for state in event.containers}
            stats.refused_values += len(event.containers) - len(states)
            for state in states.values():
                tr = self._track(node, inc, state.cid, source)
                tr.pending.append((eff, ts, seq, self._arrival, state, offset))
            if event.pods:
                bound = self._closable()
                for identity in event.pods:
                    self._identities.learn(node, identity, ts, seq, source, offset, bound)
        elif isinstance(
            event,
            ContainerAppeared | ContainerGone | ProcessStarted | ProcessExited | LimitsChanged,
        ):
            tr = self._track(node, inc, event.cid, source)
            tr.pending.append((eff, ts, seq, self._arrival, event, offset))
        elif isinstance(event, NodeDeviceSample):
            tr = self._track(node, inc, NODE_CID, source)
            tr.pending.append((eff, ts, seq, self._arrival, event, offset))
        elif isinstance(event, ContainerRun):
            tr = self._track(node, inc, event.cid, source)
            tr.pending.append(runs.entry(event, self._closable(), self._lateness, self._arrival,
                                         offset, stats))  # fmt: skip
        elif isinstance(event, PodIdentity):
            self._identities.learn(node, event.identity, ts, seq, source, offset, self._closable())
        elif isinstance(event, DeviceInventory):
            stats.refused_values += self._inv.state(node, event, source, offset, eff)
        elif isinstance(event, CollectorStarted):
            self._guard.announce(node, event)
        # LayoutAnomaly: counted above, nothing to integrate.
        if eff != ts:
            count_late(stats)

    def add_sample(
        self,
        node: str,
        inc: int,
        seq: int,
        ts: int,
        cid: int,
        raw: bytes,
        *,
        source: int = 0,
        offset: int = 0,
        record_ts_ms: int | None = None,
    ) -> None:
        """`add` for a `UsageSample` given as its message bytes, which `packed.checked` accepted
        (the header fields are that check's): it waits for its window as those bytes."""
        eff = self._admit(node, inc, seq, ts, source, offset, record_ts_ms)
        if eff is None:
            return
        tr = self._tracks.get((node, inc, cid))
        if tr is None:
            tr = self._track(node, inc, cid, source)
        self._arrival += 1
        # a copy only when it is not immutable bytes already (a slice of a reused buffer)
        payload = raw if type(raw) is bytes else bytes(raw)
        tr.pending.append((eff, ts, seq, self._arrival, payload, offset))
        if eff != ts:
            count_late(self.stats)

    def _admit(
        self,
        node: str,
        inc: int,
        seq: int,
        ts: int,
        source: int,
        offset: int,
        record_ts_ms: int | None,
    ) -> int | None:
        """Count the event and its offset; None when it is refused, too far ahead, a duplicate
        or overlapped, else its effective ts (the closed end for a late event)."""
        stats = self.stats
        stats.events += 1
        progress = self._progress
        progress.offset(source, offset)
        if not 0 <= ts <= MAX_TS:
            stats.refused_values += 1
            return None
        if progress.too_far_ahead(node, ts, record_ts_ms):
            stats.future_events += 1
            return None
        incs = self._incs
        if not incs.admit(node, inc, seq, ts):
            stats.duplicates += 1
            return None
        if node in incs.several and self._guard.overlaps(node, inc, ts):
            return None
        eff = self._effective(node, ts, source, offset, record_ts_ms)
        lowered = incs.lowered
        if lowered is not None:
            lowered.starts.append((ts, eff))
        return eff

    def _effective(
        self, node: str, ts: int, source: int, offset: int, record_ts_ms: int | None
    ) -> int:
        """The event's effective ts: its own, or the end the input let close when it is late."""
        # An event older than what any close keeps state for (an incarnation whose last event
        # is before the closed end less max_gap + lateness + window is forgotten: a redelivery
        # of it is no duplicate once that has happened) stays out of the progress: it woke its
        # idle node with that old time and held the partition at its floor when the closes had
        # forgotten it, and was a duplicate when they had not (the records depended on how
        # often `advance()` ran). It is late, as it was. (The newest event bounds what can
        # close: only an event that far behind it asks.)
        if ts < self._newest - self._lateness - self._horizon:
            end = self._closable()
            if end is not None and ts < end - self._horizon:
                return end
        if ts > self._newest:
            self._newest = ts
        # Late means before the end of the windows the input read so far lets close, closed
        # yet or not: when `advance()` ran (each batch live, every few hundred records in a
        # replay) must not decide it, or a replay would bill a late event as the live run did
        # not. Asking every source is only needed for an event behind its node's newest.
        bound = self._progress.event(source, node, ts, record_ts_ms, offset)
        closed = self._closed
        if ts >= bound - self._lateness and (closed is None or ts >= closed):
            return ts
        end = self._closable()
        return ts if end is None or ts >= end else end

    @property
    def closed_until_ms(self) -> int | None:
        """End of the windows this aggregator closed (None before its first close)."""
        return self._closed

    @contextmanager
    def uncounted(self) -> Iterator[None]:
        """What is added or closed inside counts nothing: input this process counted before
        (records read again, windows closed again). The records handed out are still counted
        (`OUTPUT_COUNTS`: those of windows past the emitted end, never handed out twice)."""
        before = [(name, getattr(self.stats, name)) for name in self.stats.__struct_fields__]
        future = dict(self._progress.future_by_node)
        try:
            yield
        finally:
            for name, value in before:
                if name not in OUTPUT_COUNTS:
                    setattr(self.stats, name, value)
            self._progress.future_by_node = future

    def idle(self, now_ms: int) -> None:
        """Record time `now_ms` has come (`aggregate/silence.py`): sources silent for longer than
        `idle_ms` let their nodes' windows close at the next `advance()` (see `progress`)."""
        self._progress.idle(now_ms)

    @property
    def future_by_node(self) -> dict[str, int]:
        """Events refused as too far ahead of their record time, per node."""
        return dict(self._progress.future_by_node)

    def _heartbeat_over_gap(self, node: str, interval_ms: int) -> None:
        """A value that only heartbeats restate lapses between them: billed in part."""
        self.stats.heartbeat_over_gap += 1
        if self.stats.heartbeat_over_gap == 1:
            log.warning(
                "node %s sends a heartbeat every %d ms, more than max_gap (%d ms): values it "
                "does not change lapse between heartbeats and are billed in part; set max_gap "
                "to about 3 heartbeats",
                node,
                interval_ms,
                self._gap,
            )

    def _track(self, node: str, inc: int, cid: int, source: int) -> Track:
        tr = self._tracks.get((node, inc, cid))
        if tr is None:
            closed = self._closed
            tr = Track(node, inc, cid, source, -NEVER if closed is None else closed)
            self._tracks[(node, inc, cid)] = tr
        return tr

    def conflicts(self) -> list[NodeConflict]:
        """Node-name conflicts found since the last call (see `nodeguard`)."""
        return self._guard.take()

    # --- closing windows -----------------------------------------------------------------

    def advance(self) -> list[BillingRecord]:
        """Close every window whose end is at or below the watermark; records sorted by
        (window_start, node, pod_uid, container, device_uuid)."""
        target = self._closable()
        if target is None or target == self._closed:
            return []
        return self._close(target)

    def _closable(self) -> int | None:
        """The end of the windows the input read so far lets close (closed or not yet): a
        function of the input, never of when `advance()` runs (see `progress`)."""
        closed = self._closed
        top = self._progress.watermark_top()
        if top is None:
            return closed
        wm = top - self._lateness
        target = wm - wm % self._w
        return target if closed is None or target > closed else closed

    def flush(self) -> list[BillingRecord]:
        """Close everything (for --drain): every value runs to its next change or its cap."""
        newest = self._progress.newest()
        if newest is None:
            return []
        end = newest + self._gap
        # Every value runs to its cap: the gauges are judged as of then (the limits of a
        # container whose usage had ended were still reported after a drain).
        self._flushed = end
        target = -(-end // self._w) * self._w
        if self._closed is not None and target <= self._closed:
            return []
        return self._close(target)

    def _close(self, target: int) -> list[BillingRecord]:
        again = self._closed_before
        closed = self._closed
        if again is None or (closed is not None and closed >= again):
            return self._close_to(target)
        # Windows an earlier aggregator of this process closed and counted: closed again to
        # rebuild the state, uncounted. A close across that end is split there (records do
        # not depend on where closes stop: nothing is added in between).
        with self.uncounted():
            records = self._close_to(min(target, again))
        return records if target <= again else records + self._close_to(target)

    def _close_to(self, target: int) -> list[BillingRecord]:
        ig = self._ig
        for tr in self._tracks.values():
            self._maybe_supersede(tr, target)
            run(ig, tr, target)
        self._closed = target
        records = ig.output.records()  # before pruning: it reads the inventory
        self._prune(target)
        self._identities.prune(target)  # after the records took their names
        return records

    def _maybe_supersede(self, tr: Track, target: int) -> None:
        """Put the start of a newer incarnation of the node on this track's timeline, once."""
        if tr.node not in self._incs.several:
            return
        cut, newer_inc = self._incs.successor(tr.node, tr.inc)
        if cut >= target or (tr.cut is not None and tr.cut <= cut):
            return
        assert newer_inc is not None
        applied = NEVER if tr.cut is None else tr.cut
        tr.cut = cut
        # Events of this incarnation from after the newer one started arrived before it did:
        # two collectors under one node name (nodeguard). Only the newest is billed.
        kept = [e for e in tr.pending if e[1] < cut]
        if len(kept) < len(tr.pending):
            left_out = {e[2] for e in tr.pending if e[1] >= cut}
            self._guard.overlapped(tr.node, tr.inc, newer_inc, cut, left_out)
            tr.pending = kept
        # Each start of the newer incarnation that can close now takes effect where its event
        # did (the end the input let close when it came late), closed yet or not: taken from
        # the windows closed when this ran, it depended on how often `advance()` ran.
        closed = self._closed
        starts = self._incs.starts(tr.node, newer_inc) or [(cut, -NEVER)]
        for ts, eff in sorted(starts, reverse=True):
            if ts >= target or ts >= applied:
                continue  # not closable yet, or put in already (a lower one cuts first)
            eff = max(ts, eff)
            if closed is not None and eff < closed:
                eff = closed  # (the start of an incarnation forgotten and seen again)
            self._arrival += 1
            tr.pending.append((eff, ts, -1, self._arrival, SUPERSEDE, -1))

    def _prune(self, closed: int) -> None:
        gap = self._gap
        retain = self._ig.retain
        # What is older than this is forgotten: incarnations, a node's GPUs gone since.
        horizon = closed - self._horizon
        live_incs: set[tuple[str, int]] = set()
        drop: list[tuple[str, int, int]] = []
        for key, tr in self._tracks.items():
            if tr.ended:
                tr.ended = {k: t for k, t in tr.ended.items() if t > closed - gap}
                tr.ended_off = {k: o for k, o in tr.ended_off.items() if k in tr.ended}
            # Dropping a track must not change any record, whenever advance() is called: what is
            # dropped is what a new track would be (no name, nothing live or pending).
            if (
                tr.pending
                or tr.nkeys
                # a live value (max_gap), a name, or for a track not named yet what a late
                # announcement would name: its last event's time decides how long that name
                # lasts (`lapse`)
                or tr.last_ts + retain > closed
                # a running gate a late announcement would take (`ContainerRun` read before the
                # container's `ContainerAppeared`), kept as long as a name
                or (tr.run is not None and tr.run_ts + retain > closed)
                # an end is kept while a late event from before it could still bill
                or (tr.gone_ts is not None and tr.gone_ts > closed - gap)
            ):
                live_incs.add((tr.node, tr.inc))
            else:
                drop.append(key)
            if tr.uuids is not None and tr.expired:
                retire_devices(tr, horizon)
        for key in drop:
            del self._tracks[key]
        # An older incarnation is forgotten (with its de-duplication state) once it has no
        # containers and its last event is well behind the closed end; a node's last one is
        # retired on the same terms.
        self._guard.forget(self._incs.prune(live_incs, horizon))
        self._inv.prune(closed)
        self._progress.forget(closed)

    # --- checkpoints and gauges ----------------------------------------------------------

    def needed_offsets(self) -> dict[int, int]:
        """Per source: the earliest offset still needed to rebuild the open windows, or the
        offset after the last one added when nothing is (see `checkpoint`)."""
        need = needed_offsets(self._tracks.values(), self._progress, self._closed, self._gap)
        for kept in (self._identities.needed_offsets(), self._inv.needed_offsets()):
            for source, offset in kept.items():
                if source in need and offset < need[source]:
                    need[source] = offset
        self._progress.held_back(need)  # last: it must see every lowering
        return need

    def gauges(self) -> list[Gauge]:
        """Current values per container billing row (see `gauges`)."""
        return gauges(self._tracks.values(), self._progress, self._gap, self._flushed)
