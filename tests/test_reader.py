"""The reader, end to end: files written by `CacheWriter` (HAMi-core's protocol) for every
layout, read back by `hami-usage inspect --json` in a subprocess and compared field by field
with values the test computes itself (never by calling the reader).
"""

from __future__ import annotations

import ctypes as C
import hashlib
import json
import mmap
import os
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest

from collector.layout import reader
from collector.layout.declarations import LAYOUTS, MAGIC, V11, V11_INTERIM, V12
from collector.simulate import CacheWriter, SimDevice

MiB = 1 << 20
GiB = 1 << 30
U64 = 1 << 64

# docs/hami-cache-layout.md: "new file size" column (sizeof(shared_region_t) + 1).
DOC_FILE_SIZE = {
    "v0a": 804_681,
    "v0b": 1_197_897,
    "v1.1": 2_008_953,
    "v1.1-interim": 2_008_985,
    "v1.2": 2_008_953,
}
DOC_VERSION: dict[str, tuple[int, int] | tuple[None, None]] = {
    "v0a": (None, None),
    "v0b": (None, None),
    "v1.1": (1, 1),
    "v1.1-interim": (1, 1),
    "v1.2": (1, 2),
}
SEQLOCK_LAYOUTS = {"v1.1-interim", "v1.2"}

UUID0 = "GPU-0b8a3c1e-5f2d-4a6b-9c7e-1d2f3a4b5c6d"
UUID1 = "GPU-7e6d5c4b-3a2f-4e1d-8c9b-0a1b2c3d4e5f"
UUID2 = "MIG-4f1b2c3d-aaaa-bbbb-cccc-111122223333"
DEVICES = [
    SimDevice(UUID0, limit_bytes=4 * GiB, sm_limit=50),
    SimDevice(UUID1, limit_bytes=8 * GiB, sm_limit=100),
    SimDevice(UUID2, limit_bytes=0, sm_limit=30),
]
KERNEL_TIME = 1_760_000_123


# --- running the CLI -----------------------------------------------------------------------


def inspect_json(path: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "collector", "inspect", "--json", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert proc.stdout.endswith("\n") and proc.stdout.count("\n") == 1
    doc: dict[str, Any] = json.loads(proc.stdout)
    return doc


def kinds(doc: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Anomalies as sorted (kind, slot, device, value); detail is free text but never empty."""
    out = []
    for a in doc["anomalies"]:
        assert isinstance(a["detail"], str) and a["detail"]
        assert set(a) <= {"kind", "detail", "slot", "device", "value"}
        out.append((a["kind"], a.get("slot"), a.get("device"), a.get("value")))
    return sorted(out, key=repr)


def without_anomalies(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k != "anomalies"}


# --- an independent model of what the file must hold ---------------------------------------


@dataclass
class Proc:
    pid: int
    hostpid: int
    status: int = 1
    ctx: dict[int, int] = field(default_factory=dict)
    data: dict[int, int] = field(default_factory=dict)
    monitor: dict[int, int] = field(default_factory=dict)
    sm: dict[int, int] = field(default_factory=dict)

    def row(self, d: int, has_util: bool) -> dict[str, int]:
        ctx = self.ctx.get(d, 0) % U64
        data = self.data.get(d, 0) % U64
        return {
            "index": d,
            "context": ctx,
            "module": 0,
            "data": data,
            "total": (ctx + data) % U64,
            "monitor": self.monitor.get(d, 0),
            "sm_util": self.sm.get(d, 0) if has_util else 0,
        }

    def expected(self, slot: int, ndev: int, has_util: bool) -> dict[str, Any]:
        rows = [self.row(d, has_util) for d in range(16)]
        keep = [
            r
            for r in rows
            if r["index"] < ndev
            or any(r[k] for k in ("context", "module", "data", "total", "monitor", "sm_util"))
        ]
        return {
            "slot": slot,
            "pid": self.pid,
            "hostpid": self.hostpid,
            "status": self.status,
            "devices": keep,
        }


class Scenario:
    """Drives a CacheWriter and the model with the same actions."""

    def __init__(self, path: Path, name: str, devices: list[SimDevice] = DEVICES) -> None:
        self.name = name
        self.layout = LAYOUTS[name]
        self.path = path
        self.w = CacheWriter(path, self.layout, devices, priority=3)
        self.devices = devices
        self.procs: dict[int, Proc] = {}

    def add(self, pid: int, hostpid: int = 0) -> None:
        self.w.add_process(pid, hostpid)
        self.procs[pid] = Proc(pid, hostpid)

    def set_hostpid(self, pid: int, hostpid: int) -> None:
        self.w.set_hostpid(pid, hostpid)
        self.procs[pid].hostpid = hostpid

    def mem(self, pid: int, dev: int, kind: str, n: int) -> None:
        self.w.add_memory(pid, dev, kind, n)
        book = self.procs[pid].ctx if kind == "context" else self.procs[pid].data
        book[dev] = book.get(dev, 0) + n

    def watch(self, samples: dict[int, dict[int, tuple[int, int]]], live: list[int]) -> None:
        self.w.watch(samples)
        for pid in live:
            p = self.procs[pid]
            p.monitor = {d: m for d, (m, _) in samples.get(p.hostpid, {}).items()}
            p.sm = {d: s for d, (_, s) in samples.get(p.hostpid, {}).items()}

    def expected(self, slots: list[Proc], *, proc_num: int | None = None) -> dict[str, Any]:
        lay = self.layout
        major, minor = DOC_VERSION[self.name]
        ndev = len(self.devices)
        has_util = lay.device_util is not None
        return {
            "path": str(self.path),
            "size": DOC_FILE_SIZE[self.name],
            "initialized": True,
            "layout": self.name,
            "major": major,
            "minor": minor,
            "device_num": ndev,
            "devices": [
                {
                    "index": d,
                    "uuid": dev.uuid,
                    "limit_bytes": dev.limit_bytes,
                    "sm_limit": dev.sm_limit,
                }
                for d, dev in enumerate(self.devices)
            ],
            "proc_num": len(slots) if proc_num is None else proc_num,
            "procs": [p.expected(k, ndev, has_util) for k, p in enumerate(slots)],
            "priority": 3,
            "utilization_switch": 1,
            "recent_kernel": 2,
            "last_kernel_time": None if major is None else KERNEL_TIME,
        }


def expected_anomalies(name: str) -> list[tuple[Any, ...]]:
    return [("mislabelled_layout", None, None, None)] if name == "v1.1-interim" else []


# --- the round trip, every layout ----------------------------------------------------------


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_round_trip(tmp_path: Path, name: str) -> None:
    s = Scenario(tmp_path / "c.cache", name)
    assert s.path.stat().st_size == DOC_FILE_SIZE[name] == LAYOUTS[name].region_size + 1

    s.add(101)  # hostpid not known yet
    s.add(102, 5102)
    s.add(103, 5103)
    s.add(104)
    s.set_hostpid(101, 5101)
    s.set_hostpid(104, 5104)
    s.mem(101, 0, "context", 300 * MiB)
    s.mem(101, 0, "data", 1024 * MiB)
    s.mem(101, 1, "data", 512 * MiB)
    s.mem(101, 0, "data", -256 * MiB)
    s.mem(102, 1, "context", 250 * MiB)
    s.mem(102, 1, "data", 2048 * MiB)
    s.mem(102, 2, "data", 64 * MiB)
    s.mem(102, 5, "data", 7 * MiB)  # a device beyond device_num: still reported
    s.mem(103, 0, "context", 200 * MiB)
    s.mem(103, 0, "data", 100 * MiB)
    s.mem(103, 0, "data", -100 * MiB)
    s.mem(104, 2, "data", 5 * MiB)
    s.mem(104, 2, "context", 100 * MiB)
    samples = {
        5101: {0: (1400 * MiB, 70), 1: (520 * MiB, 20)},
        5102: {1: (2400 * MiB, 99), 2: (70 * MiB, 3)},
        5103: {0: (310 * MiB, 120)},  # NVML samples can exceed 100 % momentarily
        9999: {0: (1, 1)},  # a hostpid that is not in the file
    }
    s.watch(samples, live=[101, 102, 103, 104])
    s.w.kernel_launched(KERNEL_TIME + 0.9)
    p = s.procs

    # Phase 0: four live processes in slot order.
    doc = inspect_json(s.path)
    assert without_anomalies(doc) == s.expected([p[101], p[102], p[103], p[104]])
    assert kinds(doc) == expected_anomalies(name)
    # Exact spot checks, typed in: the model could share a mistake with the reader.
    assert doc["procs"][0]["devices"][0] == {
        "index": 0,
        "context": 300 * MiB,
        "module": 0,
        "data": 768 * MiB,
        "total": 1068 * MiB,
        "monitor": 1400 * MiB,
        "sm_util": 0 if name == "v0a" else 70,
    }
    assert [d["index"] for d in doc["procs"][1]["devices"]] == [0, 1, 2, 5]
    assert doc["procs"][3]["hostpid"] == 5104
    assert doc["procs"][3]["devices"][2]["monitor"] == 0  # 5104 had no NVML sample

    # Phase 1: pid 101 exits cleanly.
    s.w.exit(101)
    if name in SEQLOCK_LAYOUTS:
        # Exit marker: pid 0, status 0, counters and hostpid left; slot stays below proc_num.
        p[101].pid = 0
        p[101].status = 0
        slots = [p[101], p[102], p[103], p[104]]
    else:
        # Older libraries compact at once: the last slot moves into the hole.
        slots = [p[104], p[102], p[103]]
    doc = inspect_json(s.path)
    assert without_anomalies(doc) == s.expected(slots)
    assert kinds(doc) == expected_anomalies(name)
    if name in SEQLOCK_LAYOUTS:
        assert doc["procs"][0]["pid"] == 0 and doc["procs"][0]["status"] == 0
        assert doc["procs"][0]["hostpid"] == 5101
        assert doc["procs"][0]["devices"][0]["total"] == 1068 * MiB

    # Phase 2: a later process compacts (103 was SIGKILLed), then one more watcher cycle.
    s.w.compact({103})
    s.watch({5104: {2: (111 * MiB, 15)}}, live=[104, 102])
    slots = [p[104], p[102]]  # 104 moved from slot 3 to slot 0
    doc = inspect_json(s.path)
    assert without_anomalies(doc) == s.expected(slots)
    assert kinds(doc) == expected_anomalies(name)
    assert [(q["slot"], q["pid"], q["hostpid"]) for q in doc["procs"]] == [
        (0, 104, 5104),
        (1, 102, 5102),
    ]
    assert doc["procs"][1]["devices"][1]["monitor"] == 0  # zeroed by the watcher
    assert doc["procs"][0]["devices"][2]["monitor"] == 111 * MiB
    assert doc["size"] == s.path.stat().st_size == DOC_FILE_SIZE[name]
    s.w.close()


# --- header states -------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_no_device_yet(tmp_path: Path, name: str) -> None:
    """device_num 0 until the first NVML call: no devices, and process rows only for
    devices with a non-zero counter. Covers the interim file with no device and a zero sem
    word at the interim size (must be interim, not v1.1)."""
    path = tmp_path / "c.cache"
    w = CacheWriter(path, LAYOUTS[name], DEVICES, register_devices=False)
    w.add_process(7, 7007)
    w.add_process(8, 7008)
    w.add_memory(8, 1, "data", 3 * MiB)
    if name == "v1.1-interim":
        assert w.region.sem_postinit.value == 0 and w.region.device_num == 0
    doc = inspect_json(path)
    assert doc["layout"] == name
    assert doc["device_num"] == 0
    assert doc["devices"] == []
    assert doc["proc_num"] == 2
    assert doc["procs"][0] == {"slot": 0, "pid": 7, "hostpid": 7007, "status": 1, "devices": []}
    assert doc["procs"][1]["devices"] == [
        {"index": 1, "context": 0, "module": 0, "data": 3 * MiB, "total": 3 * MiB, "monitor": 0,
         "sm_util": 0}
    ]  # fmt: skip
    assert kinds(doc) == expected_anomalies(name)
    w.close()


def _zero_file(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        f.truncate(size)


NOT_INITIALIZED = {
    "initialized": False,
    "layout": None,
    "major": None,
    "minor": None,
    "device_num": 0,
    "devices": [],
    "proc_num": 0,
    "procs": [],
    "priority": 0,
    "utilization_switch": 0,
    "recent_kernel": 0,
    "last_kernel_time": None,
}


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"\x4e\xf7\x2f",  # part of the magic
        MAGIC.to_bytes(4, "little") + b"\0" * 7,  # 11 bytes: too short for any header
        b"\0" * V12.file_size,  # created and extended, header not written yet
        (MAGIC + 1).to_bytes(4, "little") + b"\1\0\0\0\2\0\0\0" + b"\0" * 5000,
    ],
    ids=["empty", "3-bytes", "11-bytes", "zeros", "wrong-magic"],
)
def test_not_initialized(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "c.cache"
    path.write_bytes(content)
    doc = inspect_json(path)
    assert without_anomalies(doc) == {"path": str(path), "size": len(content), **NOT_INITIALIZED}
    assert kinds(doc) == [("not_initialized", None, None, None)]


def test_not_initialized_magic_stored_last(tmp_path: Path) -> None:
    """Everything written but the magic: still not initialised."""
    path = tmp_path / "c.cache"
    w = CacheWriter(path, V12, DEVICES)
    w.add_process(1, 11)
    w.region.initialized_flag = 0
    doc = inspect_json(path)
    assert without_anomalies(doc) == {"path": str(path), "size": V12.file_size, **NOT_INITIALIZED}
    assert kinds(doc) == [("not_initialized", None, None, None)]
    w.close()


def test_future_minor(tmp_path: Path) -> None:
    path = tmp_path / "c.cache"
    w = CacheWriter(path, V12, DEVICES)
    w.add_process(1, 11)
    w.add_memory(1, 0, "data", 9 * MiB)
    w.region.minor_version = 3
    doc = inspect_json(path)
    assert (doc["layout"], doc["major"], doc["minor"]) == ("v1.2", 1, 3)
    assert kinds(doc) == [("future_minor", None, None, None)]
    assert doc["procs"][0]["devices"][0]["total"] == 9 * MiB
    assert [d["uuid"] for d in doc["devices"]] == [UUID0, UUID1, UUID2]
    w.close()


@pytest.mark.parametrize(
    ("major", "minor", "size"),
    [(2, 0, V12.file_size), (1, 0, V12.file_size), (1, 3, V11.region_size - 1), (7, 2, 4096)],
)
def test_unknown_version(tmp_path: Path, major: int, minor: int, size: int) -> None:
    path = tmp_path / "c.cache"
    w = CacheWriter(path, V12, DEVICES)
    w.add_process(1, 11)
    w.region.major_version, w.region.minor_version = major, minor
    w.close()
    os.truncate(path, size)
    doc = inspect_json(path)
    assert without_anomalies(doc) == {
        "path": str(path),
        "size": size,
        **NOT_INITIALIZED,
        "initialized": True,
        "major": major,
        "minor": minor,
    }
    assert kinds(doc) == [("unknown_version", None, None, None)]


# --- content anomalies ---------------------------------------------------------------------


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_counter_wrapped(tmp_path: Path, name: str) -> None:
    """Unmatched frees (HAMi issue #1181): data and total go below zero as u64."""
    path = tmp_path / "c.cache"
    w = CacheWriter(path, LAYOUTS[name], DEVICES)
    w.add_process(1, 11)
    w.add_memory(1, 2, "context", 10 * MiB)
    w.add_memory(1, 2, "data", 4 * MiB)
    w.add_memory(1, 2, "data", -20 * MiB)  # device 2 has no limit: no over_limit
    doc = inspect_json(path)
    data = U64 - 16 * MiB
    total = U64 - 6 * MiB
    # The wrapped device is left out of the slot: an anomaly, never a usage row to bill.
    assert [d["index"] for d in doc["procs"][0]["devices"]] == [0, 1]
    assert kinds(doc) == sorted(
        [
            *expected_anomalies(name),
            ("counter_wrapped", 0, 2, data),
            ("counter_wrapped", 0, 2, total),
        ],
        key=repr,
    )
    w.close()


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_total_mismatch(tmp_path: Path, name: str) -> None:
    path = tmp_path / "c.cache"
    w = CacheWriter(path, LAYOUTS[name], DEVICES)
    w.add_process(1, 11)
    w.add_process(2, 12)
    w.add_memory(2, 1, "context", 100)
    w.add_memory(2, 1, "data", 50)
    w.region.procs[1].used[1].total = 151  # written directly, not by the protocol
    w.region.procs[1].used[3].module_size = 5  # module with no total, beyond device_num
    doc = inspect_json(path)
    assert doc["procs"][1]["devices"][1]["total"] == 151
    assert doc["procs"][1]["devices"][3] == {
        "index": 3, "context": 0, "module": 5, "data": 0, "total": 0, "monitor": 0, "sm_util": 0,
    }  # fmt: skip
    assert kinds(doc) == sorted(
        [*expected_anomalies(name), ("total_mismatch", 1, 1, 151), ("total_mismatch", 1, 3, 0)],
        key=repr,
    )
    w.close()


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_over_limit(tmp_path: Path, name: str) -> None:
    """HAMi enforces the limit on the sum over live processes; no limit (0) never trips."""
    path = tmp_path / "c.cache"
    w = CacheWriter(path, LAYOUTS[name], DEVICES)
    for pid in (1, 2, 3):
        w.add_process(pid, 10 + pid)
    w.add_memory(1, 0, "data", 3 * GiB)  # device 0: limit 4 GiB
    w.add_memory(2, 0, "data", 1 * GiB + 1)
    w.add_memory(1, 1, "data", 8 * GiB)  # device 1: exactly at its 8 GiB limit
    w.add_memory(3, 2, "data", 100 * GiB)  # device 2: no limit
    doc = inspect_json(path)
    assert kinds(doc) == sorted(
        [*expected_anomalies(name), ("over_limit", None, 0, 4 * GiB + 1)], key=repr
    )
    if name in SEQLOCK_LAYOUTS:
        # An exited process (pid 0 marker) keeps its counters but no longer counts.
        w.exit(2)
        doc = inspect_json(path)
        assert doc["procs"][1]["pid"] == 0
        assert doc["procs"][1]["devices"][0]["total"] == 1 * GiB + 1
        assert kinds(doc) == expected_anomalies(name)
    w.close()


def test_wrapped_counters_never_add_up(tmp_path: Path) -> None:
    """Two wrapped counters would sum past 2**64 (and a wrapped u64 was once billed as usage):
    they are anomalies only, left out of the slots, and nothing sums them."""
    path = tmp_path / "c.cache"
    w = CacheWriter(path, V12, DEVICES)
    w.add_process(1, 11)
    w.add_process(2, 12)
    w.add_memory(1, 0, "data", -1)
    w.add_memory(2, 0, "data", -1)
    w.close()
    snap = reader.read_snapshot(path)
    assert [a.kind for a in snap.anomalies] == ["counter_wrapped"] * 4  # data, total, twice
    assert all(a.value == U64 - 1 for a in snap.anomalies)
    assert [[d.index for d in p.devices] for p in snap.procs] == [[1, 2], [1, 2]]  # not 0
    msgspec.msgpack.encode(snap)
    msgspec.json.encode(snap)


@pytest.mark.parametrize("proc_num", [5000, -3, -1, 1025])
def test_proc_num_out_of_range(tmp_path: Path, proc_num: int) -> None:
    """A garbled count reads the slots up to the first empty one and nothing beyond."""
    path = tmp_path / "c.cache"
    w = CacheWriter(path, V12, DEVICES)
    w.add_process(1, 11)
    w.add_process(2, 12)
    w.add_memory(1, 0, "data", 5)
    w.region.proc_num = proc_num
    w.close()
    doc = inspect_json(path)
    assert doc["layout"] == "v1.2"
    assert doc["proc_num"] == proc_num
    assert [(q["slot"], q["pid"], q["hostpid"]) for q in doc["procs"]] == [(0, 1, 11), (1, 2, 12)]
    assert doc["procs"][0]["devices"][0]["total"] == 5
    assert kinds(doc) == [("proc_num_out_of_range", None, None, proc_num)]


def test_proc_num_beyond_the_real_contents(tmp_path: Path) -> None:
    """proc_num in range but past an empty slot (3 real slots, count 700): the slots up to the
    empty one are read; a stale copy further on is not."""
    path = tmp_path / "c.cache"
    w = CacheWriter(path, V12, DEVICES)
    for pid in (1, 2, 3):
        w.add_process(pid, 10 + pid)
    w.add_process(9, 19)
    w.add_memory(9, 0, "data", 7)
    w.region.proc_num = 3  # slot 3 keeps a stale copy of pid 9, as after a compaction
    # ... and one beyond an empty slot 4
    C.memmove(C.addressof(w.region.procs[5]), C.addressof(w.region.procs[3]), V12.slot_size)
    C.memset(C.addressof(w.region.procs[3]), 0, V12.slot_size)
    w.region.proc_num = 700
    w.close()
    doc = inspect_json(path)
    assert [q["pid"] for q in doc["procs"]] == [1, 2, 3]
    assert kinds(doc) == [("proc_num_out_of_range", 3, None, 700)]


def test_device_num_out_of_range(tmp_path: Path) -> None:
    path = tmp_path / "c.cache"
    w = CacheWriter(path, V12, DEVICES)
    w.add_process(1, 11)
    w.region.device_num = 40
    w.close()
    doc = inspect_json(path)
    assert doc["layout"] == "v1.2"
    assert doc["device_num"] == 40
    assert [d["index"] for d in doc["devices"]] == list(range(16))  # clamped to 16
    assert [d["uuid"] for d in doc["devices"][:3]] == [UUID0, UUID1, UUID2]
    assert doc["devices"][15] == {"index": 15, "uuid": "", "limit_bytes": 0, "sm_limit": 100}
    assert len(doc["procs"][0]["devices"]) == 16
    assert kinds(doc) == sorted(
        [("device_num_out_of_range", None, None, 40)]
        + [("invalid_uuid", None, d, None) for d in range(3, 16)],
        key=repr,
    )


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_invalid_uuid(tmp_path: Path, name: str) -> None:
    path = tmp_path / "c.cache"
    devices = [SimDevice(UUID0, GiB)] * 6
    w = CacheWriter(path, LAYOUTS[name], devices)
    uuids = w.region.uuids
    uuids[1].value = b"garbage\xff"
    uuids[2].value = b"GPU-"  # prefix only
    for i in range(96):  # no NUL anywhere in the 96 bytes
        uuids[3][i] = b"G"
    uuids[4].value = b"GPU-ab cd"  # a space inside
    uuids[5].value = b"GPU-\n\x1b[31mFAKE\r\x7f"  # control bytes: escaped, never printed as such
    del uuids  # a ctypes view keeps the mapping open
    doc = inspect_json(path)
    assert [d["uuid"] for d in doc["devices"]] == [
        UUID0,
        "garbage\\xff",
        "GPU-",
        "G" * 96,
        "GPU-ab cd",
        "GPU-\\x0a\\x1b[31mFAKE\\x0d\\x7f",
    ]
    assert kinds(doc) == sorted(
        [*expected_anomalies(name)] + [("invalid_uuid", None, d, None) for d in range(1, 6)],
        key=repr,
    )
    w.close()


# --- truncated files -----------------------------------------------------------------------


def _eight_procs(path: Path, name: str = "v1.2") -> CacheWriter:
    w = CacheWriter(path, LAYOUTS[name], DEVICES[:2] + [SimDevice(UUID2), SimDevice(UUID0)])
    for i in range(8):
        w.add_process(200 + i, 9200 + i)
        w.add_memory(200 + i, i % 4, "context", (i + 1) * MiB)
        w.add_memory(200 + i, (i + 1) % 4, "data", (i + 10) * MiB)
    return w


@pytest.mark.parametrize("keep", [0.5, 3.0, 3.999, 7.0, 8.0, 1000.0], ids=lambda k: f"{k}-slots")
def test_truncated_v12(tmp_path: Path, keep: float) -> None:
    full = tmp_path / "full.cache"
    _eight_procs(full).close()
    n = V12.procs + int(keep * V12.slot_size)
    short = tmp_path / "short.cache"
    short.write_bytes(full.read_bytes()[:n])
    doc = inspect_json(short)
    assert (doc["layout"], doc["size"], doc["major"], doc["minor"]) == ("v1.2", n, 1, 2)
    assert kinds(doc) == [("truncated", None, None, None)]
    # proc_num lies beyond the end: only the slots wholly inside, up to the first empty one.
    whole = min(int(keep), 8)
    assert [q["pid"] for q in doc["procs"]] == [200 + i for i in range(whole)]
    assert doc["proc_num"] == 0  # not in the file
    for i, q in enumerate(doc["procs"]):
        assert q["devices"][i % 4]["context"] == (i + 1) * MiB
        assert q["devices"][(i + 1) % 4]["data"] == (i + 10) * MiB
    assert [d["uuid"] for d in doc["devices"]] == [UUID0, UUID1, UUID2, UUID0]


@pytest.mark.parametrize("memo", [False, True])
def test_a_file_cut_between_its_fstat_and_its_read_is_truncated(
    tmp_path: Path, memo: bool
) -> None:
    """The size came from the fstat taken before the reads: a file cut in between read as a
    whole one with no processes (proc_num past the end reads as 0), and no `truncated`."""
    path = tmp_path / "x.cache"
    _eight_procs(path).close()
    fd = os.open(path, os.O_RDONLY)
    try:
        parse = reader.ParseMemo() if memo else None
        if parse is not None:
            reader.snapshot_fd(fd, str(path), memo=parse)  # last scan: the whole file
        before = os.fstat(fd)
        n = V12.procs + 3 * V12.slot_size
        os.truncate(path, n)
        snap = reader.snapshot_fd(fd, str(path), st=before, memo=parse)
    finally:
        os.close(fd)
    assert (snap.layout, snap.size) == ("v1.2", n)
    truncated = [a for a in snap.anomalies if a.kind == "truncated"]
    assert [a.detail for a in truncated] == [f"{n} bytes, v1.2 needs {V12.region_size}"]
    assert [p.pid for p in snap.procs] == [200, 201, 202]


@pytest.mark.parametrize("memo", [False, True])
def test_a_file_cut_after_its_tail_read_is_truncated(
    tmp_path: Path, memo: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cut after proc_num was read (whole) but before the slots: only the slot reads come back
    short, and the snapshot is still a truncated one at the size after the cut."""
    path = tmp_path / "x.cache"
    _eight_procs(path).close()
    n = V12.procs + 3 * V12.slot_size
    real_pread = os.pread
    cut: list[int] = []

    def pread(fd: int, length: int, offset: int) -> bytes:
        got = real_pread(fd, length, offset)
        if not cut and offset <= V12.proc_num < offset + len(got):
            os.truncate(path, n)
            cut.append(offset)
        return got

    fd = os.open(path, os.O_RDONLY)
    try:
        monkeypatch.setattr(os, "pread", pread)
        snap = reader.snapshot_fd(fd, str(path), memo=reader.ParseMemo() if memo else None)
        monkeypatch.undo()
    finally:
        os.close(fd)
    assert cut == [V12.proc_num]
    assert (snap.layout, snap.size) == ("v1.2", n)
    assert [(a.kind, a.detail) for a in snap.anomalies] == [
        ("truncated", f"{n} bytes, v1.2 needs {V12.region_size}")
    ]
    assert [p.pid for p in snap.procs] == [200, 201, 202]


def test_truncated_v12_header_only(tmp_path: Path) -> None:
    full = tmp_path / "full.cache"
    _eight_procs(full).close()
    short = tmp_path / "short.cache"
    short.write_bytes(full.read_bytes()[:300])  # device_num and uuids[0..2] only
    doc = inspect_json(short)
    assert (doc["layout"], doc["device_num"], doc["procs"]) == ("v1.2", 4, [])
    # uuids[2] ends at byte 296, uuids[3] (at 352) is beyond the end and reads as empty.
    assert [d["uuid"] for d in doc["devices"]] == [UUID0, UUID1, UUID2, ""]
    assert [d["limit_bytes"] for d in doc["devices"]] == [0, 0, 0, 0]  # not in the file
    assert kinds(doc) == [("invalid_uuid", None, 3, None), ("truncated", None, None, None)]


@pytest.mark.parametrize("name", ["v1.1", "v1.1-interim"])
def test_truncated_v11_keeps_its_layout(tmp_path: Path, name: str) -> None:
    """The content (device_num and uuid offsets) names the layout even when the size is short;
    a truncated interim file must not be read as v1.1 (that gives garbage counters)."""
    full = tmp_path / "full.cache"
    _eight_procs(full, name).close()
    lay = LAYOUTS[name]
    n = lay.procs + 5 * lay.slot_size + 17
    short = tmp_path / "short.cache"
    short.write_bytes(full.read_bytes()[:n])
    doc = inspect_json(short)
    assert doc["layout"] == name
    assert kinds(doc) == sorted(
        [*expected_anomalies(name), ("truncated", None, None, None)], key=repr
    )
    assert [q["pid"] for q in doc["procs"]] == [200, 201, 202, 203, 204]
    assert doc["procs"][4]["devices"][0]["context"] == 5 * MiB
    assert doc["procs"][4]["devices"][1]["data"] == 14 * MiB


@pytest.mark.parametrize("name", ["v0a", "v0b"])
def test_truncated_v0_names_no_layout(tmp_path: Path, name: str) -> None:
    full = tmp_path / "full.cache"
    _eight_procs(full, name).close()
    short = tmp_path / "short.cache"
    short.write_bytes(full.read_bytes()[: LAYOUTS["v0a"].region_size - 1])
    doc = inspect_json(short)
    assert (doc["initialized"], doc["layout"], doc["major"], doc["procs"]) == (True, None, None, [])
    assert kinds(doc) == [("truncated", None, None, None)]


# --- v1.1 versus v1.1-interim when the size and the header disagree ------------------------


def test_v11_grown_to_interim_size_is_still_v11(tmp_path: Path) -> None:
    path = tmp_path / "c.cache"
    w = _eight_procs(path, "v1.1")
    w.close()
    with open(path, "r+b") as f:  # a later library extends it (files only grow)
        f.seek(V11_INTERIM.region_size)
        f.write(b"\0")
    assert path.stat().st_size == V11_INTERIM.file_size
    doc = inspect_json(path)
    assert (doc["layout"], doc["major"], doc["minor"]) == ("v1.1", 1, 1)
    assert kinds(doc) == []
    assert [d["uuid"] for d in doc["devices"]] == [UUID0, UUID1, UUID2, UUID0]
    assert [q["pid"] for q in doc["procs"]] == list(range(200, 208))


def test_v11_one_device_grown_to_interim_size_is_still_v11(tmp_path: Path) -> None:
    # device_num 1 reads as an interim sem value of 1 and a short uuid leaves the interim
    # device_num (uuids[0][24:32]) at 0: both readings pass, the one with a device must win.
    path = tmp_path / "c.cache"
    CacheWriter(path, V11, [SimDevice("GPU-ab")]).close()
    os.truncate(path, V11_INTERIM.file_size + 4096)
    doc = inspect_json(path)
    assert (doc["layout"], doc["device_num"], kinds(doc)) == ("v1.1", 1, [])
    assert doc["devices"][0]["uuid"] == "GPU-ab"


@pytest.mark.parametrize("sem_value", [0, 1])
def test_interim_without_device_is_interim(tmp_path: Path, sem_value: int) -> None:
    path = tmp_path / "c.cache"
    w = CacheWriter(path, V11_INTERIM, DEVICES, register_devices=False)
    w.region.sem_postinit.value = sem_value
    w.region.sem_postinit.nwaiters = 3
    w.add_process(5, 55)
    w.close()
    doc = inspect_json(path)
    assert (doc["layout"], doc["device_num"], doc["proc_num"]) == ("v1.1-interim", 0, 1)
    assert doc["procs"][0]["pid"] == 5 and doc["procs"][0]["hostpid"] == 55
    assert kinds(doc) == [("mislabelled_layout", None, None, None)]


def test_interim_with_waiters_is_interim(tmp_path: Path) -> None:
    path = tmp_path / "c.cache"
    w = CacheWriter(path, V11_INTERIM, DEVICES)
    w.region.sem_postinit.value = 1
    w.region.sem_postinit.nwaiters = 2  # v1.1's device_num would read 2**33 + 1
    w.close()
    doc = inspect_json(path)
    assert (doc["layout"], doc["device_num"]) == ("v1.1-interim", 3)
    assert [d["uuid"] for d in doc["devices"]] == [UUID0, UUID1, UUID2]


# --- read-only, and reading only what is needed --------------------------------------------


def _fingerprint(path: Path) -> tuple[str, int, int, int]:
    st = path.stat()
    return hashlib.sha256(path.read_bytes()).hexdigest(), st.st_mtime_ns, st.st_ctime_ns, st.st_size


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_read_only(tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.cache"
    _eight_procs(path, name).close()
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))  # an mtime a write would surely change
    before = _fingerprint(path)

    inspect_json(path)
    assert _fingerprint(path) == before

    opened: list[int] = []
    real_open = os.open

    def spy_open(p: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        opened.append(flags)
        return real_open(p, flags, *args, **kwargs)

    def no_mmap(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the reader must not mmap the file")

    monkeypatch.setattr(os, "open", spy_open)
    monkeypatch.setattr(mmap, "mmap", no_mmap)
    for _ in range(1000):
        snap = reader.read_snapshot(path)
    monkeypatch.undo()
    assert snap.layout == name and len(snap.procs) == 8
    assert len(opened) == 1000
    assert all(flags & os.O_ACCMODE == os.O_RDONLY for flags in opened)
    assert _fingerprint(path) == before

    path.chmod(0o444)
    before = _fingerprint(path)  # chmod itself changes ctime
    try:
        assert reader.read_snapshot(path).layout == name
        assert inspect_json(path)["layout"] == name
        assert _fingerprint(path) == before
        assert stat.S_IMODE(path.stat().st_mode) == 0o444
    finally:
        path.chmod(0o644)


def test_reads_only_what_is_needed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.cache"
    _eight_procs(path).close()
    calls: list[tuple[int, int, int]] = []
    real = os.pread

    def spy(fd: int, n: int, offset: int) -> bytes:
        got = real(fd, n, offset)
        calls.append((n, offset, len(got)))
        return got

    monkeypatch.setattr(os, "pread", spy)
    snap = reader.read_snapshot(path)
    monkeypatch.undo()
    assert len(snap.procs) == 8 and snap.anomalies == []
    total = sum(got for _, _, got in calls)
    slot = V12.slot_size
    # header + three passes over 8 slots (seq, slot, seq) + the tail
    assert total < 3 * 8 * slot + 4096, calls
    assert total >= 8 * slot
    assert max(n for n, _, _ in calls) <= 8 * slot, calls  # never the whole 2 MB region
    assert all(off + n <= V12.file_size for n, off, _ in calls)


def test_cli_entry_point_matches_module(tmp_path: Path) -> None:
    """The installed `hami-usage` script prints the same object as `python -m collector`."""
    path = tmp_path / "c.cache"
    _eight_procs(path).close()
    exe = shutil.which("hami-usage", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("hami-usage is not installed next to this interpreter")
    out = subprocess.run(
        [exe, "inspect", "--json", str(path)], capture_output=True, text=True, check=True
    ).stdout
    assert json.loads(out) == inspect_json(path)
