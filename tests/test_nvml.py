"""NVML inventory and cross-check against real cache files.

Cache files are written by `CacheWriter` (HAMi-core's protocol), read by `read_snapshot` and
diffed into `FileState`s exactly as the scanner does; NVML is `FakeNvml` at the project's own
boundary (`NvmlApi`), scripted between intervals. `PynvmlApi` is checked against a stand-in for
the `pynvml` module, and `open_nvml` against the real bindings on a machine without a driver.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest
from fake_nvml import FakeGpu, FakeMig, FakeNvml, nvml_error

from collector.events import (
    SCHEMA_VERSION,
    DeviceInventory,
    DeviceUsageRow,
    Event,
    GpuInfo,
    LayoutAnomaly,
    NodeDeviceSample,
    decode,
    encode,
)
from collector.layout.declarations import V0A, V12, Layout
from collector.layout.reader import read_snapshot
from collector.node.crosscheck import CrossCheck, DriftTolerance
from collector.node.diff import FileState, diff
from collector.node.nvml import (
    NvmlDevice,
    NvmlMigDevice,
    NvmlProcess,
    NvmlSource,
    PynvmlApi,
    merge_processes,
    open_nvml,
)
from collector.simulate import CacheWriter, GiB, MiB, SimDevice, new_cache_file

INC = 5
T0 = 1_700_000_000_000
POD = "6f1c2a3b-4d5e-4f60-8a7b-9c0d1e2f3a4b"
GPU0 = "GPU-11111111-2222-4333-8444-555555555555"
GPU1 = "GPU-66666666-7777-4888-9999-aaaaaaaaaaaa"
GPU2 = "GPU-bbbbbbbb-cccc-4ddd-8eee-ffffffffffff"
MIG_A = "MIG-0a0a0a0a-1b1b-5c2c-9d3d-4e4e4e4e4e4e"
MIG_B = "MIG-5f5f5f5f-6a6a-5b7b-8c8c-9d9d9d9d9d9d"
H100 = "NVIDIA H100 80GB HBM3"


class Node:
    """Cache files + FileStates + a CrossCheck, advanced one interval at a time."""

    def __init__(
        self,
        root: Path,
        fake: FakeNvml,
        *,
        confirm: int = 1,
        timeout_s: float = 2.0,
        tolerance: DriftTolerance | None = None,
        inventory_every_ms: int | None = None,
    ) -> None:
        self.root = root
        self.fake = fake
        source = NvmlSource.open(api_factory=lambda: fake, timeout_s=timeout_s)
        assert source is not None
        self.source = source
        self.cc = CrossCheck(
            source, tolerance=tolerance, confirm=confirm, inventory_every_ms=inventory_every_ms
        )
        self.files: dict[str, FileState] = {}
        self.writers: list[CacheWriter] = []
        self.now = T0
        self.seq = 0

    def stamp(self, cls: type[Any], **fields: Any) -> Any:
        event = cls(v=SCHEMA_VERSION, inc=INC, seq=self.seq, ts=self.now, **fields)
        self.seq += 1
        return event

    def container(
        self, name: str, devices: list[str], layout: Layout = V12
    ) -> tuple[CacheWriter, FileState]:
        w = new_cache_file(self.root, POD, name, layout, [SimDevice(u, 40 * GiB) for u in devices])
        self.writers.append(w)
        st = FileState(len(self.files), POD, name, str(w.path))
        self.files[str(w.path)] = st
        return w, st

    def step(self) -> list[Event]:
        """One interval: diff every file (those events are not under test), then cross-check."""
        self.now += 1000
        for path, st in self.files.items():
            diff(st, read_snapshot(path), self.stamp)
        events = self.cc.check(self.now, self.files.values(), self.stamp)
        for e in events:
            assert e.ts == self.now and e.inc == INC
            assert decode(encode(e)) == e  # every event fits the schema
        return events

    def close(self) -> None:
        self.cc.close()
        for w in self.writers:
            w.close()


@pytest.fixture
def fake() -> FakeNvml:
    return FakeNvml([FakeGpu(GPU0), FakeGpu(GPU1)])


@pytest.fixture
def node(tmp_path: Path, fake: FakeNvml) -> Iterator[Node]:
    n = Node(tmp_path, fake)
    yield n
    n.close()


def anomalies(events: list[Event], kind: str | None = None) -> list[LayoutAnomaly]:
    return [
        e for e in events if isinstance(e, LayoutAnomaly) and (kind is None or e.anomaly == kind)
    ]


def samples(events: list[Event]) -> list[list[DeviceUsageRow]]:
    return [e.rows for e in events if isinstance(e, NodeDeviceSample)]


def inventories(events: list[Event]) -> list[list[GpuInfo]]:
    return [e.devices for e in events if isinstance(e, DeviceInventory)]


def drift(
    st: FileState,
    device: int,
    detail: str,
    value: int,
) -> tuple[int, str, str, int | None, int | None, str]:
    return (st.cid, st.path, "accounting_drift", device, value, detail)


def brief(a: LayoutAnomaly) -> tuple[int, str, str, int | None, int | None, str]:
    return (a.cid, a.path, a.anomaly, a.device, a.value, a.detail)


def one_process(
    node: Node, *, context: int, data: int, hostpid: int = 4242, devices: list[str] | None = None
) -> tuple[CacheWriter, FileState]:
    w, st = node.container("main", devices or [GPU0, GPU1])
    w.add_process(10, hostpid)
    w.add_memory(10, 0, "context", context)
    w.add_memory(10, 0, "data", data)
    return w, st


# --- inventory and node samples -----------------------------------------------------------


def test_inventory_at_start_then_only_on_change(node: Node, fake: FakeNvml) -> None:
    first = node.step()
    assert inventories(first) == [
        [GpuInfo(0, GPU0, H100, 80 * GiB, False), GpuInfo(1, GPU1, H100, 80 * GiB, False)]
    ]
    assert isinstance(first[0], DeviceInventory) and first[0].seq == 0
    fake.gpus[0].memory_used = 3 * GiB  # usage is not inventory
    fake.gpus[0].utilization = 40
    second = node.step()
    assert inventories(second) == []
    assert samples(second) == [
        [DeviceUsageRow(GPU0, 3 * GiB, 40, 0), DeviceUsageRow(GPU1, 0, 0, 0)]
    ]
    assert inventories(node.step()) == []

    fake.gpus.append(FakeGpu(GPU2, 40 * GiB, name="NVIDIA A100-SXM4-40GB"))
    assert inventories(node.step()) == [
        [
            GpuInfo(0, GPU0, H100, 80 * GiB, False),
            GpuInfo(1, GPU1, H100, 80 * GiB, False),
            GpuInfo(2, GPU2, "NVIDIA A100-SXM4-40GB", 40 * GiB, False),
        ]
    ]
    assert inventories(node.step()) == []
    assert node.fake.calls.count("init") == 1


def test_inventory_restated_when_asked(tmp_path: Path, fake: FakeNvml) -> None:
    n = Node(tmp_path, fake, inventory_every_ms=3000)
    try:
        got = [len(inventories(n.step())) for _ in range(7)]
    finally:
        n.close()
    assert got == [1, 0, 0, 1, 0, 0, 1]


def test_mig_inventory_samples_and_drift_on_mig_uuids(tmp_path: Path) -> None:
    mig_name = "NVIDIA H100 80GB HBM3 MIG 3g.40gb"
    fake = FakeNvml(
        [
            FakeGpu(
                GPU0,
                memory_used=7 * GiB,
                utilization=99,  # NVML does not report it in MIG mode: the fake hides it
                migs=[FakeMig(MIG_A, 40 * GiB, 5 * GiB), FakeMig(MIG_B, 40 * GiB, 2 * GiB)],
            )
        ]
    )
    n = Node(tmp_path, fake)
    try:
        w, st = n.container("main", [MIG_A])
        w.add_process(10, 5000)
        w.add_memory(10, 0, "data", 1 * GiB)
        fake.gpus[0].migs[0].processes = {5000: 3 * GiB}  # type: ignore[index]
        fake.gpus[0].migs[1].processes = {5000: 2 * GiB}  # type: ignore[index]
        events = n.step()
        assert inventories(events) == [
            [
                GpuInfo(0, GPU0, H100, 80 * GiB, True),
                GpuInfo(0, MIG_A, mig_name, 40 * GiB, False, parent_uuid=GPU0),
                GpuInfo(1, MIG_B, mig_name, 40 * GiB, False, parent_uuid=GPU0),
            ]
        ]
        assert [brief(a) for a in anomalies(events)] == [
            drift(
                st,
                0,
                f"host pid 5000 (pid 10) on {MIG_A} (device 0): NVML 3221225472 B, cache "
                "used.total 1073741824 B, monitorused 0 B; used.total under-reports by "
                "2147483648 B (tolerance 161061273 B)",
                3 * GiB,
            ),
            # the same host pid on the other instance, which its file does not hold
            (
                -1,
                "",
                "unaccounted_process",
                None,
                2 * GiB,
                f"host pid 5000 on {MIG_B} uses 2147483648 B; no cache file accounts for it",
            ),
        ]
        # rows per MIG instance, never the parent; no utilization in MIG mode
        assert samples(events) == [
            [DeviceUsageRow(MIG_A, 5 * GiB, 0, 0), DeviceUsageRow(MIG_B, 2 * GiB, 0, 2 * GiB)]
        ]
        assert f"processes {GPU0}" not in fake.calls
    finally:
        n.close()


# --- accounting drift -----------------------------------------------------------------------


def test_cache_under_reports_once_while_it_persists(node: Node, fake: FakeNvml) -> None:
    w, st = one_process(node, context=300 * MiB, data=724 * MiB)  # used.total 1 GiB
    fake.gpus[0].processes = {4242: 3 * GiB}
    events = node.step()
    assert [brief(a) for a in anomalies(events)] == [
        drift(
            st,
            0,
            f"host pid 4242 (pid 10) on {GPU0} (device 0): NVML 3221225472 B, cache used.total "
            "1073741824 B, monitorused 0 B; used.total under-reports by 2147483648 B "
            "(tolerance 161061273 B)",
            3 * GiB,
        )
    ]
    assert samples(events) == [[DeviceUsageRow(GPU0, 0, 0, 0), DeviceUsageRow(GPU1, 0, 0, 0)]]
    fake.gpus[0].processes = {4242: 3 * GiB + 100 * MiB}  # still drifting (other numbers)
    assert anomalies(node.step()) == []
    assert anomalies(node.step()) == []

    w.add_memory(10, 0, "data", 2 * GiB + 100 * MiB)  # the cache catches up: cleared
    assert anomalies(node.step()) == []
    w.add_memory(10, 0, "data", -(2 * GiB))  # drifts again: reported again
    again = anomalies(node.step())
    assert [(a.anomaly, a.value) for a in again] == [("accounting_drift", 3 * GiB + 100 * MiB)]
    assert "used.total under-reports by 2147483648 B" in again[0].detail


def test_cache_over_reports_u64_underflow(node: Node, fake: FakeNvml) -> None:
    w, st = one_process(node, context=256 * MiB, data=1 * GiB)
    w.add_memory(10, 0, "data", -(1 * GiB + 512 * MiB))  # an unmatched free wraps the u64
    fake.gpus[0].processes = {4242: 256 * MiB}
    events = node.step()
    # The wrapped row is never billed nor sent (counter_wrapped), so the cache holds nothing
    # for the process and NVML's 256 MiB is what the cache misses.
    assert [brief(a) for a in anomalies(events, "accounting_drift")] == [
        drift(
            st,
            0,
            f"host pid 4242 (pid 10) on {GPU0} (device 0): NVML 268435456 B, cache used.total "
            "0 B, monitorused 0 B; used.total under-reports by 268435456 B "
            "(tolerance 67108864 B)",
            256 * MiB,
        )
    ]


def test_usage_that_never_drops_is_drift_against_an_absent_process(
    node: Node, fake: FakeNvml
) -> None:
    # The process freed everything on the GPU (NVML no longer lists it there) but its slot
    # still says 2 GiB: the cache over-reports, NVML's bytes are 0.
    _, st = one_process(node, context=512 * MiB, data=1536 * MiB)
    events = node.step()
    assert [brief(a) for a in anomalies(events)] == [
        drift(
            st,
            0,
            f"host pid 4242 (pid 10) on {GPU0} (device 0): NVML lists no such process (0 B), "
            "cache used.total 2147483648 B, monitorused 0 B; used.total over-reports by "
            "2147483648 B (tolerance 67108864 B)",
            0,
        )
    ]


def test_monitorused_checked_only_where_written(node: Node, fake: FakeNvml) -> None:
    w, st = one_process(node, context=512 * MiB, data=512 * MiB)
    fake.gpus[0].processes = {4242: 1 * GiB}
    assert anomalies(node.step()) == []  # monitorused 0: HAMi's watcher is not running here
    w.watch({4242: {0: (1 * GiB, 30)}})
    assert anomalies(node.step()) == []
    w.watch({4242: {0: (100 * MiB, 30)}})  # rewritten by the tenant
    assert [brief(a) for a in anomalies(node.step())] == [
        drift(
            st,
            0,
            f"host pid 4242 (pid 10) on {GPU0} (device 0): NVML 1073741824 B, cache used.total "
            "1073741824 B, monitorused 104857600 B; monitorused under-reports by 968884224 B "
            "(tolerance 67108864 B)",
            1 * GiB,
        )
    ]


def test_slices_of_one_gpu_are_compared_as_one(node: Node, fake: FakeNvml) -> None:
    # One GPU at two indices of the file (two slices): NVML's bytes are the process's on the
    # whole GPU, so they are compared once with the slices' sum.
    w, st = node.container("main", [GPU0, GPU0])
    w.add_process(10, 4242)
    w.add_memory(10, 0, "data", 1 * GiB)
    w.add_memory(10, 1, "data", 1 * GiB)
    fake.gpus[0].processes = {4242: 2 * GiB}
    assert anomalies(node.step()) == []
    fake.gpus[0].processes = {4242: 3 * GiB}
    assert [brief(a) for a in anomalies(node.step())] == [
        drift(
            st,
            0,
            f"host pid 4242 (pid 10) on {GPU0} (devices 0, 1): NVML 3221225472 B, cache "
            "used.total 2147483648 B, monitorused 0 B; used.total under-reports by 1073741824 B "
            "(tolerance 161061273 B)",
            3 * GiB,
        )
    ]


@pytest.mark.parametrize(
    ("nvml", "cache", "drifts"),
    [
        (1 * GiB, 1 * GiB + 64 * MiB, False),  # exactly the absolute bound
        (1 * GiB, 1 * GiB + 64 * MiB + 1, True),
        (1 * GiB, 1 * GiB - 64 * MiB, False),
        (1 * GiB, 1 * GiB - 64 * MiB - 1, True),
        (10 * GiB, 10 * GiB - 512 * MiB, False),  # 5 % of 10 GiB is 512 MiB
        (10 * GiB, 10 * GiB + 512 * MiB, False),
        (10 * GiB, 10 * GiB + 512 * MiB + 1, True),
        (0, 64 * MiB, False),
    ],
)
def test_tolerance(node: Node, fake: FakeNvml, nvml: int, cache: int, drifts: bool) -> None:
    one_process(node, context=0, data=cache)
    fake.gpus[0].processes = {4242: nvml}
    got = anomalies(node.step())
    assert [a.anomaly for a in got] == (["accounting_drift"] if drifts else [])


def test_configured_tolerance(tmp_path: Path, fake: FakeNvml) -> None:
    n = Node(tmp_path, fake, tolerance=DriftTolerance(bytes=1 * GiB, ratio=0.0))
    try:
        one_process(n, context=0, data=2 * GiB)
        fake.gpus[0].processes = {4242: 1 * GiB}
        assert anomalies(n.step()) == []
        fake.gpus[0].processes = {4242: 1 * GiB - 1}
        assert [a.detail.split("; ")[1] for a in anomalies(n.step())] == [
            "used.total over-reports by 1073741825 B (tolerance 1073741824 B)"
        ]
    finally:
        n.close()


def test_confirm_needs_consecutive_intervals(tmp_path: Path, fake: FakeNvml) -> None:
    n = Node(tmp_path, fake, confirm=2)
    try:
        w, _ = one_process(n, context=0, data=1 * GiB)
        fake.gpus[0].processes = {4242: 1 * GiB}
        assert anomalies(n.step()) == []
        fake.gpus[0].processes = {4242: 2 * GiB}  # one interval of skew: no alarm
        assert anomalies(n.step()) == []
        fake.gpus[0].processes = {4242: 1 * GiB}
        assert anomalies(n.step()) == []
        fake.gpus[0].processes = {4242: 2 * GiB}
        assert anomalies(n.step()) == []
        assert [a.value for a in anomalies(n.step())] == [2 * GiB]  # second in a row
        assert anomalies(n.step()) == []
        fake.gpus[0].processes = {7: 1 * MiB}  # a new process, unknown to any file
        assert [a.anomaly for a in anomalies(n.step())] == []  # drift cleared, 7 not yet
        assert [a.anomaly for a in anomalies(n.step())] == ["unaccounted_process"]
        del w
    finally:
        n.close()


def test_not_available_memory_makes_no_claim(node: Node, fake: FakeNvml) -> None:
    one_process(node, context=0, data=5 * GiB)
    fake.gpus[0].processes = {4242: None}
    events = node.step()
    assert anomalies(events) == []  # neither drift nor unaccounted
    assert samples(events) == [[DeviceUsageRow(GPU0, 0, 0, 0), DeviceUsageRow(GPU1, 0, 0, 0)]]
    fake.gpus[0].processes = {4242: 1 * GiB}
    assert [a.value for a in anomalies(node.step())] == [1 * GiB]
    fake.gpus[0].processes = {4242: None}  # N/A says nothing: the drift is not cleared...
    assert anomalies(node.step()) == []
    fake.gpus[0].processes = {4242: 1 * GiB}
    assert anomalies(node.step()) == []  # ...so it is not reported a second time


def test_a_gone_container_clears_its_drift(node: Node, fake: FakeNvml) -> None:
    w, st = one_process(node, context=0, data=1 * GiB)
    fake.gpus[0].processes = {4242: 3 * GiB}
    assert len(anomalies(node.step())) == 1
    w.exit(10)  # exit marker: the process is no longer live
    fake.gpus[0].processes = {}
    assert anomalies(node.step()) == []
    w.add_process(11, 4242)  # a new process reusing the host pid
    w.add_memory(11, 0, "data", 1 * GiB)
    fake.gpus[0].processes = {4242: 3 * GiB}
    assert [(a.cid, a.value) for a in anomalies(node.step())] == [(st.cid, 3 * GiB)]


def test_v0a_files_join_too(node: Node, fake: FakeNvml) -> None:
    w, st = node.container("old", [GPU1], layout=V0A)
    w.add_process(3, 777)
    w.add_memory(3, 0, "data", 1 * GiB)
    fake.gpus[1].processes = {777: 4 * GiB}
    assert [(a.cid, a.device, a.value) for a in anomalies(node.step())] == [(st.cid, 0, 4 * GiB)]


# --- unaccounted processes ------------------------------------------------------------------


def test_unaccounted_processes(node: Node, fake: FakeNvml) -> None:
    w, _ = one_process(node, context=0, data=1 * GiB, devices=[GPU0])
    w.add_process(11, 0)  # HAMi has not learnt this one's host pid yet
    fake.gpus[0].processes = {4242: 1 * GiB, 9000: 300 * MiB, 9001: None}
    fake.gpus[1].processes = {4242: 200 * MiB}  # accounted process, but not on this GPU
    events = node.step()
    assert [brief(a) for a in anomalies(events)] == [
        (-1, "", "unaccounted_process", None, 200 * MiB,
         f"host pid 4242 on {GPU1} uses 209715200 B; no cache file accounts for it"),
        (-1, "", "unaccounted_process", None, 300 * MiB,
         f"host pid 9000 on {GPU0} uses 314572800 B; no cache file accounts for it"),
        (-1, "", "unaccounted_process", None, None,
         f"host pid 9001 on {GPU0} uses N/A; no cache file accounts for it"),
    ]  # fmt: skip
    assert samples(events) == [
        [DeviceUsageRow(GPU0, 0, 0, 300 * MiB), DeviceUsageRow(GPU1, 0, 0, 200 * MiB)]
    ]
    fake.gpus[0].processes = {4242: 1 * GiB, 9000: 400 * MiB, 9001: None}
    events = node.step()
    assert anomalies(events) == []  # persisting: reported once
    assert samples(events)[0][0].unaccounted_bytes == 400 * MiB
    fake.gpus[0].processes = {4242: 1 * GiB}
    fake.gpus[1].processes = {}
    events = node.step()
    assert anomalies(events) == []
    assert samples(events) == [[DeviceUsageRow(GPU0, 0, 0, 0), DeviceUsageRow(GPU1, 0, 0, 0)]]
    fake.gpus[0].processes = {4242: 1 * GiB, 9000: 1 * MiB}  # back: reported again
    assert [a.value for a in anomalies(node.step())] == [1 * MiB]
    w.set_hostpid(11, 9000)  # now a file accounts for it
    w.add_memory(11, 0, "data", 1 * MiB)
    assert anomalies(node.step()) == []
    fake.gpus[0].processes = {4242: 1 * GiB}
    assert anomalies(node.step()) == []


def test_a_slot_without_host_pid_is_not_billed_again_on_the_node_row(
    node: Node, fake: FakeNvml
) -> None:
    # HAMi never learnt the host pid of pid 10: NVML's listing of it (9000) cannot be joined
    # and stays an unaccounted_process, but its container is billed for the slot's used.total,
    # so the node rows take that off (down to 0), per device.
    w, _ = node.container("main", [GPU0, GPU1])
    w.add_process(10, 0)
    w.add_memory(10, 0, "data", 1 * GiB)
    w.add_memory(10, 1, "data", 512 * MiB)
    fake.gpus[0].processes = {9000: 1 * GiB, 9001: 300 * MiB}
    fake.gpus[1].processes = {9000: 256 * MiB}
    events = node.step()
    assert [brief(a) for a in anomalies(events)] == [
        (-1, "", "unaccounted_process", None, 1 * GiB,
         f"host pid 9000 on {GPU0} uses 1073741824 B; no cache file accounts for it"),
        (-1, "", "unaccounted_process", None, 256 * MiB,
         f"host pid 9000 on {GPU1} uses 268435456 B; no cache file accounts for it"),
        (-1, "", "unaccounted_process", None, 300 * MiB,
         f"host pid 9001 on {GPU0} uses 314572800 B; no cache file accounts for it"),
    ]  # fmt: skip
    assert samples(events) == [
        [DeviceUsageRow(GPU0, 0, 0, 300 * MiB), DeviceUsageRow(GPU1, 0, 0, 0)]
    ]
    w.exit(10)  # gone: nothing is taken off any more
    assert samples(node.step()) == [
        [DeviceUsageRow(GPU0, 0, 0, 1 * GiB + 300 * MiB), DeviceUsageRow(GPU1, 0, 0, 256 * MiB)]
    ]


# --- NVML failing ---------------------------------------------------------------------------


def test_nvml_errors_mid_run_and_recovery(node: Node, fake: FakeNvml) -> None:
    _, st = one_process(node, context=0, data=1 * GiB, devices=[GPU0, GPU1])
    fake.gpus[0].processes = {4242: 3 * GiB}
    fake.gpus[1].processes = {77: 1 * GiB}
    first = node.step()
    assert [a.anomaly for a in anomalies(first)] == ["accounting_drift", "unaccounted_process"]
    inventory = inventories(first)[0]

    fake.fail["device 1"] = nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)  # fell off the bus
    events = node.step()
    assert [brief(a) for a in anomalies(events)] == [
        (-1, "", "nvml_error", 1, None, "device 1: GPU is lost")
    ]
    assert inventories(events) == []  # the lost GPU stays in the inventory as last seen
    assert samples(events) == [[DeviceUsageRow(GPU0, 0, 0, 0)]]
    assert anomalies(node.step()) == []  # once while it persists

    fake.fail["device_count"] = nvml_error(pynvml.NVML_ERROR_UNKNOWN)
    events = node.step()
    assert [brief(a) for a in anomalies(events)] == [
        (-1, "", "nvml_error", None, None, "device_count: Unknown Error")
    ]
    assert samples(events) == []
    del fake.fail["device_count"]
    assert anomalies(node.step()) == []  # device 1 still failing: not reported again

    del fake.fail["device 1"]
    fake.fail[f"processes {GPU0}"] = nvml_error(pynvml.NVML_ERROR_NO_PERMISSION)
    events = node.step()
    assert [brief(a) for a in anomalies(events)] == [
        (-1, "", "nvml_error", None, None, f"processes {GPU0}: Insufficient Permissions")
    ]  # and GPU1's unaccounted process, whose state was kept, is not reported again
    assert inventories(events) == []
    assert samples(events) == [[DeviceUsageRow(GPU1, 0, 0, 1 * GiB)]]
    del fake.fail[f"processes {GPU0}"]
    events = node.step()
    assert anomalies(events) == []  # GPU0's drift persisted through the unknown interval
    assert len(samples(events)[0]) == 2

    fake.fail["device 1"] = nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)  # again: reported again
    assert [a.detail for a in anomalies(node.step())] == ["device 1: GPU is lost"]
    assert inventories(node.step()) == []
    assert inventory == inventories(first)[0]
    assert node.source.stats.nvml_errors == 7  # intervals with a failed call
    del st


def test_values_out_of_range_are_nvml_errors_and_not_available(tmp_path: Path) -> None:
    fake = FakeNvml(
        [
            FakeGpu(GPU0, memory_used=3 * GiB, utilization=250, memory_utilization=101),
            FakeGpu(GPU1, memory_used=80 * GiB + 1),  # more than its total
            FakeGpu(GPU2, migs=[FakeMig(MIG_A, 1 << 48)]),  # more than any GPU has
        ]
    )
    # a wrapped count (a negative number as u64), one byte above the total, and a sane one
    fake.gpus[0].processes = {9000: (1 << 64) - 2 * MiB, 9001: 80 * GiB + 1, 9002: 1 * GiB}
    n = Node(tmp_path, fake)
    try:
        events = n.step()
        assert [brief(a) for a in anomalies(events)] == [
            (-1, "", "nvml_error", 0, None,
             "device 0 memory utilization: 101 % is out of range 0-100 %; taken as not available"),
            (-1, "", "nvml_error", 0, None,
             "device 0 utilization: 250 % is out of range 0-100 %; taken as not available"),
            (-1, "", "nvml_error", 1, None,
             f"device 1: {GPU1} memory used 85899345921 B is out of range 0-85899345920 B "
             "(the total)"),
            (-1, "", "nvml_error", 2, None,
             f"device 2: {MIG_A} memory total 281474976710656 B is out of range "
             "0-281474976710655 B"),
            (-1, "", "nvml_error", None, None,
             f"memory of processes {GPU0}: host pid 9000 uses 18446744073707454464 B, host pid "
             "9001 uses 85899345921 B: out of range 0-85899345920 B (the total); taken as not "
             "available"),
            (-1, "", "unaccounted_process", None, None,
             f"host pid 9000 on {GPU0} uses N/A; no cache file accounts for it"),
            (-1, "", "unaccounted_process", None, None,
             f"host pid 9001 on {GPU0} uses N/A; no cache file accounts for it"),
            (-1, "", "unaccounted_process", None, 1 * GiB,
             f"host pid 9002 on {GPU0} uses 1073741824 B; no cache file accounts for it"),
        ]  # fmt: skip
        # GPUs 1 and 2 are as if their query failed: no inventory, no row
        assert inventories(events) == [[GpuInfo(0, GPU0, H100, 80 * GiB, False)]]
        assert samples(events) == [[DeviceUsageRow(GPU0, 3 * GiB, 0, 1 * GiB)]]
        dev = n.cc.devices[0]
        assert (dev.utilization_gpu, dev.utilization_memory) == (None, None)  # no /metrics gauge
        assert n.source.stats.nvml_errors == 1
        assert anomalies(n.step()) == []  # once while it persists

        fake.gpus[0].utilization, fake.gpus[0].memory_utilization = 100, 0  # the bounds
        fake.gpus[0].processes = {9001: 80 * GiB}
        fake.gpus[1].memory_used = 80 * GiB
        fake.gpus[2].migs = [FakeMig(MIG_A, (1 << 48) - 1)]
        events = n.step()
        assert anomalies(events) == []
        assert samples(events) == [
            [
                DeviceUsageRow(GPU0, 3 * GiB, 100, 80 * GiB),
                DeviceUsageRow(GPU1, 80 * GiB, 0, 0),
                DeviceUsageRow(MIG_A, 0, 0, 0),
            ]
        ]
        assert n.cc.devices[0].utilization_memory == 0
        fake.gpus[0].utilization = -1  # back out of range: reported again
        assert [a.detail for a in anomalies(n.step())] == [
            "device 0 utilization: -1 % is out of range 0-100 %; taken as not available"
        ]
    finally:
        n.close()


def test_an_unexpected_exception_is_an_nvml_error_and_logged(
    node: Node, fake: FakeNvml, caplog: pytest.LogCaptureFixture
) -> None:
    fake.fail["device 0"] = ValueError("bad value")
    with caplog.at_level(logging.ERROR):
        events = node.step()
        assert anomalies(node.step()) == []
    assert [a.detail for a in anomalies(events)] == ["device 0: ValueError: bad value"]
    assert [r.getMessage() for r in caplog.records] == [
        "unexpected error from an NVML call (device 0)"  # once while it persists
    ]


def test_a_hanging_call_is_bounded_by_the_timeout(tmp_path: Path, fake: FakeNvml) -> None:
    # 2 s: the steps that must finish in time do on a loaded machine (0.5 s once risked a
    # stall of the calls that do not hang).
    n = Node(tmp_path, fake, timeout_s=2.0)
    gate = threading.Event()
    try:
        assert len(samples(n.step())) == 1
        fake.hang[f"processes {GPU1}"] = gate
        started = time.monotonic()
        events = n.step()
        # Back after the 2 s timeout, never after the call (it hangs until the gate opens):
        # 10 times the timeout leaves room for a loaded machine and still tells them apart.
        assert 2.0 <= time.monotonic() - started < 20.0
        assert [brief(a) for a in anomalies(events)] == [
            (-1, "", "nvml_timeout", None, None,
             "NVML calls did not finish within 2 s; interval skipped"),
        ]  # fmt: skip
        assert samples(events) == []
        started = time.monotonic()
        assert n.step() == []  # still stuck: skipped at once, not queued, not reported again
        assert time.monotonic() - started < 1.0
        assert n.source.stats.nvml_timeouts == 2

        gate.set()  # the stuck call returns; its stale reading is dropped
        del fake.hang[f"processes {GPU1}"]
        deadline = time.monotonic() + 5
        while n.source.busy:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        events = n.step()
        assert anomalies(events) == [] and len(samples(events)) == 1

        gate2 = threading.Event()
        fake.hang["device_count"] = gate2
        assert [a.anomaly for a in anomalies(n.step())] == ["nvml_timeout"]  # again
        gate2.set()
    finally:
        gate.set()
        n.close()


# --- opening NVML ---------------------------------------------------------------------------


def _nvml_loads() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def test_open_nvml_without_a_driver_logs_one_line(caplog: pytest.LogCaptureFixture) -> None:
    if _nvml_loads():
        pytest.skip("this machine has a working NVML")
    with caplog.at_level(logging.DEBUG):
        assert open_nvml() is None
        assert NvmlSource.open() is None
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (
            logging.WARNING,
            "NVML unavailable: NVML Shared Library Not Found; "
            "device inventory and cross-check are off",
        )
    ] * 2


@pytest.mark.parametrize(
    ("fake", "reason"),
    [
        (FakeNvml(fail={"init": nvml_error(pynvml.NVML_ERROR_NO_PERMISSION)}),
         "Insufficient Permissions"),
        (FakeNvml(fail={"init": nvml_error(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)}),
         "Driver Not Loaded"),
        (FakeNvml([]), "no GPU found"),
    ],
)  # fmt: skip
def test_open_nvml_unavailable(
    fake: FakeNvml, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG):
        assert NvmlSource.open(api_factory=lambda: fake) is None
    assert [r.getMessage() for r in caplog.records] == [
        f"NVML unavailable: {reason}; device inventory and cross-check are off"
    ]
    assert not fake.initialised


def test_open_nvml_without_bindings(caplog: pytest.LogCaptureFixture) -> None:
    def missing() -> FakeNvml:
        raise ImportError("No module named 'pynvml'")

    with caplog.at_level(logging.DEBUG):
        assert open_nvml(missing) is None
    assert [r.getMessage() for r in caplog.records] == [
        "NVML unavailable: the NVML bindings (nvidia-ml-py) cannot be imported "
        "(No module named 'pynvml'); device inventory and cross-check are off"
    ]


def test_close_shuts_nvml_down(tmp_path: Path, fake: FakeNvml) -> None:
    n = Node(tmp_path, fake)
    n.step()
    n.close()
    assert fake.calls[-1] == "shutdown" and not fake.initialised


# --- the pynvml implementation, on a stand-in for the bindings --------------------------------


class _Mem(SimpleNamespace):
    pass


def _fake_pynvml() -> SimpleNamespace:
    """Enough of the pynvml module for PynvmlApi: one plain GPU, one in MIG mode with an empty
    MIG slot, a driver without the _v3 process entry points, and N/A per-process memory."""
    na = pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
    handles = {0: "h0", 1: "h1"}
    uuids: dict[str, str | bytes] = {"h0": GPU0.encode(), "h1": GPU1, "m0": MIG_A, "m2": MIG_B}
    names = {"h0": H100, "h1": H100, "m0": "MIG 3g.40gb", "m2": "MIG 3g.40gb"}
    mem = {"h0": (80, 3), "h1": (80, 9), "m0": (40, 5), "m2": (40, 4)}
    Table = dict[str, list[tuple[int, int | None]]]
    compute: Table = {"h0": [(10, 1 * GiB), (11, na)], "m0": [(20, 2 * GiB)], "m2": []}
    graphics: Table = {"h0": [(10, 1 * GiB), (12, 5 * MiB)], "m0": [], "m2": [(21, None)]}

    def util(h: str) -> Any:
        if h == "h1":
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return SimpleNamespace(gpu=37, memory=5)

    def mig_handle(h: str, k: int) -> str:
        if k == 1:
            raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
        return f"m{k}"

    def v3(table: dict[str, list[tuple[int, int | None]]]) -> Any:
        def fn(h: str) -> Any:
            raise pynvml.NVMLLibraryMismatchError("old driver")

        return fn

    def v2(table: dict[str, list[tuple[int, int | None]]]) -> Any:
        return lambda h: [SimpleNamespace(pid=p, usedGpuMemory=m) for p, m in table.get(h, [])]

    def graphics_v2(h: str) -> Any:
        if h == "m2":
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return v2(graphics)(h)

    return SimpleNamespace(
        NVMLError_NotSupported=pynvml.NVMLError_NotSupported,
        NVMLError_FunctionNotFound=pynvml.NVMLError_FunctionNotFound,
        NVMLError_NotFound=pynvml.NVMLError_NotFound,
        NVMLLibraryMismatchError=pynvml.NVMLLibraryMismatchError,
        NVML_DEVICE_MIG_ENABLE=pynvml.NVML_DEVICE_MIG_ENABLE,
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=handles.__getitem__,
        nvmlDeviceGetHandleByUUID=lambda u: {
            v if isinstance(v, str) else v.decode(): k for k, v in uuids.items()
        }[u],
        nvmlDeviceGetUUID=uuids.__getitem__,
        nvmlDeviceGetName=names.__getitem__,
        nvmlDeviceGetMemoryInfo=lambda h: _Mem(total=mem[h][0] * GiB, used=mem[h][1] * GiB,
                                               free=0),
        nvmlDeviceGetUtilizationRates=util,
        nvmlDeviceGetMigMode=lambda h: [1, 1] if h == "h1" else [0, 0],
        nvmlDeviceGetMaxMigDeviceCount=lambda h: 3,
        nvmlDeviceGetMigDeviceHandleByIndex=mig_handle,
        nvmlDeviceGetComputeRunningProcesses=v3(compute),
        nvmlDeviceGetComputeRunningProcesses_v2=v2(compute),
        nvmlDeviceGetGraphicsRunningProcesses=v3(graphics),
        nvmlDeviceGetGraphicsRunningProcesses_v2=graphics_v2,
    )  # fmt: skip


def test_pynvml_api_converts_everything() -> None:
    api = PynvmlApi()
    api._n = _fake_pynvml()
    assert api.device_count() == 2
    # The fake utilisation rates are gpu=37, memory=5.
    assert api.device(0) == NvmlDevice(0, GPU0, H100, 80 * GiB, 3 * GiB, 37, False, (), 5)
    assert api.device(1) == NvmlDevice(
        1,
        GPU1,
        H100,
        80 * GiB,
        9 * GiB,
        None,
        True,
        (
            NvmlMigDevice(0, MIG_A, "MIG 3g.40gb", 40 * GiB, 5 * GiB, GPU1),
            NvmlMigDevice(2, MIG_B, "MIG 3g.40gb", 40 * GiB, 4 * GiB, GPU1),
        ),
    )
    assert api.processes(GPU0) == [
        NvmlProcess(10, 1 * GiB),  # compute and graphics: one entry
        NvmlProcess(11, None),
        NvmlProcess(12, 5 * MiB),
    ]
    assert api.processes(MIG_A) == [NvmlProcess(20, 2 * GiB)]
    assert api.processes(MIG_B) == []  # graphics not supported on it: compute only
    api._handles.clear()
    assert api.processes(MIG_A) == [NvmlProcess(20, 2 * GiB)]  # looked up by uuid


def test_merge_processes() -> None:
    assert merge_processes(
        [NvmlProcess(5, None), NvmlProcess(3, 10)],
        [NvmlProcess(5, 7), NvmlProcess(3, 12), NvmlProcess(3, None), NvmlProcess(1, None)],
    ) == [NvmlProcess(1, None), NvmlProcess(3, 12), NvmlProcess(5, 7)]


def test_scanner_emits_inventory_and_drift_in_its_own_sequence(tmp_path: Path) -> None:
    """The integration the collector runs: the cross-check rides on each scan's sequence."""
    from collector.events import DeviceInventory, LayoutAnomaly, NodeDeviceSample
    from collector.node.scan import Scanner

    root = tmp_path / "containers"
    uuid = "GPU-12345678-1234-4234-8234-123456789abc"
    w = new_cache_file(root, "pod-1", "main", V12, [SimDevice(uuid, 8 * GiB)])
    try:
        w.add_process(7, 4242)
        w.add_memory(7, 0, "data", 1 * GiB)
        fake = FakeNvml(gpus=[FakeGpu(uuid, memory_used=3 * GiB, processes={4242: 3 * GiB})])
        source = NvmlSource.open(api_factory=lambda: fake)
        assert source is not None
        scanner = Scanner(root, heartbeat_s=3600, inc=1, crosscheck=CrossCheck(source))
        events = scanner.scan(now_ms=1_000) + scanner.scan(now_ms=2_000)
        assert [e.seq for e in events] == list(range(len(events)))
        inventory = [e for e in events if isinstance(e, DeviceInventory)]
        assert [[d.uuid for d in e.devices] for e in inventory] == [[uuid]]
        drift = [
            e for e in events if isinstance(e, LayoutAnomaly) and e.anomaly == "accounting_drift"
        ]
        assert [(e.cid, e.ts, e.value) for e in drift] == [(0, 2_000, 3 * GiB)]
        samples = [e for e in events if isinstance(e, NodeDeviceSample)]
        assert [r.memory_used for e in samples for r in e.rows] == [3 * GiB, 3 * GiB]
        scanner.crosscheck.close()  # type: ignore[union-attr]
    finally:
        w.close()


@pytest.mark.parametrize(
    ("ratio", "nvml", "edge"),
    [(0.7, 190_084_892_370, 133_059_424_659), (0.05, 8 * GiB, 429_496_729), (0.3, 10, 3)],
)
def test_a_difference_of_exactly_the_ratio_is_not_drift(ratio: float, nvml: int, edge: int) -> None:
    """`|cache - NVML| > max(bytes, ratio x NVML)`: with the ratio as written (0.7 is 7/10),
    not its float, whose product with NVML's bytes came out a byte short for 0.7."""
    tol = DriftTolerance(bytes=0, ratio=ratio)
    assert tol.allowed(nvml) == edge
    assert not tol.drifts(nvml, nvml + edge) and not tol.drifts(nvml, nvml - edge)
    assert tol.drifts(nvml, nvml + edge + 1) and tol.drifts(nvml, nvml - edge - 1)
