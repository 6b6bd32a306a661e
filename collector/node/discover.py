"""Find `<root>/<podUID>_<container>/*.cache` files.

A container directory is listed again only when its mtime changes, so an idle node costs one
`scandir` of the root plus one `stat` per directory each interval.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class CacheFile:
    pod_uid: str
    container: str
    path: str
    ino: int  # a replaced file (new uuid name or new inode) is a new file


@dataclass(frozen=True)
class Skipped:
    path: str
    reason: str


@dataclass
class _Dir:
    mtime_ns: int
    files: list[CacheFile] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)


def _inside(root_real: str, path: str) -> bool:
    real = os.path.realpath(path)
    return real == root_real or real.startswith(root_real + os.sep)


class Discovery:
    def __init__(self, root: Path) -> None:
        self.root = root
        self._dirs: dict[str, _Dir] = {}

    def scan(self) -> tuple[list[CacheFile], list[Skipped]]:
        root_real = os.path.realpath(self.root)
        files: list[CacheFile] = []
        skipped: list[Skipped] = []
        seen: dict[str, _Dir] = {}
        try:
            entries = sorted(os.scandir(self.root), key=lambda e: e.name)  # stable cid order
        except OSError as exc:
            return [], [Skipped(str(self.root), f"cannot list the root: {exc.strerror}")]
        for entry in entries:
            try:
                is_dir = entry.is_dir(follow_symlinks=True)
            except OSError:
                is_dir = False
            if not is_dir:
                continue
            if "_" not in entry.name:
                skipped.append(Skipped(entry.path, "directory name has no '_' (podUID_container)"))
                continue
            if entry.is_symlink() and not _inside(root_real, entry.path):
                skipped.append(Skipped(entry.path, "symlink that leaves the root"))
                continue
            try:
                mtime_ns = entry.stat(follow_symlinks=True).st_mtime_ns
            except OSError:
                continue  # vanished between scandir and stat
            cached = self._dirs.get(entry.path)
            # A change within the filesystem's timestamp granularity can leave mtime as it
            # was, so a directory touched in the last two seconds is listed again anyway.
            recent = time.time_ns() - mtime_ns < 2_000_000_000
            if cached is None or cached.mtime_ns != mtime_ns or recent:
                cached = self._list(entry.path, entry.name, mtime_ns, root_real)
            seen[entry.path] = cached
            files += cached.files
            skipped += cached.skipped
        self._dirs = seen
        return files, skipped

    @staticmethod
    def _list(path: str, name: str, mtime_ns: int, root_real: str) -> _Dir:
        pod_uid, container = name.split("_", 1)  # split on the first '_' only
        d = _Dir(mtime_ns)
        try:
            entries = sorted(os.scandir(path), key=lambda e: e.name)
        except OSError as exc:
            d.skipped.append(Skipped(path, f"cannot list: {exc.strerror}"))
            d.mtime_ns = -1  # never a cache hit: list it again next scan
            return d
        for entry in entries:
            if not entry.name.endswith(".cache"):
                continue
            try:
                if entry.is_symlink() and not _inside(root_real, entry.path):
                    d.skipped.append(Skipped(entry.path, "symlink that leaves the root"))
                    continue
                if not entry.is_file(follow_symlinks=True):
                    d.skipped.append(Skipped(entry.path, "not a regular file"))
                    continue
                ino = entry.stat(follow_symlinks=True).st_ino
            except OSError:
                continue
            d.files.append(CacheFile(pod_uid, container, entry.path, ino))
        return d
