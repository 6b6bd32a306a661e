"""One collection cycle: discover -> snapshot -> diff -> events (+ heartbeat when due).

Pure CPU and file reads; the service runs `Scanner.scan` in a worker thread so the event loop
stays free for the transport.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import msgspec

from ..events import (
    SCHEMA_VERSION,
    CollectorStarted,
    ContainerGone,
    ContainerState,
    Event,
    Heartbeat,
    LayoutAnomaly,
)
from ..layout.declarations import MAX_PROCS
from ..layout.reader import ParseMemo, snapshot_fd
from ..layout.snapshot import Anomaly, Snapshot, empty_snapshot
from .clock import Clock, EventClock, Step
from .crosscheck import CrossCheck
from .diff import FileState, Presence, diff, host_pid_alive
from .discover import CacheFile, Discovery, ListingLimits, Skipped
from .hostpids import HostPidMemory
from .identity import IdentityStage
from .presence import PresenceStage
from .writer_faults import FileKey, WriterFaults, WriterFaultSettings

# A heartbeat is sent in parts of at most 64 containers and, past the first, 256 KiB of them:
# a Kafka request carries 1 MiB by default, and one container's state can be near that (every
# slot of a v1.2 file live on 16 devices: 0.98 MB), so such a state goes in a part of its own.
HEARTBEAT_PART = 64
HEARTBEAT_PART_BYTES = 256 * 1024


@dataclass
class ScanStats:
    scans: int = 0
    files: int = 0
    last_scan_ms: float = 0.0
    anomalies: int = 0
    events: int = 0
    clock_steps: int = 0  # steps of the wall clock absorbed (see clock.py)
    clock_offset_ms: int = 0  # wall clock - event time, as of the last step
    settled: int = 0  # files of the last scan whose snapshot was last scan's (no diff needed)


class Scanner:
    def __init__(
        self,
        root: Path,
        *,
        heartbeat_s: float,
        scan_interval_s: float | None = None,
        host_proc: str | None = None,
        inc: int | None = None,
        crosscheck: CrossCheck | None = None,
        listing: ListingLimits | None = None,
        identity: IdentityStage | None = None,
        clock: Clock | None = None,
        after_ms: int | None = None,
        writer_faults: WriterFaultSettings | None = None,
        presence: PresenceStage | None = None,
        presence_policy: Presence = "folder",
        reuse: bool = True,
        host_pids: HostPidMemory | None = None,
    ) -> None:
        """`reuse=False` parses every file in full and diffs every snapshot, as before
        ParseMemo (tests and benchmarks compare the two). `scan_interval_s`: the service's
        interval between scans, if any (heartbeats go out on scans). `host_pids`: where the
        `host_proc` judgements are kept across restarts."""
        self.discovery = Discovery(root, listing)
        self.reuse = reuse
        alive = None if host_proc is None else partial(host_pid_alive, host_proc)
        self.writer_faults = WriterFaults(writer_faults, alive)
        self.heartbeat_ms = int(heartbeat_s * 1000)
        # Heartbeats go out on scans: every `heartbeat_ms` rounded up to a whole number of scan
        # intervals (scans 20 s apart send one every 40 s for 30 s, 120 s apart every 120 s),
        # which each says (the aggregator warns when it exceeds max_gap). A scan half an
        # interval early still sends it: scans run late or early by a little, and a heartbeat
        # due "at least 30 s" after one taken a little late slipped a whole scan.
        self.heartbeat_every_ms = self.heartbeat_ms
        self._heartbeat_due_ms = self.heartbeat_ms
        if scan_interval_s:
            scan_ms = max(1, int(scan_interval_s * 1000))
            self.heartbeat_every_ms = max(-(-self.heartbeat_ms // scan_ms), 1) * scan_ms
            self._heartbeat_due_ms = self.heartbeat_every_ms - scan_ms // 2
        self.host_proc = host_proc
        self.host_pids = host_pids
        self.presence_policy: Presence = presence_policy
        self.crosscheck = crosscheck
        self.identity = identity
        self.presence = presence
        self.inc = secrets.randbits(31) if inc is None else inc
        self.clock = EventClock(clock, after_ms=after_ms)
        self.seq = 0
        self.stats = ScanStats(clock_offset_ms=self.clock.offset_ms)
        self.published: list[tuple[ContainerState, int | None]] = []
        self._files: dict[FileKey, FileState] = {}
        self._memos: dict[FileKey, ParseMemo] = {}  # per file, as _files
        # Per file, the proc_num of its last snapshot that took it for the writer's: what a
        # count that ends in exit markers is read against (see `_within_contents`)
        self._counted: dict[FileKey, int] = {}
        # Per file, a count in range its last snapshot took for garbled (see `_read`)
        self._suspect: dict[FileKey, int] = {}
        self._peeked: set[FileKey] = set()  # stale files `_peek` read this scan
        self._snaps: dict[FileKey, Snapshot] = {}  # the snapshot each was diffed to
        self._states: dict[FileKey, ContainerState] = {}  # as last published
        self._skipped: set[tuple[str, str, str]] = set()
        self._next_cid = 0
        self._last_heartbeat_ms: int | None = None
        self._ts = 0

    def _stamp(self, cls: type[Any], **fields: Any) -> Any:
        event = cls(v=SCHEMA_VERSION, inc=self.inc, seq=self.seq, ts=self._ts, **fields)
        self.seq += 1
        return event

    def announce(self, host: str, log: str, now_ms: int | None = None) -> list[Event]:
        """The incarnation's first event, `CollectorStarted` (seq 0 when called first), at the
        event time scans use (see clock.py)."""
        step = self._tick(now_ms)
        started = self._stamp(CollectorStarted, host=host, pid=os.getpid(), log=log)
        return [started] if step is None else [started, self._clock_step(step)]

    def _event_time(self, now_ms: int | None) -> list[Event]:
        """Set the time this call's events carry, with a `clock_step` anomaly when the wall
        clock stepped."""
        step = self._tick(now_ms)
        return [] if step is None else [self._clock_step(step)]

    def _tick(self, now_ms: int | None) -> Step | None:
        """Set the time this call's events carry: `now_ms` (tests), else the clock's; the wall
        clock's step since the last call, if it stepped."""
        if now_ms is not None:
            self._ts = now_ms
            return None
        self._ts, step = self.clock.now()
        return step

    def heartbeat_now(self) -> None:
        """Make the next scan send a heartbeat (e.g. after events were dropped)."""
        self._last_heartbeat_ms = None

    def scan(
        self,
        now_ms: int | None = None,
        *,
        spool_depth: int = 0,
        dropped: int = 0,
        log_blocked: int = 0,
    ) -> list[Event]:
        started = time.perf_counter()
        events = self._event_time(now_ms)
        found, skipped = self.discovery.scan()
        skipped_now: set[tuple[str, str, str]] = set()
        self._report_skipped(skipped, skipped_now, events)

        present: dict[FileKey, FileState] = {}
        refused: list[Skipped] = []
        presence = self.presence
        host_proc, policy, reuse = self.host_proc, self.presence_policy, self.reuse
        last: dict[FileKey, Snapshot] = self._snaps
        seen: dict[FileKey, Snapshot] = {}
        unchanged: set[FileKey] = set()
        if presence is not None:
            presence.begin(self.clock.offset_ms if now_ms is None else 0)
        now_s = time.monotonic()  # for the writer-fault checks' stuck seqlocks
        peek = self._peek  # (stale files only)
        for f in found:
            key = (f.path, f.dev, f.ino)
            st = self._files.get(key)
            if presence is not None:
                cid = st.cid if st is not None and st.appeared else -1
                if presence.is_stale(f, cid, self._ts, self._stamp, events, peek):
                    self.discovery.forget(f)
                    continue  # not tracked: gone (ContainerGone below if it had appeared)
            if st is None:
                st = FileState(self._next_cid, f.pod_uid, f.container, f.path)
                self._next_cid += 1
                if self.host_pids is not None:
                    self.host_pids.seed(key, st)
            snap = self._read(f, refused, now_s)
            if snap is None:
                continue  # vanished or refused: gone (ContainerGone below if it had appeared)
            if reuse and host_proc is None and _settled(st, snap, last.get(key)):
                st.last_kernel_time = snap.last_kernel_time
                unchanged.add(key)
            else:
                events += diff(st, snap, self._stamp, host_proc=host_proc, policy=policy)
            seen[key] = snap
            present[key] = st
        if presence is not None:
            presence.end(self.discovery.is_unlisted)
        if self.discovery.unlisted:
            events += self._keep_unlisted(present, seen)
        self._report_skipped(refused, skipped_now, events)
        if present.keys() != self._files.keys():
            self.writer_faults.keep(present)  # (it keeps those of this scan's files only)
        self._snaps = seen
        if len(self._memos) > len(present):
            self._memos = {k: m for k, m in self._memos.items() if k in present}
        # (a stale file read this scan keeps its count: see `_peek`)
        peeked, self._peeked = self._peeked, set()
        if len(self._counted) > len(present):
            self._counted = {k: n for k, n in self._counted.items() if k in present or k in peeked}
        if self._suspect.keys() - present.keys():
            self._suspect = {k: n for k, n in self._suspect.items() if k in present or k in peeked}
        self._skipped = skipped_now
        for key in sorted(self._files.keys() - present.keys()):
            gone = self._files[key]
            if gone.appeared:
                events.append(self._stamp(ContainerGone, cid=gone.cid))
        self._files = present
        if self.host_pids is not None:
            self.host_pids.save(present)
        if presence is not None:
            events += presence.process(self._files.values(), self._ts, self._stamp)
        if self.crosscheck is not None:
            events += self.crosscheck.check(self._ts, self._files.values(), self._stamp)
        if self.identity is not None:
            events += self.identity.process(self._files.values(), self._stamp)

        elapsed_ms = (time.perf_counter() - started) * 1000
        self.stats.scans += 1
        self.stats.files = len(present)
        self.stats.settled = len(unchanged)
        self.stats.last_scan_ms = elapsed_ms
        self.stats.anomalies += sum(isinstance(e, LayoutAnomaly) for e in events)
        if (
            self._last_heartbeat_ms is None
            or self._ts - self._last_heartbeat_ms >= self._heartbeat_due_ms
        ):
            self._last_heartbeat_ms = self._ts
            events += self._heartbeat(elapsed_ms, spool_depth, dropped, log_blocked)
        self.stats.events += len(events)
        # Read by the /metrics endpoint on the event loop: replaced whole, never mutated.
        # A settled file's state is last scan's: diff did not touch it.
        kept, states = self._states, {}
        for key, st in sorted(self._files.items()):
            if st.appeared and not st.unobserved:
                state = kept.get(key) if key in unchanged else None
                states[key] = state if state is not None else st.state()
        self._states = states
        self.published = [(s, self._files[k].last_kernel_time) for k, s in states.items()]
        return events

    def last_heartbeat(
        self, *, spool_depth: int = 0, dropped: int = 0, log_blocked: int = 0
    ) -> list[Event]:
        """A heartbeat now, out of turn: what a collector that stops says last (the events it
        dropped since its last heartbeat that was stored)."""
        events = self._event_time(None)
        return events + self._heartbeat(0.0, spool_depth, dropped, log_blocked)

    def _keep_unlisted(
        self, present: dict[FileKey, FileState], seen: dict[FileKey, Snapshot]
    ) -> list[Event]:
        """Files not found because their folder, or the root, could not be listed this scan
        (EMFILE, EIO, a remount): unusable for this scan, like a file that cannot be opened
        (diff keeps their processes, and the next good scan restates them), not gone."""
        events: list[Event] = []
        for key in sorted(self._files.keys() - present.keys()):
            folder = os.path.dirname(key[0])
            if self.discovery.is_unlisted(folder):
                st = self._files[key]
                snap = empty_snapshot(key[0], 0, [Anomaly("unreadable", f"{folder}: not listed")])
                events += diff(st, snap, self._stamp, host_proc=self.host_proc,
                               policy=self.presence_policy)  # fmt: skip
                seen[key] = snap
                present[key] = st
        return events

    def _report_skipped(
        self, skipped: list[Skipped], now: set[tuple[str, str, str]], events: list[Event]
    ) -> None:
        """Each skipped path once while it persists, again when it comes back."""
        new = {(s.path, s.reason, s.kind) for s in skipped} - now
        now |= new
        for path, reason, kind in sorted(new - self._skipped):
            events.append(
                self._stamp(LayoutAnomaly, cid=-1, path=path, anomaly=kind, detail=reason)
            )

    def _read(self, f: CacheFile, skipped: list[Skipped], now_s: float) -> Snapshot | None:
        """A snapshot of `f` opened beneath the root; None when it is gone or refused (the
        reason is added to `skipped`)."""
        try:
            opened = self.discovery.open(f)
        except FileNotFoundError:
            return None
        except OSError as exc:
            return empty_snapshot(f.path, 0, [Anomaly("unreadable", f"open: {exc.strerror}")])
        if isinstance(opened, Skipped):
            skipped.append(opened)
            return None
        key = (f.path, f.dev, f.ino)
        memo = self._memos.get(key)
        if memo is None and self.reuse:
            memo = self._memos[key] = ParseMemo()
        fd, st, kept = opened
        faults = self.writer_faults
        try:
            ahead = None if memo is None else faults.ahead(key)
            snap = self._snapshot(key, fd, f.path, st, memo, ahead)
            snap = faults.check(key, fd, snap, now_s, None if memo is None else memo.past)
        finally:
            if not kept:
                os.close(fd)
        self._took(key, snap)
        return snap

    def _snapshot(
        self,
        key: FileKey,
        fd: int,
        path: str,
        st: os.stat_result,
        memo: ParseMemo | None,
        ahead: Callable[[int], int] | None,
    ) -> Snapshot:
        """`snapshot_fd` with the count this file's snapshots last took for the writer's."""
        counted = self._counted.get(key)
        snap = snapshot_fd(fd, path, memo=memo, st=st, ahead=ahead, counted=counted)
        n = snap.proc_num
        if snap.anomalies and 0 <= n <= MAX_PROCS and _out_of_range(snap):
            if self._suspect.get(key) == n != counted:
                # The same count, taken for garbled, as at the last scan: the writer's (a
                # garbled word does not stay; a collector that starts while a probe's exit
                # marker is the last counted slot reads one at every scan, and billed the
                # live processes past the marker nothing for as long as it stayed).
                if memo is not None:
                    memo.last = None  # (what it holds was read with the other count)
                snap = snapshot_fd(fd, path, memo=memo, st=st, ahead=ahead, counted=n)
            else:
                self._suspect[key] = n
        return snap

    def _took(self, key: FileKey, snap: Snapshot) -> None:
        """Remember the count `snap` took for the writer's (see `_snapshot`)."""
        if 0 <= snap.proc_num <= MAX_PROCS and not (snap.anomalies and _out_of_range(snap)):
            self._suspect.pop(key, None)
            if snap.proc_num != self._counted.get(key):
                self._counted[key] = snap.proc_num

    def _peek(self, f: CacheFile) -> Snapshot | None:
        """A snapshot of `f` read afresh, for a file the scan does not track (a stale folder's:
        the scanner forgets its descriptors after); None when it cannot be read."""
        try:
            opened = self.discovery.open(f)
        except OSError:
            return None
        if isinstance(opened, Skipped):
            return None
        fd, st, kept = opened
        key = (f.path, f.dev, f.ino)
        self._peeked.add(key)
        try:
            snap = self._snapshot(key, fd, f.path, st, None, None)
        finally:
            if not kept:
                os.close(fd)
        self._took(key, snap)
        return snap

    def _clock_step(self, step: Step) -> Event:
        self.stats.clock_steps += 1
        self.stats.clock_offset_ms = step.offset_ms
        way = "forward" if step.ms > 0 else "back"
        detail = (
            f"wall clock stepped {way} by {abs(step.ms)} ms; event time keeps the monotonic "
            f"clock and is now {step.offset_ms} ms from the wall clock"
        )
        event: Event = self._stamp(
            LayoutAnomaly,
            cid=-1,
            path=self.discovery.shown_root,
            anomaly="clock_step",
            detail=detail,
            value=step.ms,
        )
        return event

    def _heartbeat(
        self, scan_ms: float, spool_depth: int, dropped: int, log_blocked: int
    ) -> list[Event]:
        states = [
            st.state() for _, st in sorted(self._files.items()) if st.appeared and not st.unobserved
        ]
        parts = _parts(states)
        return [
            self._stamp(
                Heartbeat,
                interval_ms=self.heartbeat_every_ms,
                part=i,
                parts=len(parts),
                containers=part,
                scan_ms=round(scan_ms, 3),
                files=len(self._files),
                spool_depth=spool_depth,
                dropped=dropped,
                log_blocked=log_blocked,
                pods=self.identity.restate(part) if self.identity is not None else [],
            )
            for i, part in enumerate(parts)
        ]


def _parts(states: list[ContainerState]) -> list[list[ContainerState]]:
    """`states` in order, cut into heartbeat parts (see HEARTBEAT_PART); one empty part if none."""
    parts: list[list[ContainerState]] = [[]]
    size = 0
    for state in states:
        n = len(msgspec.msgpack.encode(state))
        part = parts[-1]
        if part and (len(part) == HEARTBEAT_PART or size + n > HEARTBEAT_PART_BYTES):
            part = []
            parts.append(part)
            size = 0
        part.append(state)
        size += n
    return parts


def _out_of_range(snap: Snapshot) -> bool:
    """Whether `snap` took its proc_num for garbled."""
    return any(a.kind == "proc_num_out_of_range" for a in snap.anomalies)


def _settled(st: FileState, snap: Snapshot, prev: Snapshot | None) -> bool:
    """True when diffing `snap` could only set `st.last_kernel_time`: diff already took `st`
    to `prev`, and `snap` has the very objects `prev` had for everything else diff reads (the
    reader hands back last scan's procs and device table where their bytes are unchanged; see
    ParseMemo), so a second diff finds nothing to tell. A pending restatement or an unusable
    last snapshot always goes through diff."""
    return (
        prev is not None
        and snap.procs is prev.procs
        and snap.devices is prev.devices
        and snap.layout == prev.layout
        and snap.anomalies == prev.anomalies
        and not st.restate
        and not st.unobserved
    )
