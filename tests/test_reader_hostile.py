"""The cache file is written by tenant code: the reader must survive any bytes.

Property, for every input: `read_snapshot` does not raise, returns a `Snapshot` with at most
1024 processes and device indexes below 16, and the result encodes (JSON and msgpack) and
decodes back equal. Full-size files are built once per layout; each example mutates a working
copy in place with `os.pwrite`/`os.truncate` and restores it afterwards, so no example rebuilds
2 MB. Case counts are set per test (`max_examples`), adding up to 10 000+.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collector.layout.declarations import LAYOUTS, MAGIC, MAX_DEVICES, MAX_PROCS, Layout
from collector.layout.reader import read_snapshot
from collector.layout.snapshot import Snapshot
from collector.simulate import CacheWriter, SimDevice

MiB = 1 << 20
NAMES = list(LAYOUTS)
MAGIC_LE = MAGIC.to_bytes(4, "little")

HOSTILE = settings(
    deadline=None,
    derandomize=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def check(snap: Snapshot) -> None:
    assert isinstance(snap, Snapshot)
    assert len(snap.procs) <= MAX_PROCS
    assert len(snap.devices) <= MAX_DEVICES
    assert [d.index for d in snap.devices] == list(range(len(snap.devices)))
    assert len({p.slot for p in snap.procs}) == len(snap.procs)
    for p in snap.procs:
        assert 0 <= p.slot < MAX_PROCS
        assert len(p.devices) <= MAX_DEVICES
        for u in p.devices:
            assert 0 <= u.index < MAX_DEVICES
    for a in snap.anomalies:
        assert isinstance(a.kind, str) and a.kind
    raw = msgspec.json.encode(snap)
    assert msgspec.json.decode(raw, type=Snapshot) == snap
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(snap), type=Snapshot) == snap


# --- valid full-size files, built once -----------------------------------------------------


@dataclass
class Base:
    name: str
    layout: Layout
    content: bytes
    work: Path  # a working copy that examples mutate and restore

    def restore(self, spans: list[tuple[int, int]]) -> None:
        fd = os.open(self.work, os.O_WRONLY)
        try:
            os.ftruncate(fd, len(self.content))
            for off, n in spans:
                os.pwrite(fd, self.content[off : off + n], off)
        finally:
            os.close(fd)


def _build(path: Path, name: str) -> bytes:
    lay = LAYOUTS[name]
    devices = [
        SimDevice("GPU-0b8a3c1e-5f2d-4a6b-9c7e-1d2f3a4b5c6d", 4 << 30, 50),
        SimDevice("GPU-7e6d5c4b-3a2f-4e1d-8c9b-0a1b2c3d4e5f", 8 << 30, 100),
        SimDevice("MIG-4f1b2c3d-aaaa-bbbb-cccc-111122223333", 0, 30),
        SimDevice("GPU-11111111-2222-3333-4444-555555555555", 1 << 30, 100),
    ]
    w = CacheWriter(path, lay, devices, priority=2)
    for i in range(8):
        w.add_process(100 + i, 5000 + i)
        w.add_memory(100 + i, i % 4, "context", (i + 1) * MiB)
        w.add_memory(100 + i, (i + 1) % 4, "data", (i + 7) * MiB)
    w.watch({5000 + i: {i % 4: ((i + 2) * MiB, 10 * i)} for i in range(8)})
    w.kernel_launched(1_760_000_000)
    w.exit(103)
    w.close()
    return path.read_bytes()


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Base]]:
    root = tmp_path_factory.mktemp("hostile")
    out: dict[str, Base] = {}
    for name in NAMES:
        content = _build(root / f"{name}.orig", name)
        work = root / f"{name}.cache"
        work.write_bytes(content)
        out[name] = Base(name, LAYOUTS[name], content, work)
    yield out


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("scratch") / "small.cache"


def test_bases_are_valid(bases: dict[str, Base]) -> None:
    """The starting points read cleanly, so the mutations below start from real files."""
    for name, base in bases.items():
        snap = read_snapshot(base.work)
        assert snap.layout == name
        assert len(snap.procs) == (8 if base.layout.slot_seqlock is not None else 7)
        assert [a.kind for a in snap.anomalies] == (
            ["mislabelled_layout"] if name == "v1.1-interim" else []
        )


# --- random small files --------------------------------------------------------------------

PREFIXES = [
    b"",
    MAGIC_LE,
    MAGIC_LE + b"\0\0\0\0",  # v0: sm_init_flag 0
    MAGIC_LE + (1).to_bytes(4, "little") + (1).to_bytes(4, "little"),
    MAGIC_LE + (1).to_bytes(4, "little") + (2).to_bytes(4, "little"),
    MAGIC_LE + (1).to_bytes(4, "little") + (9).to_bytes(4, "little"),
]


@settings(HOSTILE, max_examples=3000)
@given(prefix=st.sampled_from(PREFIXES), body=st.binary(max_size=4096))
def test_random_small_files(scratch: Path, prefix: bytes, body: bytes) -> None:
    scratch.write_bytes(prefix + body)
    check(read_snapshot(scratch))


# --- random full-size files (few, built once) ----------------------------------------------


@pytest.fixture(scope="module")
def random_full(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    rng = random.Random(20240124)
    root = tmp_path_factory.mktemp("random-full")
    files = []
    for i, (prefix, size) in enumerate(
        [
            (PREFIXES[2], LAYOUTS["v0a"].file_size),
            (PREFIXES[2], LAYOUTS["v0b"].file_size),
            (PREFIXES[3], LAYOUTS["v1.1"].file_size),
            (PREFIXES[3], LAYOUTS["v1.1-interim"].file_size),
            (PREFIXES[4], LAYOUTS["v1.2"].file_size),
            (PREFIXES[5], LAYOUTS["v1.2"].file_size),
        ]
    ):
        path = root / f"r{i}.cache"
        path.write_bytes(prefix + rng.randbytes(size - len(prefix)))
        files.append(path)
    return files


@settings(HOSTILE, max_examples=300)
@given(data=st.data())
def test_random_full_size_files(random_full: list[Path], data: st.DataObject) -> None:
    """Random bytes everywhere behind a valid header; proc_num/device_num forced small (or not)
    so the reader goes all the way into the slots."""
    path = data.draw(st.sampled_from(random_full), label="file")
    offsets = sorted({lay.proc_num for lay in LAYOUTS.values()} | {48, 56, 88})
    writes = data.draw(
        st.lists(st.tuples(st.sampled_from(offsets), st.integers(-4, 1100)), max_size=4),
        label="writes",
    )
    original = path.read_bytes()
    fd = os.open(path, os.O_RDWR)
    try:
        for off, value in writes:
            os.pwrite(fd, value.to_bytes(8, "little", signed=True), off)
        check(read_snapshot(path))
    finally:
        os.ftruncate(fd, len(original))  # a write past the end of a smaller file extends it
        for off, _ in writes:
            os.pwrite(fd, original[off : off + 8], off)
        os.close(fd)
    assert path.read_bytes() == original


# --- truncations of valid files ------------------------------------------------------------


@settings(HOSTILE, max_examples=2000)
@given(data=st.data())
def test_truncated_valid_files(bases: dict[str, Base], data: st.DataObject) -> None:
    base = bases[data.draw(st.sampled_from(NAMES), label="layout")]
    lay = base.layout
    size = len(base.content)
    length = data.draw(
        st.one_of(
            st.integers(0, size),
            st.integers(0, 2048),  # inside the header
            st.integers(lay.procs, lay.procs + 10 * lay.slot_size),  # among the live slots
            st.integers(lay.proc_num - 8, size),  # around the tail
        ),
        label="length",
    )
    os.truncate(base.work, length)
    try:
        snap = read_snapshot(base.work)
        check(snap)
        assert snap.size == length
        # (A v0b file cut to v0a size or more reads as v0a: unversioned layouts have nothing
        # but the size to tell them apart, so only the named layout is asserted here.)
        if length < lay.region_size and snap.layout == base.name:
            assert "truncated" in {a.kind for a in snap.anomalies}
            # Only slots wholly inside the file are reported.
            assert all(lay.slot_offset(p.slot + 1) <= length for p in snap.procs)
    finally:
        base.restore([(length, size - length)])


# --- bit flips and word overwrites at random offsets of valid files ------------------------


def _offsets(lay: Layout) -> st.SearchStrategy[int]:
    size = lay.file_size
    seq = lay.slot_seqlock if lay.slot_seqlock is not None else 0
    return st.one_of(
        st.integers(0, size - 1),  # anywhere
        st.integers(0, 63),  # magic, versions, owner, sem
        st.integers(lay.device_num - 4, lay.device_num + 11),
        st.integers(lay.uuids, lay.uuids + 4 * 96 + 8),
        st.integers(lay.limit, lay.procs - 1),  # limits, sm limits
        st.integers(lay.procs, lay.procs + 9 * lay.slot_size),  # live slots and the next
        st.integers(0, 9).map(lambda k: lay.slot_offset(k) + seq),  # seqlock (or pid) words
        st.integers(0, 9).map(lambda k: lay.slot_offset(k) + lay.slot_status),
        st.integers(lay.proc_num - 4, lay.proc_num + 7),
        st.integers(lay.proc_num, size - 1),  # the tail
    )


@settings(HOSTILE, max_examples=2500)
@given(data=st.data())
def test_bit_flips(bases: dict[str, Base], data: st.DataObject) -> None:
    base = bases[data.draw(st.sampled_from(NAMES), label="layout")]
    flips = data.draw(
        st.lists(st.tuples(_offsets(base.layout), st.integers(0, 7)), min_size=1, max_size=8),
        label="flips",
    )
    fd = os.open(base.work, os.O_RDWR)
    try:
        for off, bit in flips:
            (byte,) = os.pread(fd, 1, off)
            os.pwrite(fd, bytes([byte ^ (1 << bit)]), off)
    finally:
        os.close(fd)
    try:
        check(read_snapshot(base.work))
    finally:
        base.restore([(off, 1) for off, _ in flips])


WORDS = st.one_of(
    st.sampled_from(
        [0, 1, 2, 15, 16, 17, 40, 1023, 1024, 1025, 5000, 2**31 - 1, 2**31, 2**32 - 1,
         2**63 - 1, 2**63, 2**64 - 1, MAGIC, 0x2D555047]  # last: b"GPU-"
    ),
    st.integers(0, 2**64 - 1),
)  # fmt: skip


@settings(HOSTILE, max_examples=2500)
@given(data=st.data())
def test_word_overwrites(bases: dict[str, Base], data: st.DataObject) -> None:
    base = bases[data.draw(st.sampled_from(NAMES), label="layout")]
    writes = data.draw(
        st.lists(
            st.tuples(_offsets(base.layout), st.sampled_from([4, 8]), WORDS),
            min_size=1,
            max_size=6,
        ),
        label="writes",
    )
    spans = []
    fd = os.open(base.work, os.O_RDWR)
    try:
        for off, width, value in writes:
            raw = (value % (1 << (8 * width))).to_bytes(width, "little")
            os.pwrite(fd, raw, off)  # may extend the file by a few bytes: restore truncates
            spans.append((off, width))
    finally:
        os.close(fd)
    try:
        check(read_snapshot(base.work))
    finally:
        base.restore(spans)


@pytest.mark.parametrize("name", NAMES)
def test_restored_bases_are_intact(bases: dict[str, Base], name: str) -> None:
    """After all the mutations the working copies are byte-identical to the originals (so each
    example started from a valid file)."""
    assert bases[name].work.read_bytes() == bases[name].content
