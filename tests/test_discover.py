"""Discovery of `<root>/<podUID>_<container>/*.cache` on real directories."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from collector.events import LayoutAnomaly, decode, encode
from collector.node import discover
from collector.node.discover import (
    MANY_FILES,
    MAX_FILES,
    MIN_REGION,
    NOT_UTF8,
    SYMLINK,
    CacheFile,
    Discovery,
    ListingLimits,
    Skipped,
)
from collector.node.scan import Scanner

POD = "0f4e8a52-7d3c-4b8e-9a51-3c2d1e0f9a88"
LARGE = "large_directory"
OLD = time.time() - 3600  # an hour ago: older than discovery's "recently touched" window


def touch_cache(d: Path, name: str = "a.cache", data: bytes = b"x") -> Path:
    d.mkdir(parents=True, exist_ok=True)
    p = d / name
    p.write_bytes(data)
    return p


def backdate(*paths: Path) -> None:
    for p in paths:
        os.utime(p, (OLD, OLD), follow_symlinks=False)


def entry(p: Path, pod: str, container: str) -> CacheFile:
    st = p.stat()
    return CacheFile(pod, container, str(p), st.st_ino, st.st_dev)


def test_pod_uid_and_container_split_on_first_underscore(tmp_path: Path) -> None:
    a = touch_cache(tmp_path / f"{POD}_main")
    b = touch_cache(tmp_path / f"{POD}_side_car_2", "b.cache")
    files, skipped = Discovery(tmp_path).scan()
    assert files == [entry(a, POD, "main"), entry(b, POD, "side_car_2")]
    assert skipped == []


def test_directory_before_its_file_yields_nothing_then_the_file(tmp_path: Path) -> None:
    d = tmp_path / f"{POD}_main"
    d.mkdir()
    disc = Discovery(tmp_path)
    assert disc.scan() == ([], [])
    backdate(d)  # an old directory is served from the cache until its mtime changes...
    assert disc.scan() == ([], [])
    p = touch_cache(d)  # ...which creating the file does
    assert disc.scan() == ([entry(p, POD, "main")], [])


def test_non_cache_names_are_ignored(tmp_path: Path) -> None:
    d = tmp_path / f"{POD}_main"
    p = touch_cache(d)
    (d / "notes.txt").write_text("x")
    (d / "x.cache.tmp").write_text("x")
    assert Discovery(tmp_path).scan() == ([entry(p, POD, "main")], [])


def test_two_cache_files_in_one_directory_are_both_tracked(tmp_path: Path) -> None:
    d = tmp_path / f"{POD}_main"
    b = touch_cache(d, "bbbb.cache")
    a = touch_cache(d, "aaaa.cache")
    files, _ = Discovery(tmp_path).scan()
    assert files == [entry(a, POD, "main"), entry(b, POD, "main")]


def test_a_folder_of_many_cache_files_has_only_those_changed_last_read(tmp_path: Path) -> None:
    """A tenant's folder of 20 000 empty `*.cache` files was 20 000 containers, each opened,
    read, announced and restated on every scan (and all 16 384 kept descriptors went to it).
    Past MAX_FILES, the ones changed last are read, in name order, and the folder is reported
    once while it lasts; the neighbour's folder is read as ever."""
    d = tmp_path / f"{POD}_main"
    made = [touch_cache(d, f"{i:03}.cache") for i in range(MAX_FILES + 5)]
    for p in reversed(made):  # 000.cache changed last (a file's times: its ctime is now)
        time.sleep(0.02)  # (more than a coarse kernel clock's tick, mostly)
        os.utime(p, ns=(0, 0))
    # (files the kernel stamped in one tick rank by name, the later name first)
    ranked = sorted(made, key=lambda p: (p.stat().st_ctime_ns, p.name), reverse=True)
    by_ctime = ranked[:MAX_FILES]
    assert set(by_ctime) >= set(made[: MAX_FILES - 2])  # changed last, not the names
    neighbour = touch_cache(tmp_path / f"{POD}_other")
    s = Scanner(tmp_path, heartbeat_s=3600, inc=1)
    first = s.scan(now_ms=1000)
    reported = [(e.path, e.anomaly, e.detail) for e in first if isinstance(e, LayoutAnomaly)
                and e.anomaly == LARGE]  # fmt: skip
    assert reported == [(str(d), LARGE, MANY_FILES)]
    assert sorted(k[0] for k in s._files) == sorted([str(p) for p in by_ctime] + [str(neighbour)])
    assert not [e for e in s.scan(now_ms=2000) if isinstance(e, LayoutAnomaly)]
    assert s.discovery.open_count == 2 + MAX_FILES + 1  # two folders, the files read


def test_the_real_cache_file_is_not_pushed_out_by_newer_small_ones(tmp_path: Path) -> None:
    """The tenant's own files, and times: 16 empty files made after the container's real one
    (whose ctime a live writer barely moves) pushed it out of the 16 read, and its container
    was gone. A file the size of a cache file goes first, then one read before."""
    d = tmp_path / f"{POD}_main"
    real = touch_cache(d, "real.cache", bytes(MIN_REGION))
    s = Scanner(tmp_path, heartbeat_s=3600, inc=1)
    s.scan(now_ms=1000)
    junk = [touch_cache(d, f"junk{i:02}.cache") for i in range(MAX_FILES)]
    s.scan(now_ms=2000)
    tracked = sorted(k[0] for k in s._files)
    assert tracked == sorted([str(real)] + [str(p) for p in junk[1:]])  # the oldest junk out


def test_replaced_file_is_a_new_file(tmp_path: Path) -> None:
    d = tmp_path / f"{POD}_main"
    first = touch_cache(d, "11111111.cache")
    disc = Discovery(tmp_path)
    backdate(d)
    (old,) = disc.scan()[0]

    # A new uuid name: a different path.
    first.unlink()
    second = touch_cache(d, "22222222.cache")
    (new,) = disc.scan()[0]
    assert new == entry(second, POD, "main") and new.path != old.path

    # The same name with a new inode (written elsewhere, renamed over it).
    backdate(d)
    disc.scan()
    tmp = tmp_path / "staging"
    tmp.write_bytes(b"y")
    os.replace(tmp, second)
    (again,) = disc.scan()[0]
    assert again.path == new.path
    assert again.ino != new.ino
    assert again == entry(second, POD, "main")


def test_name_without_underscore_and_every_symlink_are_skipped_and_reported(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    touch_cache(outside / f"{POD}_escaped")
    outside_file = touch_cache(outside, "evil.cache")
    ok = touch_cache(root / f"{POD}_main")
    touch_cache(root / "nounderscore")
    touch_cache(root / "_main")  # no pod UID (its records would be its GPU's node row)
    (root / f"{POD}_link").symlink_to(outside / f"{POD}_escaped")
    (root / f"{POD}_other").mkdir()
    (root / f"{POD}_other" / "link.cache").symlink_to(outside_file)
    # Not even a symlink that stays inside the root is followed: it would bill the file twice.
    (root / f"{POD}_alias").symlink_to(root / f"{POD}_main")

    files, skipped = Discovery(root).scan()
    assert files == [entry(ok, POD, "main")]
    assert sorted(skipped, key=lambda s: s.path) == [
        Skipped(str(root / f"{POD}_alias"), SYMLINK),
        Skipped(str(root / f"{POD}_link"), SYMLINK),
        Skipped(str(root / f"{POD}_other" / "link.cache"), SYMLINK),
        Skipped(str(root / "_main"), "directory name is not podUID_container"),
        Skipped(str(root / "nounderscore"), "directory name is not podUID_container"),
    ]


def test_names_that_are_not_utf8_are_reported_not_read(tmp_path: Path) -> None:
    """Names go into events and metric labels (UTF-8): a folder or file a tenant named with
    other bytes is reported, its bytes escaped, and not read; the rest of the node is."""
    ok = touch_cache(tmp_path / f"{POD}_main")
    root_b = os.fsencode(tmp_path)
    os.makedirs(root_b + b"/" + POD.encode() + b"_c\xff\xfe")
    touch_cache(Path(os.fsdecode(root_b + b"/" + POD.encode() + b"_c\xff\xfe")))
    with open(root_b + b"/" + POD.encode() + b"_main/b\xe9.cache", "wb"):
        pass
    files, skipped = Discovery(tmp_path).scan()
    assert files == [entry(ok, POD, "main")]
    assert sorted(skipped, key=lambda s: s.path) == [
        Skipped(f"{tmp_path}/{POD}_c\\xff\\xfe", NOT_UTF8),
        Skipped(f"{tmp_path}/{POD}_main/b\\xe9.cache", NOT_UTF8),
    ]
    events = Scanner(tmp_path, heartbeat_s=1, inc=1).scan(now_ms=1_700_000_000_000)
    reported = [e for e in events if isinstance(e, LayoutAnomaly) and e.anomaly == "skipped_path"]
    assert sorted(e.path for e in reported) == sorted(s.path for s in skipped)
    assert all(decode(encode(e)) == e for e in events)  # every event goes out


def test_a_root_whose_name_is_not_utf8_is_read_and_named_escaped(tmp_path: Path) -> None:
    """The root is the operator's: it is read, and the paths events carry begin with it
    escaped (the first event's encoding raised UnicodeEncodeError)."""
    root = Path(os.fsdecode(os.fsencode(tmp_path) + b"/root\xff"))
    ok = touch_cache(root / f"{POD}_main")
    with open(os.fsencode(root) + b"/" + POD.encode() + b"_main/b\xe9.cache", "wb"):
        pass
    shown = f"{tmp_path}/root\\xff"
    files, skipped = Discovery(root).scan()
    assert files == [CacheFile(POD, "main", f"{shown}/{POD}_main/a.cache", ok.stat().st_ino,
                               ok.stat().st_dev)]  # fmt: skip
    assert skipped == [Skipped(f"{shown}/{POD}_main/b\\xe9.cache", NOT_UTF8)]
    events = Scanner(root, heartbeat_s=1, inc=1).scan(now_ms=1_700_000_000_000)
    assert {e.path for e in events if hasattr(e, "path")} == {
        f"{shown}/{POD}_main/a.cache",
        f"{shown}/{POD}_main/b\\xe9.cache",
    }
    assert all(decode(encode(e)) == e for e in events)


def test_fifo_named_cache_is_skipped_not_opened(tmp_path: Path) -> None:
    d = tmp_path / f"{POD}_main"
    d.mkdir()
    os.mkfifo(d / "x.cache")
    files, skipped = Discovery(tmp_path).scan()
    assert files == []
    assert skipped == [Skipped(str(d / "x.cache"), "not a regular file")]


def test_files_next_to_directories_in_the_root_are_ignored(tmp_path: Path) -> None:
    (tmp_path / f"{POD}_stray.cache").write_bytes(b"x")
    assert Discovery(tmp_path).scan() == ([], [])


def test_vanished_directory_disappears(tmp_path: Path) -> None:
    a = touch_cache(tmp_path / f"{POD}_a")
    b = touch_cache(tmp_path / f"{POD}_b")
    disc = Discovery(tmp_path)
    backdate(a.parent, b.parent)
    assert len(disc.scan()[0]) == 2
    shutil.rmtree(a.parent)
    assert disc.scan() == ([entry(b, POD, "b")], [])
    shutil.rmtree(b.parent)
    assert disc.scan() == ([], [])


def test_missing_root_is_reported_not_raised(tmp_path: Path) -> None:
    files, skipped = Discovery(tmp_path / "nope").scan()
    assert files == []
    assert skipped == [
        Skipped(str(tmp_path / "nope"), "cannot list the root: No such file or directory")
    ]


def test_chmod_000_directory_does_not_crash(tmp_path: Path) -> None:
    d = tmp_path / f"{POD}_main"
    p = touch_cache(d)
    d.chmod(0)
    try:
        files, skipped = Discovery(tmp_path).scan()
    finally:
        d.chmod(0o755)
    if os.geteuid() == 0:
        # root (CAP_DAC_OVERRIDE) reads it anyway; the cases below simulate unreadable ones.
        assert files == [entry(p, POD, "main")] and skipped == []
    else:
        assert files == []
        assert skipped == [Skipped(str(d), "cannot list: Permission denied")]


def test_directory_replaced_by_a_file_or_a_dangling_symlink_does_not_crash(
    tmp_path: Path,
) -> None:
    # As root chmod 000 does not stop reading; these are the unreadable directories we can make.
    a = touch_cache(tmp_path / f"{POD}_a")
    b = touch_cache(tmp_path / f"{POD}_b")
    keep = touch_cache(tmp_path / f"{POD}_keep")
    disc = Discovery(tmp_path)
    assert len(disc.scan()[0]) == 3
    shutil.rmtree(a.parent)
    a.parent.write_bytes(b"now a file")
    shutil.rmtree(b.parent)
    b.parent.symlink_to(tmp_path / "does-not-exist")
    assert disc.scan() == ([entry(keep, POD, "keep")], [Skipped(str(b.parent), SYMLINK)])


@pytest.fixture
def failing_scandir(monkeypatch: pytest.MonkeyPatch) -> Iterator[set[str]]:
    """Directories in the yielded set fail os.scandir with EACCES (what non-root sees for
    000). Discovery lists descriptors, so the set's paths are matched by inode."""
    failing: set[str] = set()
    real: Callable[..., Any] = os.scandir

    def scandir(path: Any = ".") -> Any:
        ino = os.fstat(path).st_ino if isinstance(path, int) else os.stat(path).st_ino
        for p in failing:
            if os.path.exists(p) and os.stat(p).st_ino == ino:
                raise PermissionError(13, "Permission denied", p)
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    yield failing


def test_unlistable_directory_is_reported_and_retried(
    tmp_path: Path, failing_scandir: set[str]
) -> None:
    d = tmp_path / f"{POD}_main"
    p = touch_cache(d)
    backdate(d)
    failing_scandir.add(str(d))
    disc = Discovery(tmp_path)
    assert disc.scan() == ([], [Skipped(str(d), "cannot list: Permission denied")])
    # Readable again with the directory's mtime unchanged: a failed listing is not cached.
    failing_scandir.clear()
    assert disc.scan() == ([entry(p, POD, "main")], [])


def test_idle_node_lists_only_the_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(discover, "TIMESTAMP_WINDOW_NS", 200_000_000)
    dirs = [touch_cache(tmp_path / f"{POD}_c{i}").parent for i in range(5)]
    time.sleep(0.25)  # older than the window (a ctime cannot be set back)
    disc = Discovery(tmp_path)
    assert len(disc.scan()[0]) == 5
    assert disc.stats.listings == 5
    assert len(disc.scan()[0]) == 5
    assert disc.stats.listings == 5
    # Touching one directory lists that one again.
    touch_cache(dirs[2], "b.cache")
    assert len(disc.scan()[0]) == 6
    assert disc.stats.listings == 6


class MovedClock:
    """Stands in for the `time` module in discover.py: monotonic() is `now`, moved by the test;
    the file-time and duration clocks are the real ones."""

    time_ns = staticmethod(time.time_ns)
    perf_counter = staticmethod(time.perf_counter)

    def __init__(self) -> None:
        self.now = time.monotonic()

    def monotonic(self) -> float:
        return self.now


def test_a_huge_directory_is_listed_at_most_once_per_relist_and_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    big = tmp_path / f"{POD}_big"
    first = touch_cache(big, "a.cache")
    for i in range(300):
        (big / f"junk{i}").write_bytes(b"")
    small = touch_cache(tmp_path / f"{POD}_small")
    limits = ListingLimits(max_entries=100, relist_s=0.5, budget_s=10.0)
    # Discovery's monotonic clock, moved by hand: scans of a loaded machine can be seconds
    # apart, which would make "before relist_s has passed" a race.
    clock = MovedClock()
    monkeypatch.setattr(discover, "time", clock)
    disc = Discovery(tmp_path, limits)
    report = Skipped(str(big), "more than 100 entries: listed at most once every 0.5 s", LARGE)
    assert disc.scan() == ([entry(first, POD, "big"), entry(small, POD, "small")], [report])
    assert (disc.stats.listings, disc.stats.large) == (2, 1)
    # Touched on every scan (and so "recent"): the small one is listed each time, the big one
    # is served from its last listing until relist_s has passed.
    second = touch_cache(big, "b.cache")
    for _ in range(3):
        touch_cache(small.parent, "x.cache")
        assert disc.scan()[1] == [report]
    assert disc.stats.listings == 2 + 3
    assert [f.path for f in disc.scan()[0]] == [str(first), str(small.parent / "a.cache"),
                                                 str(small.parent / "x.cache")]  # fmt: skip
    clock.now += 0.6
    files, _ = disc.scan()
    assert entry(second, POD, "big") in files
    # Back under the bound: an ordinary directory again, no longer reported.
    for i in range(300):
        (big / f"junk{i}").unlink()
    clock.now += 0.6
    assert disc.scan()[1] == []
    assert disc.stats.large == 0


def test_listing_time_per_scan_is_bounded_and_no_directory_starves(tmp_path: Path) -> None:
    dirs = [touch_cache(tmp_path / f"{POD}_c{i}").parent for i in range(5)]
    disc = Discovery(tmp_path, ListingLimits(budget_s=1e-9))
    assert len(disc.scan()[0]) == 5  # a directory never listed is always listed
    for d in dirs:
        touch_cache(d, "b.cache")
    # Every directory needs listing again; the budget allows one per scan (the first listing
    # always runs), the rest keep their last listing and go first next time.
    counts = []
    for _ in range(5):
        before = disc.stats.listings
        counts.append(len(disc.scan()[0]))
        assert disc.stats.listings == before + 1
    assert counts == [6, 7, 8, 9, 10]
    assert disc.stats.deferred == 4 + 4 + 4 + 4 + 4
