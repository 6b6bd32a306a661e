"""The GPUs' model names and memory, from the nodes' NVML inventories (`DeviceInventory`).

An inventory is a statement at its ts, held like a sample: a window [ws, we) uses the latest
statement of the GPU with `ws - max_gap_ms <= ts < we`. The collector restates its inventory
with every heartbeat, so a replay that starts `max_gap_ms` before its first window sees the
statements the live run used, and gives the same records."""

from __future__ import annotations

from bisect import insort

from ...events import DeviceInventory

__all__ = ["GpuModel", "Inventory"]

GpuModel = tuple[str, int]  # (model name, memory total in bytes)


class Inventory:
    """Per (node, uuid): the statements not yet too old to be used, sorted by ts."""

    __slots__ = ("_gap", "_gpus")

    def __init__(self, max_gap_ms: int) -> None:
        self._gap = max_gap_ms
        self._gpus: dict[tuple[str, str], list[tuple[int, str, int]]] = {}

    def state(self, node: str, event: DeviceInventory) -> None:
        ts = event.ts
        for g in event.devices:
            insort(self._gpus.setdefault((node, g.uuid), []), (ts, g.name, g.memory_total))

    def lookup(self, node: str, uuid: str, ws: int, we: int) -> GpuModel | None:
        best: GpuModel | None = None
        for ts, name, memory in self._gpus.get((node, uuid), ()):
            if ts >= we:
                break
            if ts >= ws - self._gap:
                best = (name, memory)
        return best

    def prune(self, closed: int) -> None:
        """Forget statements no window from `closed` on can use."""
        horizon = closed - self._gap
        drop = []
        for key, lst in self._gpus.items():
            keep = [s for s in lst if s[0] >= horizon]
            if keep:
                self._gpus[key] = keep
            else:
                drop.append(key)
        for key in drop:
            del self._gpus[key]
