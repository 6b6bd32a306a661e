"""A scriptable stand-in for NVML at the project's boundary (`collector.node.nvml.NvmlApi`).

Tests change the fake between intervals: GPUs, MIG instances and per-device processes are plain
mutable fields; `fail[call]` makes a call raise (a `pynvml.NVMLError` subclass, like the real
bindings) until removed, and `hang[call]` makes it block until its Event is set. Call names:
"init", "device_count", "device 0", "processes GPU-…" (the same scopes NvmlReading uses).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import pynvml

from collector.node.nvml import NvmlDevice, NvmlMigDevice, NvmlProcess

GiB = 1 << 30
MiB = 1 << 20


def nvml_error(code: int) -> pynvml.NVMLError:
    """The subclass pynvml raises for `code`, e.g. NVML_ERROR_GPU_IS_LOST -> NVMLError_GpuIsLost."""
    return pynvml.NVMLError(code)


@dataclass
class FakeMig:
    uuid: str
    memory_total: int
    memory_used: int = 0
    name: str = "NVIDIA H100 80GB HBM3 MIG 3g.40gb"
    processes: dict[int, int | None] = field(default_factory=dict)  # host pid -> bytes / N/A


@dataclass
class FakeGpu:
    uuid: str
    memory_total: int = 80 * GiB
    memory_used: int = 0
    utilization: int | None = 0
    memory_utilization: int | None = None
    name: str = "NVIDIA H100 80GB HBM3"
    migs: list[FakeMig] | None = None  # None: MIG off; a list: MIG on, these instances
    processes: dict[int, int | None] = field(default_factory=dict)  # host pid -> bytes / N/A


@dataclass
class FakeNvml:
    gpus: list[FakeGpu] = field(default_factory=list)
    fail: dict[str, BaseException] = field(default_factory=dict)
    hang: dict[str, threading.Event] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)
    initialised: bool = False

    def _enter(self, call: str) -> None:
        self.calls.append(call)
        gate = self.hang.get(call)
        if gate is not None:
            gate.wait()
        exc = self.fail.get(call)
        if exc is not None:
            raise exc

    def init(self) -> None:
        self._enter("init")
        self.initialised = True

    def shutdown(self) -> None:
        self._enter("shutdown")
        self.initialised = False

    def device_count(self) -> int:
        self._enter("device_count")
        return len(self.gpus)

    def device(self, index: int) -> NvmlDevice:
        self._enter(f"device {index}")
        g = self.gpus[index]
        migs = tuple(
            NvmlMigDevice(k, m.uuid, m.name, m.memory_total, m.memory_used, g.uuid)
            for k, m in enumerate(g.migs or [])
        )
        util = None if g.migs is not None else g.utilization
        return NvmlDevice(
            index,
            g.uuid,
            g.name,
            g.memory_total,
            g.memory_used,
            util,
            g.migs is not None,
            migs,
            g.memory_utilization,
        )

    def processes(self, uuid: str) -> list[NvmlProcess]:
        self._enter(f"processes {uuid}")
        for g in self.gpus:
            if g.uuid == uuid:
                return _procs(g.processes)
            for m in g.migs or []:
                if m.uuid == uuid:
                    return _procs(m.processes)
        raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)


def _procs(table: dict[int, int | None]) -> list[NvmlProcess]:
    return [NvmlProcess(pid, mem) for pid, mem in sorted(table.items())]
