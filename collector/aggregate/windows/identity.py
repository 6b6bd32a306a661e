"""Who a pod UID is (namespace, pod, workload, labels) on the event-time timeline.

Identities come from `PodIdentity` events and from the `pods` every heartbeat restates. They are
kept per (node, pod UID) as a timeline ordered by (ts, seq), and a record of the window
`[ws, we)` takes, among the entries read before the input let that window close, the one with
the largest (ts, seq) and `ts < we`: the identity that held at the window's end. A pod with no
such entry (the watch may name a pod a little after its first samples) takes its first entry
with `we <= ts < we + lateness`. So a change after the window's end never renames it, and one
read later (in time, or in the input after an event that let the window close) applies from the
next windows on. Each entry keeps the end of the windows the input read before it lets close
(`Aggregator._closable`, whether `advance()` has closed them yet or not), so this is decided by
the input and its order alone, never by when a window happens to close, and a replay gives the
same names as the live run. A record without an identity is still billed: its namespace is
empty, and it is counted in `stats.unnamed_records`.

Only what a future window can still use is kept: per pod, the entry the next window to close
takes, and every later one (a later window takes that one or a later one). Restatements are
entries of their own (with their own offsets), so what a restart has to read again stays one
heartbeat period long; a pod not restated for `retain_ms` (its containers are gone) is
forgotten. A restarted instance reads those entries again before the input lets any window
after its `emitted_until_ms` close, so it names those windows as the live run did. A window
that starts `retain_ms` or more after the entry it would take is not named by it, so the names
never depend on how many windows one `advance()` closes, nor on where a close stops.
"""

from __future__ import annotations

from bisect import bisect_left, insort

from ...events import Identity
from .checkpoint import earliest
from .settings import NEVER

__all__ = ["Identities"]

# (ts, seq, source, offset, identity, bound); ordered by (ts, seq). `bound`: the end of the
# windows the input read before the entry lets close; it names none of those.
_Entry = tuple[int, int, int, int, Identity, int]


class Identities:
    __slots__ = ("_book", "_lateness", "_retain", "_w")

    def __init__(self, window_ms: int, lateness_ms: int, retain_ms: int) -> None:
        self._w = window_ms
        self._lateness = lateness_ms
        self._retain = retain_ms
        self._book: dict[tuple[str, str], list[_Entry]] = {}

    def learn(
        self,
        node: str,
        identity: Identity,
        ts: int,
        seq: int,
        source: int,
        offset: int,
        bound: int | None,
    ) -> None:
        """An entry; `bound`: the end of the windows the input read so far lets close (None:
        none), which it does not name."""
        entries = self._book.setdefault((node, identity.pod_uid), [])
        b = -NEVER if bound is None else bound
        insort(entries, (ts, seq, source, offset, identity, b), key=lambda e: (e[0], e[1]))

    def at(self, node: str, pod_uid: str, window_end_ms: int) -> Identity | None:
        """The identity of the pod for the window that ends at `window_end_ms`: None when the
        entry was not restated for `retain_ms` before the window's start (as `prune` forgets
        it, whenever that runs)."""
        entries = self._book.get((node, pod_uid))
        if not entries:
            return None
        i = _held(entries, window_end_ms)
        # (one not restated for `retain_ms` is as if pruned, whether `prune` ran yet or not)
        if i is None or entries[i][0] + self._retain <= window_end_ms - self._w:
            return _first_late(entries, window_end_ms, self._lateness)
        return entries[i][4]

    def prune(self, closed: int) -> None:
        """Forget what no window ending after `closed` can use: every entry before the one the
        next window takes (those after it take it or a later one)."""
        drop: list[tuple[str, str]] = []
        for key, entries in self._book.items():
            if entries[-1][0] + self._retain <= closed:
                drop.append(key)
                continue
            i = _held(entries, closed + self._w)
            if i:
                del entries[:i]
        for key in drop:
            del self._book[key]

    def needed_offsets(self) -> dict[int, int]:
        """Per source, the earliest offset of an entry still kept."""
        return earliest((e[2], e[3]) for entries in self._book.values() for e in entries)

    def __len__(self) -> int:
        return sum(len(e) for e in self._book.values())


def _held(entries: list[_Entry], window_end_ms: int) -> int | None:
    """The index of the entry that held at the end of the window ending at `window_end_ms`:
    the last before that end among those read before the input let the window close; None
    when there is none."""
    i = bisect_left(entries, window_end_ms, key=lambda e: e[0])
    while i and entries[i - 1][5] >= window_end_ms:
        i -= 1  # read after the input let this window close: not this window's
    return i - 1 if i else None


def _first_late(entries: list[_Entry], window_end_ms: int, lateness_ms: int) -> Identity | None:
    """A pod with no identity before the window's end: its first one within the lateness
    after it, among those read before the input let the window close (the watch may name a
    pod a little after its first samples)."""
    i = bisect_left(entries, window_end_ms, key=lambda e: e[0])
    for e in entries[i:]:
        if e[0] >= window_end_ms + lateness_ms:
            break
        if e[5] < window_end_ms:
            return e[4]
    return None
