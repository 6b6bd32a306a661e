"""Processor: a cache folder that outlives its container is not billed.

HAMi-core never deletes a container's folder, so a completed Job's pod kept for days would have
its reservation (limits) billed the whole time. With the pod watch on, a container whose status
is `terminated`, or `waiting` after a terminated run (a crash loop's back-off), or any container
of a `Succeeded`/`Failed` pod, is *stale*: its run ends at Kubernetes' `finishedAt`
(`ContainerRun`, see `runs`), the scan stops tracking its file, which ends it in the stream
(`ContainerGone` at that scan: usage is billed as measured until then), and it is reported once
per termination as `stale_container`, with its age since `finishedAt` as `value` (seconds). When
the container runs again (a restart), its file is tracked again as a new container; once its pod
is gone from the watch (deleted, and forgotten a while later) it cannot, and its folder stays
stale while it exists, a scan that could not list it (or the root) notwithstanding; this is
remembered in memory only, so a collector restarted after the pod was forgotten tracks the folder
again. While it is tracked, `runs` states when it runs (restarts the watch missed, a deleted pod).

The kubelet's status lags a restart (a crash loop's short runs may never show `running` at
all), so a stale folder of a pod whose phase is not final is read on each scan: its slots (pid,
host pid, status, memory) as the first clear read after the termination found them are its
mark, and a live slot the mark does not hold is a new run's process at work (nothing of the
ended run is left to write; an exit leaves no live slot), as is a live slot in a file that was
not there when the folder was marked (a new run may name its file anew). That file is tracked
again from that scan, whatever the watch says yet, until the watch shows another state; a pod
that reaches a final phase first ends it at that scan (the watch never said when). A read that
is not clear (unreadable, uninitialised, a garbled count) tells nothing, a torn slot is left out
of the mark as the reader leaves it out, and a scan that cannot list the folder keeps its
marks. A pod in a final phase cannot run its containers again: its folders are not read.

Without the pod watch nothing is stale: every folder is billed while it exists.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping

from ..events import Event, LayoutAnomaly
from ..layout.snapshot import Snapshot
from .diff import FileState, Stamp
from .discover import CacheFile
from .pods import PodView
from .runs import Runs, iso_ms

STALE_CONTAINER = "stale_container"
_DONE = ("Succeeded", "Failed")


class PresenceStage:
    def __init__(
        self,
        view: Callable[[], Mapping[str, PodView]],
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._view = view
        self._now: Mapping[str, PodView] = {}
        self._reported: set[tuple[str, str, str]] = set()  # (pod uid, container, finishedAt)
        # (pod uid, container, finishedAt) of this scan's stale files -> their folder
        self._seen: dict[tuple[str, str, str], str] = {}
        # (pod uid, container) -> (finishedAt, folder) of the stale folders: a pod the watch no
        # longer has (deleted, then forgotten after `keep_deleted_s`) cannot run again, and its
        # folder, still there, stays stale
        self._ended: dict[tuple[str, str], tuple[str, str]] = {}
        # (pod uid, container, finishedAt, file) of the stale files read -> their mark (see
        # `_mark`), and those a new run's process has written since: tracked again
        self._marks: dict[tuple[str, str, str, str], frozenset[SlotMark] | None] = {}
        self._marks_now: dict[tuple[str, str, str, str], frozenset[SlotMark] | None] = {}
        self._restarted: set[tuple[str, str, str, str]] = set()
        self._restarted_now: set[tuple[str, str, str, str]] = set()
        self._offset_ms = 0
        self.runs = Runs(monotonic)
        self.stale = 0  # folders not billed now (gauge)

    def begin(self, offset_ms: int = 0) -> None:
        """Once per scan, before `is_stale` is asked about its files. `offset_ms`: the wall
        clock's offset from event time (Kubernetes' timestamps are wall clock)."""
        self._now = self._view()
        self._seen = {}
        self._marks_now, self._restarted_now = {}, set()
        self._offset_ms = offset_ms

    def end(self, unlisted: Callable[[str], bool]) -> None:
        """Once per scan, after its files. `unlisted(folder)`: whether this scan could not list
        `folder` (or the root), so that what it holds is unknown, not gone."""
        # An ended container whose folder was not listed is still ended: `_ended` is all that
        # keeps a forgotten pod's folder stale, and one failed listing must not bill it again.
        kept = {key: ended for key, ended in self._ended.items() if unlisted(ended[1])}
        seen = {
            (uid, container): (at, folder) for (uid, container, at), folder in self._seen.items()
        }
        self._ended = kept | seen
        # So are the marks and restarts of a folder not listed: its next listing goes on from them.
        self._marks = self._marks_now | {
            at: mark for at, mark in self._marks.items() if unlisted(os.path.dirname(at[3]))
        }
        self._restarted = self._restarted_now | {
            at for at in self._restarted if unlisted(os.path.dirname(at[3]))
        }
        # A termination whose folder went (or whose container runs again) is forgotten.
        self._reported &= {
            (uid, container, at) for (uid, container), (at, _) in self._ended.items()
        }
        self.stale = len(self._ended)

    def process(self, files: Iterable[FileState], now_ms: int, stamp: Stamp) -> list[Event]:
        """After the diff: the running intervals of the tracked containers (`runs`)."""
        return self.runs.process(files, self._now, now_ms, self._offset_ms, stamp)

    def is_stale(
        self,
        f: CacheFile,
        cid: int,
        now_ms: int,
        stamp: Stamp,
        events: list[Event],
        read: Callable[[CacheFile], Snapshot | None] | None = None,
    ) -> bool:
        """Whether `f` is stale (not tracked); `read(f)`: its snapshot, read afresh (a stale
        folder of a pod that may restart its container is read each scan)."""
        pod_uid, container, path = f.pod_uid, f.container, f.path
        pv = self._now.get(pod_uid)
        if pv is None:
            ended = self._ended.get((pod_uid, container))
            if ended is not None:
                self._seen[(pod_uid, container, ended[0])] = ended[1]
            return ended is not None
        run = pv.run(container)
        finished: str | None = None
        started = last = ""
        if run is not None and run.state == "terminated":
            finished, started, last = run.finished, run.started, run.last_finished
        elif (
            run is not None
            and run.state == "waiting"
            and (run.last_finished or run.last_terminated)
        ):
            # (its time "" when null: taken as this scan's, as a terminated state's is)
            finished = run.last_finished
        elif pv.phase in _DONE:
            finished = ""  # the pod is done; this container has no terminated status of its own
        if finished is None:
            return False
        key = (pod_uid, container, finished)
        file = (*key, path)
        may_run = pv.phase not in _DONE
        if may_run and file in self._restarted:
            self._restarted_now.add(file)
            return False  # a new run's process writes it: tracked, whatever the watch says yet
        if cid >= 0:
            # A run tracked past this termination (see `_written`) is a later one, whose end
            # the watch has not told: it ends now.
            end = None if file in self._restarted else iso_ms(finished)
            events += self.runs.stop(cid, end, now_ms, self._offset_ms, stamp, started,
                                     last)  # fmt: skip
        if read is not None and may_run and self._written(file, read(f)):
            self._restarted_now.add(file)
            return False
        self._seen[key] = os.path.dirname(path)
        if key not in self._reported:
            self._reported.add(key)
            at = iso_ms(finished)
            age = None if at is None else max(0, (now_ms + self._offset_ms - at) // 1000)
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

    def _written(self, at: tuple[str, str, str, str], snap: Snapshot | None) -> bool:
        """Whether a process of a new run is at work in the file `snap` read (None: it could
        not be read): a live slot (pid, host pid, status, memory) that its mark, taken at the
        first clear read after the termination, does not hold; or any live slot in a file that
        was not there when its folder was marked (a new run may create its own file). A read
        that is not clear (unreadable, uninitialised, a garbled count) tells nothing: a failed
        read is no new run."""
        seen = at in self._marks
        was = self._marks.get(at)
        if snap is None or not _clear(snap):
            self._marks_now[at] = was  # (None: seen, not read clearly yet)
            return False
        now = _mark(snap)
        if was is None:
            self._marks_now[at] = now
            # A file not there when its folder was marked (one there, unreadable then, is not
            # new: its first clear read is its mark)
            return not seen and any(m[3] for m in now) and any(k[:3] == at[:3] for k in self._marks)
        self._marks_now[at] = was
        return any(m[3] for m in now - was)


# (slot, pid, host pid, live, memory per device) of one slot
SlotMark = tuple[int, int, int, bool, tuple[tuple[int, int], ...]]
# (a torn slot is left out of the read, as the reader leaves it out: the rest is clear)
_UNCLEAR = frozenset(("unreadable", "not_initialized", "proc_num_out_of_range"))


def _clear(snap: Snapshot) -> bool:
    """Whether `snap` shows every slot below its count as the file holds it."""
    return snap.layout is not None and not any(a.kind in _UNCLEAR for a in snap.anomalies)


def _mark(snap: Snapshot) -> frozenset[SlotMark]:
    """What only a running process changes in a file: its slots' pid, host pid, status and
    memory (HAMi-core's utilisation watcher, which writes the rest, runs in those processes).
    An exit (pid and status 0) is no sign of a new run: such a slot is never live."""
    return frozenset(
        (p.slot, p.pid, p.hostpid, p.pid != 0 and p.status != 0,
         tuple((u.index, u.total) for u in p.devices))
        for p in snap.procs
    )  # fmt: skip
