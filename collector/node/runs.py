"""Processor: when each tracked container runs, as Kubernetes recorded it (`ContainerRun`).

A container is running from its `state.running.startedAt` to its `state.terminated.finishedAt`;
each run is its own interval. The pod watch can miss a whole restart (the pod went from running
to running again between two reads): a `startedAt` that changed while the container was running
is a new run, and `lastState.terminated.finishedAt` tells when the previous one ended, so the gap
between them is not billed. When the pod is deleted, the Kubernetes-derived run ends at the time
the watch saw the DELETED event; from then on the container runs only while its file has a live
process (the `processes` presence rule: a force-deleted pod whose CUDA process still runs keeps
being billed, a deleted pod whose folder merely stays is not).

Each change goes out as one `ContainerRun(cid, running, at, reason)` with `at` the Kubernetes
timestamp (in event time: the wall clock's offset from event time taken off), never after the
scan's time and never before the container's previous change, and every heartbeat restates the
latest one (`ContainerState.running`). The aggregator puts it on the timeline at `at`, bounded
by what it can still change (see `collector/aggregate/windows/runs.py`). A container whose pod
the watch does not know gets no `ContainerRun`: it is billed by the `presence` policy alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime

from ..events import ContainerRun, Event
from .diff import FileState, Stamp
from .pods import PodView

__all__ = ["Gate", "Runs", "iso_ms"]


def iso_ms(iso: str) -> int | None:
    """Unix ms of a Kubernetes timestamp (RFC 3339), None when empty or unparsable."""
    if not iso:
        return None
    try:
        return round(datetime.fromisoformat(iso).timestamp() * 1000)
    except ValueError:
        return None


@dataclass
class Gate:
    """What the collector last said about one container (cid)."""

    running: bool | None = None
    at: int = 0  # the time of the last change sent
    started: str = ""  # the startedAt of the run it said is running
    deleted: bool = False  # its pod was deleted: runs only while a process lives


class Runs:
    def __init__(self, monotonic: Callable[[], float]) -> None:
        self._monotonic = monotonic
        self.gates: dict[int, Gate] = {}

    def stop(
        self,
        cid: int,
        at: int | None,
        now_ms: int,
        offset_ms: int,
        stamp: Stamp,
        started: str = "",
        last_finished: str = "",
    ) -> list[Event]:
        """The container's run ended at `at` (wall ms; None: now) and its file is no longer
        tracked. `started`: the startedAt of the run that ended; one other than the run the
        collector said is running is a restart the watch missed (`lastState` tells when the
        run it knew ended)."""
        gate = self.gates.pop(cid, Gate())
        if gate.running is False:
            return []
        events: list[Event] = []
        if gate.running is True and gate.started and started and started != gate.started:
            self._running(cid, gate, started, last_finished, now_ms, offset_ms, stamp, events)
        events.append(self._send(gate, cid, False, at, now_ms, offset_ms, "finished", stamp))
        return events

    def process(
        self,
        files: Iterable[FileState],
        view: Mapping[str, PodView],
        now_ms: int,
        offset_ms: int,
        stamp: Stamp,
    ) -> list[Event]:
        events: list[Event] = []
        tracked: set[int] = set()
        for st in files:
            cid = st.cid
            tracked.add(cid)  # kept while the file is tracked (presence = processes: unannounced)
            if not st.appeared:
                continue
            gate = self.gates.get(cid)
            if gate is None:
                gate = self.gates[cid] = Gate()
            pv = view.get(st.pod_uid)
            if pv is not None and not gate.deleted:
                # (The DELETED event's object too: the pod's last status, a restart in it.)
                run = pv.run(st.container)
                if run is not None and run.state == "running":
                    self._running(cid, gate, run.started, run.last_finished, now_ms, offset_ms,
                                  stamp, events)  # fmt: skip
            if gate.deleted or (pv is not None and pv.deleted):
                self._deleted(st, gate, pv, now_ms, stamp, events)
            st.running = gate.running
        for cid in self.gates.keys() - tracked:
            del self.gates[cid]
        return events

    def _running(
        self,
        cid: int,
        gate: Gate,
        started: str,
        last_finished: str,
        now_ms: int,
        offset_ms: int,
        stamp: Stamp,
        events: list[Event],
    ) -> None:
        if gate.running is True and gate.started == started:
            return
        if gate.running is True and gate.started and last_finished:
            # Restarted between two reads of the watch: the previous run ended then.
            events.append(self._send(gate, cid, False, iso_ms(last_finished), now_ms, offset_ms,
                                     "restart_missed", stamp))  # fmt: skip
        events.append(self._send(gate, cid, True, iso_ms(started), now_ms, offset_ms, "started",
                                 stamp))  # fmt: skip
        gate.started = started

    def _deleted(
        self,
        st: FileState,
        gate: Gate,
        pv: PodView | None,
        now_ms: int,
        stamp: Stamp,
        events: list[Event],
    ) -> None:
        live = bool(st.procs)
        at, reason = now_ms, "processes"
        if not gate.deleted:
            gate.deleted = True
            reason = "deleted"
            if pv is not None and pv.deleted:
                # The DELETED event's time, from the watch's monotonic stamp (in event time).
                at = now_ms - max(0, round((self._monotonic() - pv.deleted_at) * 1000))
        if gate.running is not live:  # None too: from now on, this is what gates it
            events.append(self._send(gate, st.cid, live, at, now_ms, 0, reason, stamp))

    def _send(
        self,
        gate: Gate,
        cid: int,
        running: bool,
        at: int | None,
        now_ms: int,
        offset_ms: int,
        reason: str,
        stamp: Stamp,
    ) -> Event:
        """`at` in wall ms (None: now) -> event time, within [the previous change, now]."""
        t = now_ms if at is None else at - offset_ms
        t = min(max(t, gate.at), now_ms)
        gate.running = running
        gate.at = t
        event: Event = stamp(ContainerRun, cid=cid, running=running, at=t, reason=reason)
        return event
