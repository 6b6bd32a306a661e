"""Descriptors kept open across scans: bounded, and never used for a name that is no longer
the file that was opened (the real Scanner over real files; folder mtimes are put back so the
cached listing looks current and only the per-scan checks can notice)."""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from collector.events import (
    ContainerAppeared,
    ContainerGone,
    Event,
    LayoutAnomaly,
    LimitsChanged,
    UsageSample,
)
from collector.layout.declarations import V12
from collector.node import discover
from collector.node.discover import ListingLimits
from collector.node.scan import Scanner
from collector.simulate import CacheWriter, GiB, MiB, SimDevice

POD = "0f4e8a52-7d3c-4b8e-9a51-3c2d1e0f9a88"
GPU0 = "GPU-11111111-2222-4333-8444-555555555555"
OLD = 1_600_000_000  # a folder mtime long past: the listing is served from the cache


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def write(path: Path, limit: int, pid: int = 7) -> CacheWriter:
    w = CacheWriter(path, V12, [SimDevice(GPU0, limit)])
    w.add_process(pid, 4000 + pid)
    w.add_memory(pid, 0, "data", 64 * MiB)
    return w


def container(root: Path, name: str, limit: int = GiB) -> tuple[Path, CacheWriter]:
    d = root / f"{POD}_{name}"
    d.mkdir()
    w = write(d / "a.cache", limit)
    os.utime(d, (OLD, OLD))
    return d / "a.cache", w


def limits(events: list[Event]) -> list[int]:
    return [d.limit_bytes for e in events if isinstance(e, LimitsChanged) for d in e.devices]


def replaced(events: list[Event]) -> list[int]:
    """The limits of the file that replaced another: a new inode is a new container file,
    the old one gone (a `ContainerGone` of another cid), the new one appeared."""
    (gone,) = [e for e in events if isinstance(e, ContainerGone)]
    (new,) = [e for e in events if isinstance(e, ContainerAppeared)]
    assert gone.cid != new.cid and not limits(events)
    return [d.limit_bytes for d in new.devices]


def test_a_file_replaced_under_its_name_is_reopened(tmp_path: Path) -> None:
    path, w = container(tmp_path, "main")
    s = Scanner(tmp_path, heartbeat_s=3600, inc=1)
    s.scan(now_ms=1000)
    assert s.discovery.open_count == 2  # the folder and the file
    first_ino = path.stat().st_ino
    # A new file with another limit renamed over the old name (a new inode); the folder's
    # mtime put back (its ctime still moves, so the folder is listed again).
    new = path.with_name("new.tmp")
    w2 = write(new, 2 * GiB)
    os.replace(new, path)
    os.utime(path.parent, (OLD, OLD))
    assert path.stat().st_ino != first_ino
    fds = open_fds()
    events = s.scan(now_ms=2000)
    assert replaced(events) == [2 * GiB]  # read from the new file, not the kept old one
    assert s.discovery.open_count == 2
    assert open_fds() == fds  # the old descriptor was closed, the new one kept
    w2.add_memory(7, 0, "data", 5 * MiB)
    (sample,) = [e for e in s.scan(now_ms=3000) if isinstance(e, UsageSample)]
    assert [r.data for r in sample.rows] == [69 * MiB]
    w.close()
    w2.close()


def test_a_replaced_folder_is_reopened(tmp_path: Path) -> None:
    path, w = container(tmp_path, "main")
    s = Scanner(tmp_path, heartbeat_s=3600, inc=1)
    s.scan(now_ms=1000)
    w.close()
    os.rename(path.parent, tmp_path / "old")
    path.parent.mkdir()  # same name, a new folder (new inode) with a new file
    w2 = write(path, 3 * GiB)
    events = s.scan(now_ms=2000)
    (appeared,) = [e for e in events if isinstance(e, ContainerAppeared)]
    assert [d.limit_bytes for d in appeared.devices] == [3 * GiB]  # the new folder's file
    assert ContainerGone in [type(e) for e in events]
    assert s.discovery.open_count == 2
    w2.close()


def test_descriptors_are_bounded_and_every_file_is_still_read(tmp_path: Path) -> None:
    files = [container(tmp_path, f"c{i}") for i in range(5)]
    s = Scanner(tmp_path, heartbeat_s=3600, inc=1, listing=ListingLimits(open_files=5))
    assert s.discovery.max_open == 5
    s.scan(now_ms=1000)
    fds = open_fds()
    assert s.discovery.open_count <= 5
    for scan in range(3):
        for i, (_, w) in enumerate(files):
            w.add_memory(7, 0, "data", (i + 1) * MiB)
        events = s.scan(now_ms=2000 + scan * 1000)
        samples = {e.cid: e.rows[0].data for e in events if isinstance(e, UsageSample)}
        want = {i: 64 * MiB + (i + 1) * (scan + 1) * MiB for i in range(5)}
        assert samples == want  # the kept and the reopened-each-scan files alike
        assert s.discovery.open_count <= 5
        assert open_fds() == fds  # nothing leaks past the bound
    for _, w in files:
        w.close()


def test_no_descriptor_is_kept_with_a_bound_of_zero(tmp_path: Path) -> None:
    path, w = container(tmp_path, "main")
    s = Scanner(tmp_path, heartbeat_s=3600, inc=1, listing=ListingLimits(open_files=0))
    fds = open_fds()
    s.scan(now_ms=1000)
    w.add_memory(7, 0, "data", MiB)
    assert [type(e) for e in s.scan(now_ms=2000)] == [UsageSample]
    assert s.discovery.open_count == 0 and open_fds() == fds + 1  # the root, between scans
    w.close()


def test_descriptors_of_deleted_files_and_folders_are_closed(tmp_path: Path) -> None:
    (p1, w1), (p2, w2) = container(tmp_path, "a"), container(tmp_path, "b")
    s = Scanner(tmp_path, heartbeat_s=3600, inc=1)
    fds = open_fds()
    s.scan(now_ms=1000)
    assert s.discovery.open_count == 4 and open_fds() == fds + 1 + 4  # the root and 4 kept
    w1.close()  # (the writer's mapping held a descriptor too)
    p1.unlink()  # the folder's mtime changes: relisted without the file
    fds = open_fds()
    events = s.scan(now_ms=2000)
    assert [type(e) for e in events] == [ContainerGone]
    assert s.discovery.open_count == 3 and open_fds() == fds - 1
    w2.close()
    p2.unlink()
    p2.parent.rmdir()
    fds = open_fds()
    s.scan(now_ms=3000)
    assert s.discovery.open_count == 1 and open_fds() == fds - 2  # folder a stays, empty
    s.discovery.close()
    assert open_fds() == fds - 2 - 1 - 1  # and the root


def test_a_kept_file_that_gains_a_hard_link_or_becomes_a_symlink_is_refused(
    tmp_path: Path,
) -> None:
    path, w = container(tmp_path, "main")
    s = Scanner(tmp_path, heartbeat_s=3600, inc=1)
    s.scan(now_ms=1000)
    os.link(path, tmp_path / "elsewhere")
    events = s.scan(now_ms=2000)
    refused = [(e.path, e.detail) for e in events if isinstance(e, LayoutAnomaly)]
    assert refused == [(str(path), "a hard-linked file (2 links): not read")]
    assert s.discovery.open_count == 1  # the folder only
    w.close()


@contextlib.contextmanager
def tmpfs(at: Path) -> Iterator[None]:
    """A fresh filesystem mounted on `at` (its inode numbers start where any other's did)."""
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "none", str(at)],
                       check=True, capture_output=True)  # fmt: skip
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(at)], check=False, capture_output=True)


@pytest.mark.parametrize("open_files", [0, 16384], ids=["no-descriptor-kept", "kept"])
def test_a_filesystem_mounted_over_the_root_is_read_not_the_hidden_one(
    tmp_path: Path, open_files: int
) -> None:
    """The same folder and file names on a fresh tmpfs get the same inode numbers as on the
    one under it: the kept descriptors went on reading the hidden file (its 1 GiB limit,
    forever), and without them the new file continued the old container as if rewritten."""
    root = tmp_path / "root"
    root.mkdir()
    with tmpfs(root):
        path, w1 = container(root, "main")
        s = Scanner(root, heartbeat_s=3600, inc=1, listing=ListingLimits(open_files=open_files))
        first = s.scan(now_ms=1000)
        assert [e.devices[0].limit_bytes for e in first if isinstance(e, ContainerAppeared)] == [
            GiB
        ]
        old_ino, old_dev = path.stat().st_ino, path.stat().st_dev
        w1.close()
        with tmpfs(root):
            path, w2 = container(root, "main", limit=3 * GiB)
            assert (path.stat().st_ino, path.stat().st_dev != old_dev) == (old_ino, True)
            w2.add_memory(7, 0, "data", MiB)
            events = s.scan(now_ms=2000)
            w2.close()
            s.discovery.close()
    (appeared,) = [e for e in events if isinstance(e, ContainerAppeared)]
    assert (appeared.cid, appeared.devices[0].limit_bytes) == (1, 3 * GiB)
    assert [e.cid for e in events if isinstance(e, ContainerGone)] == [0]


def stale_listing(tmp_path: Path) -> tuple[Path, CacheWriter, Scanner]:
    """A container whose folder holds more entries than a cache folder ever does, so its
    listing is kept for `relist_s` (here an hour): what the name is now is found at open."""
    path, w = container(tmp_path, "main")
    for i in range(4):
        (path.parent / f"other{i}").touch()
    limits_ = ListingLimits(max_entries=3, relist_s=3600)
    s = Scanner(tmp_path, heartbeat_s=3600, inc=1, listing=limits_)
    (appeared,) = [e for e in s.scan(now_ms=1000) if isinstance(e, ContainerAppeared)]
    assert [d.limit_bytes for d in appeared.devices] == [GiB]
    return path, w, s


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_name_swapped_for_a_fifo_or_directory_after_the_listing_is_never_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """A tenant's own folder: x.cache swapped, after the listing, for something that is not a
    regular file. Opening it could block (a FIFO) or act on a device (a tape rewinds); the
    name was opened and only then found not to be a file."""
    path, w, s = stale_listing(tmp_path)
    w.close()
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
    opened: list[int] = []  # the type of each descriptor opened for reading
    real_open = os.open

    def spy(file: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        fd = real_open(file, flags, *args, **kwargs)
        if not flags & (os.O_PATH | os.O_DIRECTORY):  # (a folder is opened to list it)
            opened.append(stat.S_IFMT(os.fstat(fd).st_mode))
        return fd

    monkeypatch.setattr(os, "open", spy)
    events = s.scan(now_ms=2000)
    assert opened == []  # nothing opened: not the FIFO, not the directory
    assert [(e.path, e.anomaly, e.detail) for e in events if isinstance(e, LayoutAnomaly)] == [
        (str(path), "skipped_path", "not a regular file")
    ]
    assert len([e for e in events if isinstance(e, ContainerGone)]) == 1


def test_a_file_replaced_after_the_listing_is_not_read_as_the_listed_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new inode under the listed name is another container file: the listed one is gone
    (never the new file's values under its identity), and the new one appears when the folder
    is listed again."""
    path, w, s = stale_listing(tmp_path)
    new = path.with_name("new.tmp")
    w2 = write(new, 2 * GiB)
    os.replace(new, path)
    events = s.scan(now_ms=2000)
    assert limits(events) == [] and not [e for e in events if isinstance(e, ContainerAppeared)]
    assert len([e for e in events if isinstance(e, ContainerGone)]) == 1
    monkeypatch.setattr(s.discovery, "limits", ListingLimits(max_entries=3, relist_s=0.0))
    assert replaced_later(s.scan(now_ms=3000)) == [2 * GiB]
    w.close()
    w2.close()


def replaced_later(events: list[Event]) -> list[int]:
    (new,) = [e for e in events if isinstance(e, ContainerAppeared)]
    return [d.limit_bytes for d in new.devices]


def test_a_file_replaced_in_the_tick_of_its_listing_is_found_at_the_next_listing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With coarse timestamps (tmpfs; ext4 and XFS before Linux 6.13) a rename in the same
    tick as the change before the listing leaves the folder's ctime as the listing saw it:
    the name's new inode, found at open, must have the folder listed again, or the new file
    is never read."""
    monkeypatch.setattr(discover, "TIMESTAMP_WINDOW_NS", 0)
    path, w = container(tmp_path, "main")
    s = Scanner(tmp_path, heartbeat_s=3600, inc=1)
    s.scan(now_ms=1000)
    new = path.with_name("new.tmp")
    w2 = write(new, 2 * GiB)
    os.replace(new, path)
    # The listing as if made in the same tick as the rename: its ctime is the folder's now.
    s.discovery._dirs[path.parent.name].ctime_ns = path.parent.stat().st_ctime_ns
    events = s.scan(now_ms=2000)
    assert len([e for e in events if isinstance(e, ContainerGone)]) == 1
    assert replaced_later(s.scan(now_ms=3000)) == [2 * GiB]
    w.close()
    w2.close()


def test_a_folder_with_a_hard_linked_file_is_not_listed_at_every_scan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The listing was right (the file, with a second link): refused at each open, reported
    once, and the folder listed no more than any other."""
    monkeypatch.setattr(discover, "TIMESTAMP_WINDOW_NS", 0)
    path, w = container(tmp_path, "main")
    os.link(path, tmp_path / "elsewhere")
    s = Scanner(tmp_path, heartbeat_s=3600, inc=1)
    anomalies = [e for t in (1000, 2000, 3000, 4000) for e in s.scan(now_ms=t)
                 if isinstance(e, LayoutAnomaly)]  # fmt: skip
    assert [e.detail for e in anomalies] == ["a hard-linked file (2 links): not read"]
    assert s.discovery.stats.listings == 1
    w.close()
