"""Processor: who each tracked container belongs to, as events in the stream.

Runs in the scan (worker thread) after the diff. It reads the pod watch's view (replaced whole
by the watch, never mutated, so no lock) and emits

* `PodIdentity` when the identity of a pod with a tracked container becomes known or changes;
  the last one sent is kept while a container file of the pod is tracked (present or not:
  `presence = processes` has it absent between processes), also after the pod is deleted or
  forgotten by the watch, and restated in every heartbeat, and when a container of the pod is
  usable again after an unusable spell or present again after an absence (announced again:
  heartbeats left it out, so the aggregator may have forgotten the identity too);
* `LayoutAnomaly(allocation_mismatch)` when HAMi's allocation annotation and the limits in the
  container's cache file disagree (or the annotation does not parse), once while it persists.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..events import ContainerState, Event, Identity, LayoutAnomaly, PodIdentity
from . import allocation
from .diff import FileState, Stamp
from .pods import PodView

ALLOCATION_MISMATCH = "allocation_mismatch"
DETAIL_MAX = 2000  # characters of an allocation_mismatch detail shown (events bound it too)


class IdentityStage:
    def __init__(self, view: Callable[[], Mapping[str, PodView]]) -> None:
        self._view = view
        self.sent: dict[str, Identity] = {}  # pod uid -> the identity last sent
        self._alloc: dict[int, tuple[Any, Any, str | None]] = {}  # cid -> (view, devices, detail)
        self.unnamed = 0  # tracked containers whose pod is not known (gauge)
        self._unobserved: set[int] = set()  # cids unusable at the last scan
        # cids tracked but not present at the last scan (presence = processes: no process)
        self._absent: set[int] = set()

    def process(self, files: Iterable[FileState], stamp: Stamp) -> list[Event]:
        view = self._view()
        events: list[Event] = []
        pods: set[str] = set()
        cids: set[int] = set()
        unobserved: set[int] = set()
        absent: set[int] = set()
        again: set[str] = set()  # pods restated this scan
        unnamed = 0
        for st in files:
            uid = st.pod_uid
            pods.add(uid)  # kept while tracked: a container without processes comes back
            if not st.appeared:
                absent.add(st.cid)
                continue
            if st.unobserved:
                unobserved.add(st.cid)
            # usable again after an unusable spell, or present again after an absence (no
            # heartbeat stated it meanwhile): its pod's identity is restated with it
            back = st.cid in self._unobserved and not st.unobserved
            back = (back or st.cid in self._absent) and uid not in again
            pv = view.get(uid)
            sent = self.sent.get(uid)
            identity = sent if pv is None else pv.identity  # kept after the pod is deleted
            if identity is None:
                unnamed += 1
                continue
            if identity != sent or back:
                again.add(uid)
                self.sent[uid] = identity
                events.append(stamp(PodIdentity, identity=identity))
            if pv is None:
                continue
            if not st.unobserved:
                cids.add(st.cid)
                self._check(st, pv, stamp, events)
        for uid in self.sent.keys() - pods:
            del self.sent[uid]
        for cid in self._alloc.keys() - cids:
            del self._alloc[cid]
        self.unnamed = unnamed
        self._unobserved = unobserved
        self._absent = absent
        return events

    def _check(self, st: FileState, pv: PodView, stamp: Stamp, events: list[Event]) -> None:
        seen = self._alloc.get(st.cid)
        if seen is not None and seen[0] is pv and seen[1] is st.devices:
            return  # neither side changed since the last check
        detail: str | None = None
        if pv.allocation_error is not None:
            detail = f"{allocation.ANNOTATION} does not parse: {pv.allocation_error}"
        elif pv.allocation is not None and st.container in pv.containers:
            index = pv.containers.index(st.container)
            allocated = pv.allocation[index] if index < len(pv.allocation) else []
            found = allocation.mismatch(allocated, st.devices)
            if found is not None:
                detail = f"container {st.container} (index {index}): {found}"
        if detail is not None and len(detail) > DETAIL_MAX:
            # (a problem per allocated UUID of an annotation of up to 64 KiB: beyond what an
            # event's detail may hold, the whole anomaly was undecodable)
            cut = len(detail) - DETAIL_MAX
            detail = f"{detail[:DETAIL_MAX]}... ({cut} more characters)"
        previous = seen[2] if seen is not None else None
        self._alloc[st.cid] = (pv, st.devices, detail)
        if detail is not None and detail != previous:
            events.append(
                stamp(
                    LayoutAnomaly,
                    cid=st.cid,
                    path=st.path,
                    anomaly=ALLOCATION_MISMATCH,
                    detail=detail,
                )
            )

    def restate(self, states: Iterable[ContainerState]) -> list[Identity]:
        """The known identities of the pods of these containers, for a heartbeat part."""
        uids = sorted({s.pod_uid for s in states})
        return [self.sent[u] for u in uids if u in self.sent]
