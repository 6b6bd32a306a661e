"""The GPUs' model names and memory, from the nodes' NVML inventories (`DeviceInventory`).

An inventory is a statement at its ts, held like a sample: a window [ws, we) uses the latest
statement of the GPU with `ws - max_gap_ms <= ts < we` and an effective time before `we` (a
late statement takes effect from the end closed when it came, as a late sample does: a window
closed before it or after it is billed the same). The collector restates its inventory
with every heartbeat, so a replay that starts `max_gap_ms` before its first window sees the
statements the live run used, and gives the same records. A GPU stated with a memory total
outside [0, MAX_BYTES] is left out of that statement (counted in `refused_values` by the caller),
so a window without another statement of it has no inventory for it.

Only what a window still open can use is kept: per GPU, the latest statement before the closed
end (if it is not older than `max_gap_ms`), and every later one. A restart reads those again
(`needed_offsets`), so what it re-reads for the inventory is one heartbeat period long."""

from __future__ import annotations

from bisect import insort

from ...events import MAX_BYTES, DeviceInventory
from .checkpoint import earliest

__all__ = ["GpuModel", "Inventory"]

GpuModel = tuple[str, int]  # (model name, memory total in bytes)

# (ts, model name, memory total, source, offset, effective time), in the order of `_stated`
_Statement = tuple[int, str, int, int, int, int]


def _stated(s: _Statement) -> tuple[int, int, int]:
    """By ts, then in the order the statements were made: of two in one millisecond the later
    is the latest (sorted as whole tuples, the larger model name or memory won)."""
    return (s[0], s[3], s[4])


class Inventory:
    """Per (node, uuid): the statements not yet too old to be used, sorted by ts."""

    __slots__ = ("_gap", "_gpus")

    def __init__(self, max_gap_ms: int) -> None:
        self._gap = max_gap_ms
        self._gpus: dict[tuple[str, str], list[_Statement]] = {}

    def state(self, node: str, event: DeviceInventory, source: int, offset: int, eff: int) -> int:
        """Keep the event's statements, in effect from `eff` (its ts, or for a late event the
        end closed when it came); returns how many GPUs it stated with a memory total no
        device has (outside [0, MAX_BYTES]): those are left out, as if not stated."""
        ts = event.ts
        refused = 0
        for g in event.devices:
            if not 0 <= g.memory_total <= MAX_BYTES:
                refused += 1
                continue
            insort(
                self._gpus.setdefault((node, g.uuid), []),
                (ts, g.name, g.memory_total, source, offset, eff),
                key=_stated,
            )
        return refused

    def lookup(self, node: str, uuid: str, ws: int, we: int) -> GpuModel | None:
        best: GpuModel | None = None
        for ts, name, memory, _, _, eff in self._gpus.get((node, uuid), ()):
            if ts >= we:
                break
            if ts >= ws - self._gap and eff < we:
                best = (name, memory)
        return best

    def prune(self, closed: int) -> None:
        """Forget statements no window from `closed` on can use: those older than `max_gap_ms`
        before it, and those a later statement in effect before it replaces in every such
        window (a late one made before it but in effect after it replaces nothing there)."""
        drop = []
        for key, lst in self._gpus.items():
            horizon = closed - self._gap
            for s in reversed(lst):
                if s[5] < closed:
                    if s[0] > horizon:
                        horizon = s[0]  # the latest in effect before `closed` (all its ts) stays
                    break
            keep = [s for s in lst if s[0] >= horizon]
            if keep:
                self._gpus[key] = keep
            else:
                drop.append(key)
        for key in drop:
            del self._gpus[key]

    def needed_offsets(self) -> dict[int, int]:
        """Per source, the earliest offset of a statement still kept."""
        return earliest((s[3], s[4]) for lst in self._gpus.values() for s in lst)
