"""Discovery of `<root>/<podUID>_<container>/*.cache` on real directories."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from collector.node.discover import CacheFile, Discovery, Skipped

POD = "0f4e8a52-7d3c-4b8e-9a51-3c2d1e0f9a88"
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
    return CacheFile(pod, container, str(p), p.stat().st_ino)


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


def test_name_without_underscore_and_escaping_symlinks_are_skipped_and_reported(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    touch_cache(outside / f"{POD}_escaped")
    outside_file = touch_cache(outside, "evil.cache")
    ok = touch_cache(root / f"{POD}_main")
    touch_cache(root / "nounderscore")
    (root / f"{POD}_link").symlink_to(outside / f"{POD}_escaped")
    (root / f"{POD}_other").mkdir()
    (root / f"{POD}_other" / "link.cache").symlink_to(outside_file)
    # A symlink that stays inside the root is followed.
    (root / f"{POD}_alias").symlink_to(root / f"{POD}_main")

    files, skipped = Discovery(root).scan()
    assert files == [
        CacheFile(POD, "alias", str(root / f"{POD}_alias" / "a.cache"), ok.stat().st_ino),
        entry(ok, POD, "main"),
    ]
    assert sorted(skipped, key=lambda s: s.path) == [
        Skipped(str(root / f"{POD}_link"), "symlink that leaves the root"),
        Skipped(str(root / f"{POD}_other" / "link.cache"), "symlink that leaves the root"),
        Skipped(str(root / "nounderscore"), "directory name has no '_' (podUID_container)"),
    ]


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
    assert disc.scan() == ([entry(keep, POD, "keep")], [])


@pytest.fixture
def failing_scandir(monkeypatch: pytest.MonkeyPatch) -> Iterator[set[str]]:
    """Paths in the yielded set fail os.scandir with EACCES (what non-root sees for 000)."""
    failing: set[str] = set()
    real: Callable[..., Any] = os.scandir

    def scandir(path: Any = ".") -> Any:
        if os.fspath(path) in failing:
            raise PermissionError(13, "Permission denied", os.fspath(path))
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
    dirs = [touch_cache(tmp_path / f"{POD}_c{i}").parent for i in range(5)]
    backdate(*dirs)
    disc = Discovery(tmp_path)
    assert len(disc.scan()[0]) == 5
    calls: list[str] = []
    real: Callable[..., Any] = os.scandir

    def scandir(path: Any = ".") -> Any:
        calls.append(os.fspath(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    assert len(disc.scan()[0]) == 5
    assert calls == [str(tmp_path)]
    # Touching one directory lists that one again.
    touch_cache(dirs[2], "b.cache")
    calls.clear()
    assert len(disc.scan()[0]) == 6
    assert calls == [str(tmp_path), str(dirs[2])]
