"""HAMi's allocation annotation: the parser (property tests against HAMi's encoding and hostile
text) and the comparison with a cache file's limits (`allocation_mismatch`)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collector.events import DeviceLimit
from collector.node.allocation import (
    MAX_LENGTH,
    AllocatedDevice,
    AllocationError,
    encode,
    mismatch,
    parse,
)

# What HAMi writes: UUIDs and types never contain its separators.
SAFE = st.text(st.characters(blacklist_characters=",:;", blacklist_categories=("Cs",)), max_size=12)
DEVICES = st.builds(
    AllocatedDevice,
    uuid=SAFE.filter(bool),
    type=SAFE,
    mem_mib=st.integers(0, 2**31 - 1),
    cores=st.integers(0, 100),
)
ALLOCATIONS = st.lists(st.lists(DEVICES, max_size=4), max_size=6)


@settings(max_examples=150, deadline=None)
@given(ALLOCATIONS)
def test_parse_inverts_hamis_encoding(allocation: list[list[AllocatedDevice]]) -> None:
    assert parse(encode(allocation)) == allocation


@settings(max_examples=150, deadline=None)
@given(ALLOCATIONS.filter(lambda a: bool(a) and bool(a[-1])))
def test_the_older_joined_form_parses_the_same(allocation: list[list[AllocatedDevice]]) -> None:
    # Older schedulers joined containers with ';' and wrote none after the last one.
    joined = ";".join(
        "".join(f"{d.uuid},{d.type},{d.mem_mib},{d.cores}:" for d in c) for c in allocation
    )
    assert parse(joined) == allocation


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from("GPU-ab0123456789,:;N -+x\x00é٣"), max_size=80))
def test_any_text_parses_or_is_refused_with_allocation_error(text: str) -> None:
    try:
        result = parse(text)
    except AllocationError as exc:
        assert str(exc)
        return
    for container in result:
        for d in container:
            assert d.uuid and d.mem_mib >= 0 and d.cores >= 0
    assert parse(encode(result)) == result  # what was accepted is HAMi's form of something


def test_an_empty_entry_keeps_the_container_index() -> None:
    a = AllocatedDevice("GPU-a", "NVIDIA", 4000, 30)
    assert parse(";GPU-a,NVIDIA,4000,30:;") == [[], [a]]
    assert parse(";;GPU-a,NVIDIA,4000,30:") == [[], [], [a]]
    assert parse("") == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("GPU-a,4000,30:;", "container 0: 'GPU-a,4000,30' is not UUID,Type,MiB,cores"),
        (";GPU-a,NVIDIA,-1,30:;", "container 1: MiB '-1' is not a decimal number"),
        ("GPU-a,NVIDIA,4000,٣٠:", "container 0: cores '٣٠' is not a decimal number"),
        (",NVIDIA,1,1:", "container 0: empty device UUID"),
        ("GPU-a,NVIDIA,99999999999999,1:", "container 0: MiB '99999999999999' is not"),
        ("x" * (MAX_LENGTH + 1), f"more than {MAX_LENGTH}"),
    ],
)
def test_malformed_annotations_say_where(text: str, message: str) -> None:
    with pytest.raises(AllocationError, match=re.escape(message)):
        parse(text)


def test_mismatch_compares_uuid_memory_and_sm() -> None:
    gib = 1 << 30
    alloc = [
        AllocatedDevice("GPU-a", "NVIDIA", 4096, 30),
        AllocatedDevice("GPU-b", "NVIDIA", 1024, 0),
    ]
    same = [DeviceLimit(0, "GPU-a", 4 * gib, 30), DeviceLimit(1, "GPU-b", gib, 100)]
    assert mismatch(alloc, same) is None  # cores 0 is the whole GPU, like 100
    assert mismatch(
        alloc, [DeviceLimit(0, "GPU-a", 8 * gib, 30), DeviceLimit(1, "GPU-b", gib, 0)]
    ) == ("GPU-a memory limit 8589934592 B, allocated 4096 MiB")
    assert mismatch(
        alloc, [DeviceLimit(0, "GPU-a", 4 * gib, 50), DeviceLimit(1, "GPU-c", gib, 0)]
    ) == (
        "GPU-a SM limit 50 %, allocated 30 %; GPU-b allocated but not in the cache file; "
        "GPU-c in the cache file but not allocated"
    )
    assert mismatch([], []) is None


def test_mismatch_compares_slices_of_one_gpu_as_multisets() -> None:
    mib = 1 << 20
    alloc = [
        AllocatedDevice("GPU-a", "NVIDIA", 10000, 30),
        AllocatedDevice("GPU-a", "NVIDIA", 20000, 0),
        AllocatedDevice("GPU-b", "NVIDIA", 1024, 50),
    ]
    file = [  # the slices in another order, cores 0 written as 100
        DeviceLimit(0, "GPU-b", 1024 * mib, 50),
        DeviceLimit(1, "GPU-a", 20000 * mib, 100),
        DeviceLimit(2, "GPU-a", 10000 * mib, 30),
    ]
    assert mismatch(alloc, file) is None
    assert mismatch(alloc, [file[0], file[1], DeviceLimit(2, "GPU-a", 20000 * mib, 100)]) == (
        "GPU-a memory limit 20971520000 B, allocated 10000 MiB; GPU-a SM limit 100 %, "
        "allocated 30 %"
    )
    assert mismatch(alloc, file[:2]) == "GPU-a allocated twice, in the cache file once"
    assert mismatch(alloc[:1] + alloc[2:], file + [DeviceLimit(3, "GPU-c", mib, 0)] * 3) == (
        "GPU-a allocated once, in the cache file twice; GPU-c in the cache file but not allocated"
    )
    assert mismatch(alloc[:1] * 3, file[1:]) == "GPU-a allocated 3 times, in the cache file twice"
