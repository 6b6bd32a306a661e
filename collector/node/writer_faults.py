"""What the real HAMi-core writer gets wrong, recognised across scans (see `simulate_faults`).

Per file, after its snapshot and while its descriptor is open:

* `stuck_seqlock`: a slot left out as `torn_read` whose seqlock stays at one odd value with its
  bytes unchanged for `stuck_after_s` is a writer killed between its two increments. Nobody will
  finish that update: the slot is read as it stands (quiescent), so it neither drops out of the
  bill nor holds back anything.
* `orphaned_slot`: a compaction that left a moved process's slot pointer stale makes that
  process write at or beyond `proc_num` while a frozen copy of it sits below. The slots past
  `proc_num` are read each scan; a live one whose bytes change while its copy below does not is
  being written, and its usage is taken from there instead of from the frozen copy. One with no
  live copy below is a leftover, never an orphan. Two live slots below `proc_num` with one
  (pid, hostpid) are reported too, and the one its writer updates (the higher seqlock count) is
  used.
* `shared_slot`: a new process given the slot such a stale pointer writes; see `_shared`.

Nothing here writes to the file; every read is a `pread` of the descriptor the scan opened.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import msgspec

from ..layout.declarations import LAYOUTS, MAX_PROCS, Layout
from ..layout.reader import Past, parse_slot
from ..layout.snapshot import Anomaly, ProcSnapshot, Snapshot

FileKey = tuple[str, int, int]  # (path, device, inode), as the scanner keys files
# Slots past proc_num read each scan: at least BEYOND (one compaction leaves its mover at
# proc_num), up to the highest proc_num seen (a compaction of several holes leaves movers
# further out) and on to the first slot never written, at most REACH.
BEYOND = 2
REACH = 64


@dataclass(frozen=True)
class WriterFaultSettings:
    # The writer holds its seqlock odd for nanoseconds: odd with the same count and bytes on two
    # consecutive scans (after the reader's retries) is a writer that will not finish. 0 takes
    # it on the second scan; more demands that long.
    stuck_after_s: float = 0.0


@dataclass
class _Watch:
    stuck: dict[int, tuple[int, bytes, float]] = field(default_factory=dict)  # (seq, raw, since)
    beyond: dict[int, bytes] = field(default_factory=dict)  # slot -> bytes at the last scan
    below: dict[tuple[int, int], bytes] = field(default_factory=dict)  # (pid, hostpid) -> bytes
    orphans: set[int] = field(default_factory=set)  # slots past proc_num seen being written
    # slot -> the (pid, hostpid) seen writing it past proc_num, while that process lives
    writers: dict[int, tuple[int, int]] = field(default_factory=dict)
    # slot -> (the newcomer, the stale writer) of a `shared_slot` raised, while that writer's
    # copy lives, and the slot's `_owned` bytes when first read past proc_num (or None)
    shared: dict[int, tuple[tuple[int, int], tuple[int, int], bytes | None]] = field(
        default_factory=dict
    )
    high: int = 0  # the highest proc_num seen
    # (pid, hostpid) of the live processes the last check handed on: a compaction's mover is
    # held only for a process the collector already bills.
    known: set[tuple[int, int]] = field(default_factory=set)
    # slots past proc_num read as a compaction's mover at the last check (see `_beyond`)
    moving: set[int] = field(default_factory=set)
    unique: list[ProcSnapshot] = field(default_factory=list)  # procs that held no duplicate
    # What a check that found nothing and changed nothing was given: (layout, proc_num, the
    # procs object, the anomalies, the reader's read that held the bytes past proc_num, where
    # they end, where they begin in it). The same again finds nothing again.
    quiet: tuple[str, int, list[ProcSnapshot], list[Anomaly], bytes, int, int] | None = None

    def end(self, proc_num: int) -> int:
        """The slot up to which `_beyond` first reads past `proc_num`:
        min(max(n + BEYOND, high), n + REACH, MAX_PROCS) for n clamped to 0..MAX_PROCS (called
        for every file on every scan, so without the calls)."""
        n = proc_num if 0 <= proc_num <= MAX_PROCS else (0 if proc_num < 0 else MAX_PROCS)
        end = n + BEYOND
        if end < self.high:
            end = self.high if self.high < n + REACH else n + REACH
        return end if end < MAX_PROCS else MAX_PROCS


class WriterFaults:
    def __init__(
        self,
        settings: WriterFaultSettings | None = None,
        host_alive: Callable[[int], bool] | None = None,
    ) -> None:
        """`host_alive(hostpid)`: whether a host pid is alive (`--host-proc`), or None."""
        self.settings = settings or WriterFaultSettings()
        self.host_alive = host_alive
        self._files: dict[FileKey, _Watch] = {}

    def keep(self, keys: Iterable[FileKey]) -> None:
        """Forget the files that are gone."""
        wanted = set(keys)
        self._files = {k: w for k, w in self._files.items() if k in wanted}

    def ahead(self, key: FileKey) -> Callable[[int], int]:
        """For the reader (`snapshot_fd`'s `ahead`): how far past proc_num this file's check
        will read, so the reader can read those slots along with its own."""
        w = self._files.get(key)
        if w is None:
            w = self._files[key] = _Watch()
        return w.end

    def check(
        self,
        key: FileKey,
        fd: int,
        snap: Snapshot,
        now_s: float,
        past: Past | None = None,
    ) -> Snapshot:
        """`past`: two reads of the slots [proc_num, end) when the reader read them along
        (`ParseMemo.past`), used instead of reading them again."""
        w = self._files.get(key)
        n = snap.proc_num
        if w is not None and past is not None:
            q = w.quiet
            if (
                q is not None
                and q[2] is snap.procs
                and q[1] == n == past[0]
                and q[0] == snap.layout
                and q[5] == past[1]
                and q[6] == past[4]
                and past[2] == past[3] == q[4]  # (whole reads: those slots among them)
                and q[3] == snap.anomalies
            ):
                # Every input of the checks below is as in a check that found nothing, took
                # no slot and left its state as it was (so `end` is as then too): they would
                # do the same again.
                return snap
        layout = LAYOUTS.get(snap.layout or "")
        if layout is None:
            return snap
        if w is None:
            w = self._files[key] = _Watch()
        if past is not None and (past[0] != n or past[1] != w.end(n)):
            past = None
        w.quiet = None
        procs = list(snap.procs)
        anomalies = list(snap.anomalies)
        self._stuck(w, fd, layout, snap.device_num, procs, anomalies, now_s)
        self._shared(w, snap, procs, anomalies)
        stable = self._beyond(w, fd, layout, snap, procs, anomalies, past)
        if procs != w.unique:  # the same procs as a scan that found no duplicate: none now
            _duplicates(fd, layout, procs, anomalies)
            if procs == snap.procs and anomalies == snap.anomalies:
                w.unique = snap.procs
        if procs == snap.procs and anomalies == snap.anomalies:
            torn = any(a.kind == "torn_read" for a in anomalies)
            if (
                past is not None
                and stable is not None
                # nothing read on past `end`: a quiet check compares only the bytes up to it
                and len(stable) == len(past[2]) - past[4]
                and past[2] == past[3]
                and not (w.stuck or w.writers or w.orphans or w.moving or torn)
            ):
                w.quiet = (layout.name, n, snap.procs, snap.anomalies, past[2], w.end(n), past[4])
            return snap
        procs.sort(key=lambda p: p.slot)
        return msgspec.structs.replace(snap, procs=procs, anomalies=anomalies)

    def _stuck(
        self,
        w: _Watch,
        fd: int,
        layout: Layout,
        device_num: int,
        procs: list[ProcSnapshot],
        anomalies: list[Anomaly],
        now_s: float,
    ) -> None:
        seen: dict[int, tuple[int, bytes, float]] = {}
        for a in [a for a in anomalies if a.kind == "torn_read" and a.slot is not None]:
            k = a.slot
            assert k is not None
            # The slot's pid (not under the seqlock, so as good as any read), every layout:
            # the process whose exit the torn slot holds back, wherever compaction moved it.
            pid = _pread(fd, layout.slot_offset(k), 4)
            if len(pid) == 4:
                i = anomalies.index(a)
                anomalies[i] = a = msgspec.structs.replace(
                    a, value=int.from_bytes(pid, "little", signed=True)
                )
            if layout.slot_seqlock is not None:
                got = _stable_odd(fd, layout, k)
                if got is None:
                    continue  # really changing: a torn read this time
                seq, raw = got
                # Stable in what only the process writes: the watcher may still write the rest.
                owned = _owned(layout, raw)
                prev = w.stuck.get(k)
                same = prev is not None and prev[:2] == (seq, owned)
                since = prev[2] if prev is not None and same else now_s
                seen[k] = (seq, owned, since)
                if not same or now_s - since < self.settings.stuck_after_s:
                    # first seen this scan, or seen odd before at another count or with other
                    # bytes (a live writer caught mid-update twice): wait for the next one
                    continue
                proc, extra = parse_slot(layout, k, raw, device_num)
                procs.append(proc)
                anomalies.remove(a)
                anomalies.extend(extra)
                detail = (
                    f"slot {k}: seqlock {seq} odd and unchanged, its bytes stable, since "
                    f"{now_s - since:.3g} s: a writer died mid-update; read as it stands"
                )
                anomalies.append(Anomaly("stuck_seqlock", detail, slot=k, value=seq))
        w.stuck = seen

    @staticmethod
    def _shared(
        w: _Watch, snap: Snapshot, procs: list[ProcSnapshot], anomalies: list[Anomaly]
    ) -> None:
        """`shared_slot`: a new process was given the slot a stale pointer writes (the library
        adds at proc_num). From then on both processes' `used[]` changes land in that one slot,
        and what the stale writer had there was zeroed with it: not separable from the file,
        so billed as written (the newcomer's row carries both, the stale writer's copy below
        stays as it was). Raised each scan while both live (the diff reports it once)."""
        n = min(max(snap.proc_num, 0), MAX_PROCS)
        for k, key in list(w.writers.items()):
            if not any((p.pid, p.hostpid) == key and p.slot != k for p in procs):
                del w.writers[k]  # its copy below is gone: the process ended
                w.shared.pop(k, None)
                continue
            now = next((p for p in procs if p.slot == k), None) if k < n else None
            if now is None or now.pid == 0 or (now.pid, now.hostpid) == key:
                continue
            w.shared[k] = ((now.pid, now.hostpid), key, None)
            detail = (
                f"pid {now.pid} (host pid {now.hostpid}) was given slot {k}, which pid {key[0]} "
                f"(host pid {key[1]}) still writes through a stale slot pointer: both count in "
                "that slot, not separable; billed as written"
            )
            anomalies.append(Anomaly("shared_slot", detail, slot=k, value=now.pid))

    def _beyond(
        self,
        w: _Watch,
        fd: int,
        layout: Layout,
        snap: Snapshot,
        procs: list[ProcSnapshot],
        anomalies: list[Anomaly],
        past: Past | None = None,
    ) -> bytes | None:
        """Returns the bytes past proc_num when both reads of them agreed (None otherwise)."""
        n = min(max(snap.proc_num, 0), MAX_PROCS)
        below: dict[tuple[int, int], bytes] = {}
        seen: dict[int, bytes] = {}
        end = w.end(n)
        w.high = max(w.high, n)
        size = layout.slot_size
        limit = min(n + REACH, MAX_PROCS)

        def more_to_read(first: bytes) -> bool:
            # proc_num can rise and fall again between two scans (processes added, then
            # holes compacted), leaving movers past the highest proc_num a scan saw: read on
            # while the last slot read was ever written (slots never used are zero).
            return end < limit and len(first) == (end - n) * size and first[-size:].count(0) != size

        first = b"" if past is None else past[2][past[4] :]
        if past is not None and past[0] == n and past[1] == end and not more_to_read(first):
            # The reader's two reads of the slots, made after the snapshot's: the same pair.
            second = past[3][past[4] :][: len(first)]
        else:
            # One read of the range, and a second to tell a slot being written from a steady
            # one.
            first = _pread(fd, layout.slot_offset(n), (end - n) * size)
            while more_to_read(first):
                more = min(end + BEYOND, limit)
                first += _pread(fd, layout.slot_offset(end), (more - end) * size)
                end = more
            second = b""
        if first.count(0) == len(first):
            w.beyond, w.orphans, w.moving = {}, set(), set()
            w.known = _live(procs)
            return first if first == second else None  # nothing ever written past proc_num
        if not second:
            second = _pread(fd, layout.slot_offset(n), len(first))
        moving: set[int] = set()
        for k in range(n, n + len(first) // size):
            lo = (k - n) * size
            raw = first[lo : lo + size]
            if raw != second[lo : lo + size]:
                continue  # changing under us: look again next scan
            if raw.count(0) == size:
                continue
            seen[k] = mine = _owned(layout, raw)
            prev = w.beyond.get(k)
            if prev == mine and k not in w.orphans and k not in w.moving:
                continue  # the usual case: a stale copy compaction left, unchanged
            proc, _ = parse_slot(layout, k, raw, snap.device_num)
            if proc.pid == 0 or proc.status == 0:
                continue
            key = (proc.pid, proc.hostpid)
            # Compaction copies the mover into a hole below proc_num, and only a compaction
            # strands a pointer: a process writing past proc_num has a live copy below for as
            # long as it lives. A live-looking slot without one is what a process left that
            # started at this index and ended between two scans (before 2026-03 an exit
            # compacts itself away at once): nobody writes it.
            copy_at = [p.slot for p in procs if (p.pid, p.hostpid) == key and p.slot < n]
            if not copy_at and k == n and key in w.known and _hole(procs, n):
                # HAMi-core compacts by lowering proc_num first, then copying the last slot
                # (now at proc_num) into the hole, field by field, then clearing it. Caught
                # after the count is lowered and before the pid is copied, a known process
                # sits just past the count with an exit marker still below: it is being moved,
                # not gone. Its slot is the one it has always written: it is read from there.
                moving.add(k)
                procs.append(proc)
                continue
            shared = w.shared.get(k)
            if not copy_at and shared is not None and shared[:2] == (key, w.writers.get(k)):
                # The newcomer of a `shared_slot`, since killed and compacted away with its pid
                # left in the slot. Its stale writer's copy below is no sign of life (an exit
                # through a stale pointer clears the slot it writes, not the copy): the slot is
                # billed, as written, once written since it went past proc_num (its seqlock
                # counted on), and while that writer's copy stays; with `--host-proc`, not at a
                # scan that finds it unwritten since the last and the writer's host pid gone (a
                # writer whose host pid went stale still writes: its writes vouch for it).
                was = shared[2]
                if was is None:
                    w.shared[k] = (shared[0], shared[1], mine)
                    was = mine
                seq = layout.slot_seqlock
                if k not in w.orphans and (
                    mine == was or (seq is not None and _count(mine) <= _count(was))
                ):
                    continue  # not written since: its writer may be gone
                w.orphans.add(k)  # (looked at on every scan from now on)
                alive, hostpid = self.host_alive, shared[1][1]
                if prev == mine and alive is not None and hostpid > 0 and not alive(hostpid):
                    continue
                procs.append(proc)
                detail = (
                    f"pid {proc.pid} (host pid {proc.hostpid}), compacted away, is in slot {k}, "
                    f"at or beyond proc_num {snap.proc_num}, which pid {shared[1][0]} (host pid "
                    f"{shared[1][1]}) still writes through a stale slot pointer: billed as written"
                )
                anomalies.append(Anomaly("orphaned_slot", detail, slot=k, value=proc.pid))
                continue
            if not copy_at:
                w.orphans.discard(k)
                w.writers.pop(k, None)
                w.shared.pop(k, None)
                continue
            # Only the process itself writes `used[]` and the seqlock (the watcher writes the
            # copy below too): its copy below proc_num is frozen there.
            copy_raw = _pread(fd, layout.slot_offset(copy_at[0]), layout.slot_size)
            below[key] = _owned(layout, copy_raw)
            if layout.slot_seqlock is not None:
                # The seqlock counts its process's updates: the copy it writes is ahead.
                stale = _count(mine) > _count(below[key])
                if k == n and _count(mine) == _count(below[key]) and mine != below[key]:
                    # The same count with other bytes: nobody wrote either copy since the
                    # compaction copied the seqlock (the process's own update would raise
                    # it), so the copy below is still being filled in, used[] device by
                    # device, and holds what the removed process left on the devices not
                    # copied yet. The slot being moved is whole: the process is read from it
                    # until the copy is done (then both agree and the copy below is used).
                    moving.add(k)
                    procs[:] = [p for p in procs if (p.pid, p.hostpid) != key]
                    procs.append(proc)
                    continue
            else:  # no seqlock: the copy below has not changed since the last scan
                frozen = below[key] == w.below.get(key)
                stale = frozen and (prev not in (None, mine) or k in w.orphans)
            if not stale:
                w.orphans.discard(k)
                w.writers.pop(k, None)
                w.shared.pop(k, None)
                continue  # a stale copy compaction left behind, or a slot moved under us
            w.orphans.add(k)
            w.writers[k] = key
            copy = [p for p in procs if (p.pid, p.hostpid) == key]
            procs[:] = [p for p in procs if (p.pid, p.hostpid) != key]
            procs.append(_merged(proc, copy[0]) if copy else proc)
            detail = (
                f"pid {proc.pid} (host pid {proc.hostpid}) writes slot {k}, at or beyond "
                f"proc_num {snap.proc_num}: a slot pointer left stale by compaction; its "
                "usage is taken from there"
            )
            anomalies.append(Anomaly("orphaned_slot", detail, slot=k, value=proc.pid))
        w.beyond = seen
        # A copy is looked up only for a process with a slot below proc_num: the copies of
        # processes no longer there are dropped (kept, they grew with every process a
        # container ever ran).
        live = {(p.pid, p.hostpid) for p in snap.procs if p.slot < n}
        w.below = {key: raw for key, raw in {**w.below, **below}.items() if key in live}
        w.orphans &= seen.keys()
        w.moving = moving
        w.known = _live(procs)
        return first if first == second else None


def _duplicates(
    fd: int, layout: Layout, procs: list[ProcSnapshot], anomalies: list[Anomaly]
) -> None:
    """Two live slots with one (pid, hostpid): keep the one its writer updates."""
    live = [(p.pid, p.hostpid) for p in procs if p.pid != 0 and p.status != 0]
    if len(set(live)) == len(live):
        return  # the usual case
    groups: dict[tuple[int, int], list[ProcSnapshot]] = {}
    for p in procs:
        if p.pid != 0 and p.status != 0:
            groups.setdefault((p.pid, p.hostpid), []).append(p)
    for (pid, hostpid), same in groups.items():
        if len(same) < 2:
            continue
        keep = max(same, key=lambda p: (_seq(fd, layout, p.slot), -p.slot))
        for p in same:
            if p is keep:
                continue
            procs.remove(p)
            detail = (
                f"pid {pid} (host pid {hostpid}) is in slots {p.slot} and {keep.slot}: a slot "
                f"pointer left stale by compaction; usage is taken from slot {keep.slot}"
            )
            anomalies.append(Anomaly("orphaned_slot", detail, slot=p.slot, value=pid))


def _live(procs: list[ProcSnapshot]) -> set[tuple[int, int]]:
    return {(p.pid, p.hostpid) for p in procs if p.pid != 0 and p.status != 0}


def _hole(procs: list[ProcSnapshot], n: int) -> bool:
    """An exit marker below proc_num: a hole a compaction has yet to fill."""
    return any(p.slot < n and (p.pid == 0 or p.status == 0) for p in procs)


def _count(owned: bytes) -> int:
    """The seqlock count at the end of `_owned` bytes."""
    return int.from_bytes(owned[-8:], "little")


def _owned(layout: Layout, raw: bytes) -> bytes:
    """The part of a slot only its process writes: `used[]` and the seqlock."""
    seq = layout.slot_seqlock
    tail = b"" if seq is None else raw[seq : seq + 8]
    return raw[layout.slot_used : layout.slot_monitorused] + tail


def _merged(written: ProcSnapshot, copy: ProcSnapshot) -> ProcSnapshot:
    """Memory from the slot the process writes; `monitorused` and `sm_util` from its copy below
    proc_num, which is where HAMi's watcher (matching by host pid) keeps writing them."""
    watched = {u.index: u for u in copy.devices}
    devices = [
        msgspec.structs.replace(
            u,
            monitor=watched[u.index].monitor if u.index in watched else 0,
            sm_util=watched[u.index].sm_util if u.index in watched else 0,
        )
        for u in written.devices
    ]
    return msgspec.structs.replace(written, devices=devices)


def _pread(fd: int, offset: int, length: int) -> bytes:
    try:
        return os.pread(fd, length, offset)
    except OSError:
        return b""


def _seq(fd: int, layout: Layout, k: int) -> int:
    """A slot's seqlock count (how often its writer updated it); 0 without a seqlock."""
    if layout.slot_seqlock is None:
        return 0
    raw = _pread(fd, layout.slot_offset(k) + layout.slot_seqlock, 8)
    return int.from_bytes(raw, "little") if len(raw) == 8 else 0


def _stable_odd(fd: int, layout: Layout, k: int) -> tuple[int, bytes] | None:
    """(seqlock, slot bytes) when the seqlock is odd and neither it nor the bytes change across
    two reads; None otherwise."""
    assert layout.slot_seqlock is not None
    off = layout.slot_offset(k)
    at = off + layout.slot_seqlock
    s0 = _pread(fd, at, 8)
    raw = _pread(fd, off, layout.slot_size)
    s1 = _pread(fd, at, 8)
    again = _pread(fd, off, layout.slot_size)
    if len(s0) != 8 or s0 != s1 or not s0[0] & 1 or len(raw) < layout.slot_size or raw != again:
        return None
    return int.from_bytes(s0, "little"), raw
