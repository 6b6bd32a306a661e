"""Who a pod UID is (namespace, pod, workload, labels) on the event-time timeline.

Identities come from `PodIdentity` events and from the `pods` every heartbeat restates. They are
kept per (node, pod UID) as a timeline ordered by (ts, seq), and a record of the window
`[ws, we)` takes the entry with the largest (ts, seq) among those with `ts < we + lateness` that
were read before the input let that window close: an identity that arrives within the lateness
of a window applies to that window, and one that arrives later (in time, or in the input after
an event that let the window close) applies from the next windows on. Each entry keeps the end
of the windows the input read before it lets close (`Aggregator._closable`, whether `advance()`
has closed them yet or not), so this is decided by the input and its order alone, never by when
a window happens to close, and a replay gives the same names as the live run. A record without
an identity is still billed: its namespace is empty, and it is counted in
`stats.unnamed_records`.

Only what a future window can still use is kept: per pod, the last entry before the cut-off of
the next window to close, and every later one (each of them was read before the input let a
window still open close, so every one can name those). Restatements are entries of their own
(with their own offsets), so what a restart has to read again stays one heartbeat period long; a
pod not restated for `retain_ms` (its containers are gone) is forgotten. A restarted instance
reads those entries again before the input lets any window after its `emitted_until_ms` close,
so it names those windows as the live run did. A window that starts `retain_ms` or more after
the entry it would take is not named by it, so the names never depend on how many windows one
`advance()` closes.
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
        cut = window_end_ms + self._lateness
        i = bisect_left(entries, cut, key=lambda e: e[0])
        # read after the input let this window close: not this window's
        while i and entries[i - 1][5] >= window_end_ms:
            i -= 1
        if not i or entries[i - 1][0] + self._retain <= window_end_ms - self._w:
            return None
        return entries[i - 1][4]

    def prune(self, closed: int) -> None:
        """Forget what no window ending after `closed` can use."""
        cut = closed + self._w + self._lateness  # the earliest cut-off of a window still open
        drop: list[tuple[str, str]] = []
        for key, entries in self._book.items():
            if entries[-1][0] + self._retain <= closed:
                drop.append(key)
                continue
            i = bisect_left(entries, cut, key=lambda e: e[0])
            if i > 1:
                del entries[: i - 1]
        for key in drop:
            del self._book[key]

    def needed_offsets(self) -> dict[int, int]:
        """Per source, the earliest offset of an entry still kept."""
        return earliest((e[2], e[3]) for entries in self._book.values() for e in entries)

    def __len__(self) -> int:
        return sum(len(e) for e in self._book.values())
