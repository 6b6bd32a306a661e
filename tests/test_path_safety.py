"""The collector never reads outside its root, and no anomaly detail carries foreign bytes.

Real directories, real symlinks and hard links, the real Scanner: a tenant who controls a
container directory races the collector by swapping names for symlinks (putting the directory's
mtime back so the cached listing looks current) or hard-linking someone else's file.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from collector.events import ContainerAppeared, ContainerGone, Event, LayoutAnomaly
from collector.layout.declarations import MAGIC, V11
from collector.layout.reader import read_snapshot
from collector.node.scan import Scanner
from collector.simulate import CacheWriter, GiB, SimDevice

POD = "0f4e8a52-7d3c-4b8e-9a51-3c2d1e0f9a88"
GPU0 = "GPU-11111111-2222-4333-8444-555555555555"
SECRET = b"root:$6$hunter2secret:19000:0:99999:7:::\n"
SYMLINK = "a symlink: never followed below the root"
OLD = 1_600_000_000  # a directory mtime long past: the listing is served from the cache


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """(root, outside): the collector's root and a secret file next to it, not under it."""
    root = tmp_path / "containers"
    root.mkdir()
    outside = tmp_path / "etc-shadow"
    outside.write_bytes(SECRET)
    yield root, outside


def scanner(root: Path) -> Scanner:
    return Scanner(root, heartbeat_s=3600, inc=1)


def leaked(events: list[Event]) -> list[Event]:
    """Anomalies whose detail or value carries a piece of the secret: its text, or its first
    words read as numbers."""
    words = [SECRET[i : i + 6].decode() for i in range(0, 30, 3)]
    numbers = {int.from_bytes(SECRET[i : i + 4], "little") for i in range(0, 16, 4)}
    numbers |= {int.from_bytes(SECRET[i : i + 4], "little", signed=True) for i in (0, 4)}
    return [
        e
        for e in events
        if isinstance(e, LayoutAnomaly)
        and (any(w in e.detail for w in words) or any(str(n) in e.detail for n in numbers))
        or (isinstance(e, LayoutAnomaly) and e.value in numbers)
    ]


def skipped(events: list[Event]) -> list[tuple[str, str]]:
    return [
        (e.path, e.detail)
        for e in events
        if isinstance(e, LayoutAnomaly) and e.anomaly == "skipped_path"
    ]


def appeared(events: list[Event]) -> list[str]:
    return [e.path for e in events if isinstance(e, ContainerAppeared)]


def main_dir(root: Path) -> Path:
    d = root / f"{POD}_main"
    d.mkdir()
    return d


def swap_for_symlink(path: Path, target: Path) -> None:
    """Atomically replace `path` by a symlink to `target`, then put the folder's mtime back:
    a listing cached by mtime still looks current."""
    tmp = path.parent / "tmp.link"
    tmp.symlink_to(target)
    os.replace(tmp, path)
    os.utime(path.parent, (OLD, OLD))


def test_a_symlink_inside_the_root_later_pointed_outside_is_never_read(
    tree: tuple[Path, Path],
) -> None:
    root, outside = tree
    d = main_dir(root)
    inside = d / "data.bin"  # not a *.cache name: only the link is listed
    inside.write_bytes(bytes(64))
    link = d / "a.cache"
    link.symlink_to(inside)
    s = scanner(root)
    first = s.scan(now_ms=1000)
    assert appeared(first) == []  # not even a symlink that stays inside is followed
    assert skipped(first) == [(str(link), SYMLINK)]
    swap_for_symlink(link, outside)  # the tenant points it outside
    second = s.scan(now_ms=2000)
    assert appeared(second) == [] and leaked(second) == []
    assert skipped(second) == []  # still the same skipped path: reported once


def test_a_container_directory_symlink_pointed_outside_is_never_listed(
    tree: tuple[Path, Path],
) -> None:
    root, outside = tree
    elsewhere = outside.parent / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "x.cache").write_bytes(SECRET)
    (root / f"{POD}_real").mkdir()
    (root / f"{POD}_alias").symlink_to(root / f"{POD}_real")
    s = scanner(root)
    assert skipped(s.scan(now_ms=1000)) == [(str(root / f"{POD}_alias"), SYMLINK)]
    (root / f"{POD}_alias").unlink()
    (root / f"{POD}_alias").symlink_to(elsewhere)
    events = s.scan(now_ms=2000)
    assert appeared(events) == [] and leaked(events) == []


def test_a_file_swapped_for_a_symlink_with_the_mtime_put_back_is_not_followed(
    tree: tuple[Path, Path],
) -> None:
    root, outside = tree
    d = main_dir(root)
    path = d / "a.cache"
    CacheWriter(path, V11, [SimDevice(GPU0, GiB)]).close()
    os.utime(d, (OLD, OLD))
    s = scanner(root)
    assert appeared(s.scan(now_ms=1000)) == [str(path)]
    swap_for_symlink(path, outside)  # the cached listing still says "a regular file"
    events = s.scan(now_ms=2000)
    assert leaked(events) == []
    assert skipped(events) == [(str(path), SYMLINK)]
    assert [type(e) for e in events if not isinstance(e, LayoutAnomaly)] == [ContainerGone]


def test_a_hard_link_is_refused(tree: tuple[Path, Path]) -> None:
    root, outside = tree
    d = main_dir(root)
    os.link(outside, d / "a.cache")
    events = scanner(root).scan(now_ms=1000)
    assert appeared(events) == [] and leaked(events) == []
    assert skipped(events) == [(str(d / "a.cache"), "a hard-linked file (2 links): not read")]


def test_a_file_hard_linked_after_it_was_read_is_dropped(tree: tuple[Path, Path]) -> None:
    root, _ = tree
    path = main_dir(root) / "a.cache"
    CacheWriter(path, V11, [SimDevice(GPU0, GiB)]).close()
    s = scanner(root)
    assert appeared(s.scan(now_ms=1000)) == [str(path)]
    os.link(path, root / "elsewhere")
    events = s.scan(now_ms=2000)
    assert skipped(events) == [(str(path), "a hard-linked file (2 links): not read")]
    assert [type(e) for e in events if not isinstance(e, LayoutAnomaly)] == [ContainerGone]


def _header(major: int, minor: int) -> bytearray:
    data = bytearray(V11.file_size)
    data[0:12] = b"".join(x.to_bytes(4, "little") for x in (MAGIC, major, minor))
    return data


def test_details_never_quote_bytes_a_cache_file_could_not_hold(tmp_path: Path) -> None:
    # Garbage at the front: the flag that is not the magic is not quoted.
    garbage = tmp_path / "garbage.cache"
    garbage.write_bytes(SECRET + bytes(64))
    snap = read_snapshot(garbage)
    assert [(a.kind, a.detail) for a in snap.anomalies] == [
        ("not_initialized", f"initialized_flag is not {MAGIC}")
    ]
    # Version fields no version could have.
    version = tmp_path / "version.cache"
    version.write_bytes(bytes(_header(int.from_bytes(b"root", "little"), 7)))
    (a,) = read_snapshot(version).anomalies
    assert (a.kind, a.detail) == ("unknown_version", "the version fields hold no known version")
    # A small unknown version is still named.
    small = tmp_path / "small.cache"
    small.write_bytes(bytes(_header(7, 0)))
    (a,) = read_snapshot(small).anomalies
    assert a.detail == "version 7.0 is not a known layout"
    # UUIDs that are not NVML UUIDs: what is wrong is said, the bytes are not quoted.
    uuids = tmp_path / "uuids.cache"
    data = _header(1, 1)
    data[V11.device_num : V11.device_num + 8] = (3).to_bytes(8, "little")
    data[V11.uuids : V11.uuids + 4] = b"GPU-"  # device 0 valid enough to detect v1.1
    data[V11.uuids + 4 : V11.uuids + 20] = b"0000-1111-2222-3"
    u1 = V11.uuids + 96
    data[u1 : u1 + len(SECRET)] = SECRET
    u2 = V11.uuids + 192
    data[u2 : u2 + 96] = b"GPU-" + SECRET[:40] * 2 + SECRET[:12]  # no NUL at all
    uuids.write_bytes(bytes(data))
    snap = read_snapshot(uuids)
    details = [(a.kind, a.device, a.detail) for a in snap.anomalies]
    assert details == [
        (
            "invalid_uuid",
            1,
            f"uuid on device 1 is not an NVML UUID: {len(SECRET)} bytes that do not begin "
            "with GPU- or MIG-",
        ),
        ("invalid_uuid", 2, "uuid on device 2 is not an NVML UUID: no NUL in its 96 bytes"),
    ]
