"""Every offset and size the ctypes declarations derive, checked against the system C compiler.

`tests/c/layouts.c` declares the five layouts by hand (from docs/hami-cache-layout.md, with
glibc's own `sem_t`), and prints `layout key value` lines. This test derives the same lines from
`collector.layout.declarations` and requires the two sets to be identical: a field that moved, a
field missing on either side, or a size that differs fails. The doc's table numbers for the key
fields are asserted separately, so the doc and the code cannot drift together.
"""

from __future__ import annotations

import ctypes as C
import subprocess
from pathlib import Path

import pytest
from ccompile import compile_c

from collector.layout.declarations import LAYOUTS, Layout, SemT

C_SOURCE = Path(__file__).parent / "c" / "layouts.c"


def _struct_lines(layout: str, part: str, struct: type[C.Structure]) -> dict[str, int]:
    lines: dict[str, int] = {}
    for entry in struct._fields_:
        name = entry[0]
        lines[f"{layout} {part}.{name}"] = int(getattr(struct, name).offset)
    lines[f"{layout} sizeof.{part}"] = C.sizeof(struct)
    lines[f"{layout} alignof.{part}"] = C.alignment(struct)
    return lines


def python_lines() -> dict[str, int]:
    lines = {"all sizeof.sem": C.sizeof(SemT), "all alignof.sem": C.alignment(SemT)}
    for name, lay in LAYOUTS.items():
        lines |= _struct_lines(name, "region", lay.region)
        lines |= _struct_lines(name, "slot", lay.slot)
        lines |= _struct_lines(name, "dm", lay.device_memory)
        if lay.device_util is not None:
            lines |= _struct_lines(name, "du", lay.device_util)
    return lines


@pytest.fixture(scope="module")
def c_lines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, int]:
    exe = compile_c(C_SOURCE, tmp_path_factory.mktemp("layouts"))
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    lines: dict[str, int] = {}
    for line in out.splitlines():
        layout, key, value = line.split()
        full = f"{layout} {key}"
        assert full not in lines, f"C prints {full} twice"
        lines[full] = int(value)
    return lines


def test_c_output_is_complete(c_lines: dict[str, int]) -> None:
    # Sanity of the C side itself: every layout, and the count of fields + sizes per layout
    # (v0a 29, v0b 35, v1.1 42, v1.1-interim 44, v1.2 43, sem 2), so neither side can lose a
    # whole struct unnoticed.
    assert {k.split()[0] for k in c_lines} == {"all", *LAYOUTS}
    per_layout = {name: sum(k.split()[0] == name for k in c_lines) for name in LAYOUTS}
    assert per_layout == {"v0a": 29, "v0b": 35, "v1.1": 42, "v1.1-interim": 44, "v1.2": 43}
    assert len(c_lines) == len(python_lines()) == 195


def test_every_offset_and_size_matches_the_compiler(c_lines: dict[str, int]) -> None:
    py = python_lines()
    only_c = sorted(set(c_lines) - set(py))
    only_py = sorted(set(py) - set(c_lines))
    differ = {k: (py[k], c_lines[k]) for k in sorted(set(py) & set(c_lines)) if py[k] != c_lines[k]}
    assert not only_c, f"fields declared in C but not in ctypes: {only_c}"
    assert not only_py, f"fields declared in ctypes but not in C: {only_py}"
    assert not differ, f"(ctypes, C) differ: {differ}"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_derived_layout_geometry_matches_the_compiler(c_lines: dict[str, int], name: str) -> None:
    lay: Layout = LAYOUTS[name]
    c = {k.split()[1]: v for k, v in c_lines.items() if k.split()[0] == name}
    num = "region.device_num" if "region.device_num" in c else "region.num"
    assert lay.region_size == c["sizeof.region"]
    assert lay.file_size == c["sizeof.region"] + 1
    assert lay.slot_size == c["sizeof.slot"]
    assert lay.procs == c["region.procs"]
    assert lay.device_num == c[num]
    assert lay.uuids == c["region.uuids"]
    assert lay.limit == c["region.limit"]
    assert lay.sm_limit == c["region.sm_limit"]
    assert lay.proc_num == c["region.proc_num"]
    assert lay.utilization_switch == c["region.utilization_switch"]
    assert lay.recent_kernel == c["region.recent_kernel"]
    assert lay.priority == c["region.priority"]
    assert lay.last_kernel_time == c.get("region.last_kernel_time")
    assert lay.slot_used == c["slot.used"]
    assert lay.slot_monitorused == c["slot.monitorused"]
    assert lay.slot_device_util == c.get("slot.device_util")
    assert lay.slot_status == c["slot.status"]
    assert lay.slot_seqlock == c.get("slot.seqlock")
    assert lay.dm_words * 8 == c["sizeof.dm"]
    assert lay.du_words * 8 == c.get("sizeof.du", 0)
    # Slot k starts at procs + k * sizeof(slot), and the last slot ends where proc_num starts.
    assert lay.slot_offset(1023) + lay.slot_size == c["region.proc_num"]


# The doc's tables (docs/hami-cache-layout.md), typed in here on purpose.
DOC_TABLE: dict[str, dict[str, int | None]] = {
    # name: procs, proc_num, device_num, uuids, limit, slot seqlock, slot used, slot status,
    #       slot size, region size
    "v0a": {
        "procs": 1848, "proc_num": 804_664, "device_num": 48, "uuids": 56, "limit": 1592,
        "slot_seqlock": None, "slot_used": 8, "slot_status": 776, "slot_size": 784,
        "region_size": 804_680, "file_size": 804_681, "last_kernel_time": None,
    },
    "v0b": {
        "procs": 1848, "proc_num": 1_197_880, "device_num": 48, "uuids": 56, "limit": 1592,
        "slot_seqlock": None, "slot_used": 8, "slot_status": 1160, "slot_size": 1168,
        "region_size": 1_197_896, "file_size": 1_197_897, "last_kernel_time": None,
    },
    "v1.1": {
        "procs": 1856, "proc_num": 2_008_896, "device_num": 56, "uuids": 64, "limit": 1600,
        "slot_seqlock": None, "slot_used": 8, "slot_status": 1928, "slot_size": 1960,
        "region_size": 2_008_952, "file_size": 2_008_953, "last_kernel_time": 2_008_912,
    },
    "v1.1-interim": {
        "procs": 1888, "proc_num": 2_008_928, "device_num": 88, "uuids": 96, "limit": 1632,
        "slot_seqlock": 8, "slot_used": 16, "slot_status": 1936, "slot_size": 1960,
        "region_size": 2_008_984, "file_size": 2_008_985, "last_kernel_time": 2_008_944,
    },
    "v1.2": {
        "procs": 1856, "proc_num": 2_008_896, "device_num": 56, "uuids": 64, "limit": 1600,
        "slot_seqlock": 1936, "slot_used": 8, "slot_status": 1928, "slot_size": 1960,
        "region_size": 2_008_952, "file_size": 2_008_953, "last_kernel_time": 2_008_912,
    },
}  # fmt: skip


@pytest.mark.parametrize("name", list(DOC_TABLE))
def test_doc_table_numbers(name: str) -> None:
    lay = LAYOUTS[name]
    got = {key: getattr(lay, key) for key in DOC_TABLE[name]}
    assert got == DOC_TABLE[name]


def test_doc_sub_structure_numbers(c_lines: dict[str, int]) -> None:
    assert c_lines["all sizeof.sem"] == 32
    assert c_lines["all alignof.sem"] == 8
    assert c_lines["v1.2 region.sem_postinit"] == 2_008_920
    assert c_lines["v1.1-interim region.sem_postinit"] == 56
    assert c_lines["v0b sizeof.dm"] == 40 and c_lines["v1.2 sizeof.dm"] == 64
    assert c_lines["v0b sizeof.du"] == 24 and c_lines["v1.2 sizeof.du"] == 48
    assert c_lines["v1.1 slot.unused"] == 1936
    assert c_lines["v1.1-interim slot.unused"] == 1944
    assert c_lines["v1.2 slot.unused"] == 1944
    assert set(LAYOUTS) == set(DOC_TABLE)
