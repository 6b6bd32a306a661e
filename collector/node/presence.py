"""Processor: a cache folder that outlives its container is not billed.

HAMi-core never deletes a container's folder, so a completed Job's pod kept for days would have
its reservation (limits) billed the whole time. With the pod watch on, a container whose status
is `terminated` (or whose pod is `Succeeded`/`Failed`) is *stale*: the scan stops tracking its
file, which ends it in the stream (`ContainerGone`, so the aggregator stops billing its limits and
usage at that scan), and reports it once per termination as `stale_container`, with its age since
`finishedAt` as `value` (seconds). When the container runs again (a restart), its file is tracked
again as a new container. A pod deleted while its container is still running is not stale: it
keeps being billed under the identity it had (see `identity`).

Without the pod watch nothing is stale: every folder is billed while it exists.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime

from ..events import Event, LayoutAnomaly
from .diff import Stamp
from .pods import PodView

STALE_CONTAINER = "stale_container"
_DONE = ("Succeeded", "Failed")


def _ms(iso: str) -> int | None:
    try:
        return round(datetime.fromisoformat(iso).timestamp() * 1000)
    except ValueError:
        return None


class PresenceStage:
    def __init__(self, view: Callable[[], Mapping[str, PodView]]) -> None:
        self._view = view
        self._now: Mapping[str, PodView] = {}
        self._reported: set[tuple[str, str, str]] = set()  # (pod uid, container, finishedAt)
        self._seen: set[tuple[str, str, str]] = set()
        self.stale = 0  # folders not billed now (gauge)

    def begin(self) -> None:
        """Once per scan, before `is_stale` is asked about its files."""
        self._now = self._view()
        self._seen = set()

    def end(self) -> None:
        # A termination whose folder went (or whose container runs again) is forgotten.
        self._reported &= self._seen
        self.stale = len(self._seen)

    def is_stale(
        self,
        pod_uid: str,
        container: str,
        path: str,
        cid: int,
        now_ms: int,
        stamp: Stamp,
        events: list[Event],
    ) -> bool:
        pv = self._now.get(pod_uid)
        if pv is None:
            return False
        finished = dict(pv.ended).get(container)
        if finished is None and pv.phase in _DONE:
            finished = ""  # the pod is done; this container has no terminated status of its own
        if finished is None:
            return False
        key = (pod_uid, container, finished)
        self._seen.add(key)
        if key not in self._reported:
            self._reported.add(key)
            at = _ms(finished) if finished else None
            age = None if at is None else max(0, (now_ms - at) // 1000)
            when = f"terminated at {finished}, {age} s ago" if age is not None else pv.phase
            identity = pv.identity
            events.append(
                stamp(
                    LayoutAnomaly,
                    cid=cid,
                    path=path,
                    anomaly=STALE_CONTAINER,
                    detail=f"container {container} of pod {identity.namespace}/{identity.pod} "
                    f"{when}; its folder is still there: not billed",
                    value=age,
                )
            )
        return True
