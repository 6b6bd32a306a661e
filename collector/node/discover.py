"""Find `<root>/<podUID>_<container>/*.cache` files, and open them without leaving the root.

A container directory is listed again only when its ctime changes (every entry added, removed or
renamed changes it, and unlike the mtime nobody can set it back), so an idle node costs one
listing of the root plus one `stat` per directory each interval.

Nothing under the root is trusted: tenants write the container directories. No symlink is ever
followed below the root: each container directory is opened `O_DIRECTORY|O_NOFOLLOW` relative to
a descriptor of the root, and each file `O_PATH|O_NOFOLLOW` relative to that directory's
descriptor, so a name swapped for a symlink between listing and opening is found to be one
instead of reading what it points at. Only what that descriptor shows to be a regular file with
one link is then opened for reading, through the descriptor itself (`/proc/self/fd`), so a name
swapped for a FIFO or a device node is never opened (opening a device can act on it), and a file
with more than one hard link, which could be a link to a file elsewhere on the same filesystem,
is refused. A name that is another file than the listing found is not read under the listed
file's identity: the listed file is gone, and the folder is listed again.

Listing is bounded (see `ListingLimits`): a directory with more entries than a cache directory
ever holds is listed at most once per `relist_s`, and listings stop for the rest of a scan once
the scan has spent `budget_s` on them (the directories left wait for the next scan).

Descriptors are kept open across scans, at most `open_files` of them (container directories and
cache files together; past the bound a file is opened and closed on each scan as before). A kept
descriptor is used again only while it is still what its name is: the directory's (st_dev,
st_ino) from the root's listing this scan, and for a file an `lstat` of its name relative to the
kept directory each scan, equal to what was opened. A name replaced by another file (a new
inode) or by a symlink, or that gained a hard link, gets the answer a fresh open would: reopened
through the same checks, refused, or gone. Cache files are written through shared mappings,
never replaced in place, so the inode is what identifies one.

A name cannot be replaced, removed or added without changing its folder's mtime and ctime (and
nobody can set a ctime back), so while a kept folder's times are what they were when a file's
name was last checked, and were already older than the timestamp window then (a change within
the filesystem's granularity can leave them as they were), the name is still that file: the
`lstat` of the name is replaced by an `fstat` of the kept descriptor, which still gives the
links (a hard link made elsewhere changes no folder of ours) and the size. Likewise a kept
folder that the root's listing names with its own inode number, as a folder, is `fstat`ed by
its descriptor instead of by name; a removed folder (no links left) is never kept.
"""

from __future__ import annotations

import errno
import os
import resource
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from ..layout.declarations import LAYOUTS
from ..layout.snapshot import shown_path
from ..settings_check import utf8

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_PATH_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
# Only a regular file is opened (see `_open_regular`); O_NONBLOCK and O_NOCTTY stay as a second
# guard. No O_NOFOLLOW: the file is opened through its /proc/self/fd link, which it would refuse.
_FILE_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
SYMLINK = "a symlink: never followed below the root"
NOT_REGULAR = "not a regular file"
# Names go into events and metric labels, which are UTF-8: a name that is not is reported (its
# bytes escaped) and its folder or file not read.
NOT_UTF8 = "a name that is not UTF-8"
# A change within the filesystem's timestamp granularity can leave a folder's times as they
# were: a stamp newer than this proves nothing.
TIMESTAMP_WINDOW_NS = 2_000_000_000
# A HAMi container folder holds one cache file, two while a new allocation replaces it: past
# this many (a tenant's folder of 20 000 empty `*.cache` files was 20 000 containers, read,
# announced and restated every scan, and took every kept descriptor), the ones changed last
# are read and the folder is reported.
MAX_FILES = 16
MANY_FILES = (
    f"more than {MAX_FILES} cache files: {MAX_FILES} are read (those the size of a cache file "
    "first, then those read before, then those changed last)"
)
# The smallest file any layout needs: what an empty or short file is not.
MIN_REGION = min(layout.region_size for layout in LAYOUTS.values())


@dataclass(frozen=True)
class CacheFile:
    pod_uid: str
    container: str
    path: str
    ino: int  # a replaced file (new uuid name or new inode) is a new file
    dev: int = 0  # so is one on another filesystem (the root remounted: inode numbers repeat)
    # (its container folder's name, its own name), split from `path` once per listing
    names: tuple[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        directory, name = os.path.split(self.path)
        object.__setattr__(self, "names", (os.path.basename(directory), name))


@dataclass(frozen=True)
class Skipped:
    """A path reported rather than read (or, `large_directory`, read only now and then)."""

    path: str
    reason: str
    kind: str = "skipped_path"


@dataclass(frozen=True)
class ListingLimits:
    """Bounds on directory work per scan, and on descriptors kept (see the module docstring)."""

    max_entries: int = 1000  # a HAMi container directory holds one or two files
    relist_s: float = 60.0
    budget_s: float = 0.2
    open_files: int = 16384  # descriptors kept open across scans; 0 keeps none


# Descriptors left under RLIMIT_NOFILE for everything else (sockets, the log, NVML, listings).
FD_RESERVE = 256


class Opened(NamedTuple):
    """A cache file's read-only descriptor, as `Discovery.open` hands it out."""

    fd: int
    st: os.stat_result  # taken this scan: the file the descriptor reads
    kept: bool  # held across scans by Discovery; otherwise the caller closes it


# A kept file: fd, dev, ino, and the stamp its folder had when its name was last checked.
_KeptFile = tuple[int, int, int, "tuple[int, int] | None"]


@dataclass
class _Held:
    """A kept container directory and the cache files kept open in it."""

    fd: int
    dev: int
    ino: int
    files: dict[str, _KeptFile] = field(default_factory=dict)
    # (mtime_ns, ctime_ns) of the folder as this scan's listing of the root found it, when its
    # ctime was then older than TIMESTAMP_WINDOW_NS; None otherwise.
    stamp: tuple[int, int] | None = None


@dataclass
class ListingStats:
    listings: int = 0
    deferred: int = 0  # listings put off to a later scan by the time budget
    large: int = 0  # directories over max_entries right now


@dataclass
class _Dir:
    ctime_ns: int
    files: list[CacheFile] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    entries: int = 0
    listed_at: float = 0.0  # time.monotonic() of the listing
    failed: bool = False  # the listing could not be made: what is in the folder is unknown


class Discovery:
    def __init__(self, root: Path, limits: ListingLimits | None = None) -> None:
        self.root = root
        # The root is the operator's and may not be UTF-8: the paths below it that events carry
        # begin with it escaped; it is opened by its own name.
        self.shown_root = shown_path(os.fspath(root))
        self.limits = limits or ListingLimits()
        self.stats = ListingStats()
        self._dirs: dict[str, _Dir] = {}
        self._root_fd: int | None = None
        self._root_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the root last scan
        self._held: dict[str, _Held] = {}  # container directory name -> what is kept in it
        self._open_count = 0  # descriptors in _held
        self._listed_before: dict[str, _Dir] = {}
        self._paths: dict[str, str] = {}  # name in the root -> its path
        self.max_open = _fd_bound(self.limits.open_files)
        # Folders this scan could not list (the root's own path when the root's listing
        # failed): what was found in them before is unknown now, not gone.
        self.unlisted: set[str] = set()

    def close(self) -> None:
        """Close every descriptor (the root and the kept ones)."""
        self._close_root()
        for name in list(self._held):
            self._drop_dir(name)

    def is_unlisted(self, folder: str) -> bool:
        """Whether this scan could not list `folder` (a container folder's path as in events),
        or the root."""
        return folder in self.unlisted or self.shown_root in self.unlisted

    @property
    def open_count(self) -> int:
        """Descriptors kept open across scans now."""
        return self._open_count

    def _close_root(self) -> None:
        if self._root_fd is not None:
            os.close(self._root_fd)
            self._root_fd = None

    def _same_root(self, st: os.stat_result) -> None:
        """A root that is another directory now (a filesystem mounted over it, a host path
        replaced) shares nothing with the one before, though a fresh filesystem hands out the
        same inode numbers: what is kept of the old one (descriptors, listings) is dropped."""
        root_id = (st.st_dev, st.st_ino)
        if self._root_id is not None and root_id != self._root_id:
            for name in list(self._held):
                self._drop_dir(name)
            self._dirs = {}
            self._listed_before = {}
        self._root_id = root_id

    def scan(self) -> tuple[list[CacheFile], list[Skipped]]:
        # The root itself is the operator's setting (it may be a symlink, e.g. a host path);
        # everything below it is the tenants'. Reopened each scan in case it was remounted.
        self._close_root()
        self.unlisted = set()
        try:
            self._root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            self._same_root(os.fstat(self._root_fd))
            # scandir(fd) lists a dup of the descriptor: ours keeps its offset for openat.
            entries = sorted(os.scandir(self._root_fd), key=lambda e: e.name)  # stable cid order
        except OSError as exc:
            self.unlisted.add(self.shown_root)
            return [], [Skipped(self.shown_root, f"cannot list the root: {exc.strerror}")]
        skipped: list[Skipped] = []
        dirs: list[tuple[str, str, int]] = []  # (name, path, ctime_ns) of container directories
        held = self._held
        still: set[str] = set()  # kept directories that are still the same directory
        paths, root, root_fd = self._paths, self.shown_root, self._root_fd
        old = time.time_ns() - TIMESTAMP_WINDOW_NS
        for entry in entries:
            name = entry.name
            if not name.isascii() and not utf8(name):
                skipped.append(Skipped(shown_path(os.path.join(root, name)), NOT_UTF8))
                continue
            path = paths.get(name)
            if path is None:
                path = paths[name] = os.path.join(root, name)
            h = held.get(name)
            try:
                if h is not None and entry.inode() == h.ino and entry.is_dir(follow_symlinks=False):
                    # The listing names the kept folder's inode, as a folder: its times are
                    # those of the kept descriptor (no lookup of the name).
                    st = os.fstat(h.fd)
                else:
                    st = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue  # vanished between the listing and the stat
            except OSError as exc:
                # (EIO, a remount): what the folder holds is unknown this scan, not gone
                skipped.append(Skipped(path, f"cannot stat: {exc.strerror}"))
                self.unlisted.add(path)
                continue
            if stat.S_ISLNK(st.st_mode):
                skipped.append(Skipped(path, SYMLINK))
            elif not stat.S_ISDIR(st.st_mode):
                continue
            elif "_" not in name or name.startswith("_"):  # (an empty pod UID is no pod's)
                skipped.append(Skipped(path, "directory name is not podUID_container"))
            else:
                dirs.append((name, path, st.st_ctime_ns))
                # (a folder removed has no links: its inode number may already be another's)
                if h is not None and h.ino == st.st_ino and h.dev == st.st_dev and st.st_nlink:
                    still.add(name)
                    ctime = st.st_ctime_ns
                    h.stamp = (st.st_mtime_ns, ctime) if ctime < old else None
        if len(paths) > 2 * len(entries) + 64:
            self._paths = {e.name: paths[e.name] for e in entries if e.name in paths}
        for name in [n for n in held if n not in still]:
            self._drop_dir(name)  # gone, replaced, or a symlink now
        listings = self.stats.listings
        listed = self._relist(dirs)
        files: list[CacheFile] = []
        large = 0
        for name, path, _ in dirs:
            d = listed[name]
            if d.entries > self.limits.max_entries:
                large += 1
                detail = (
                    f"more than {self.limits.max_entries} entries: "
                    f"listed at most once every {self.limits.relist_s:g} s"
                )
                skipped.append(Skipped(path, detail, "large_directory"))
            files += d.files
            skipped += d.skipped
        self._dirs = listed
        self.stats.large = large
        if self.stats.listings != listings or len(listed) != len(self._listed_before):
            self._release_unlisted(files)  # a listing changed: a kept file may be unlisted now
        self._listed_before = listed
        return files, skipped

    def _release_unlisted(self, files: list[CacheFile]) -> None:
        """Close kept files no longer listed (deleted, renamed, or no longer a cache file)."""
        if not self._open_count:
            return
        listed = {f.path for f in files}
        for dir_name, h in self._held.items():
            if h.files:
                directory = os.path.join(self.shown_root, dir_name)
                for name in [n for n in h.files if os.path.join(directory, n) not in listed]:
                    self._drop_file(h, name)

    def _relist(self, dirs: list[tuple[str, str, int]]) -> dict[str, _Dir]:
        """The listing of each directory: the cached one, or a new one where it is due and the
        scan's budget allows. The longest-unlisted go first, so none waits forever."""
        now = time.monotonic()
        recent = time.time_ns() - TIMESTAMP_WINDOW_NS
        out: dict[str, _Dir] = {}
        due: list[tuple[float, str, str, int]] = []
        known = self._dirs
        for name, path, ctime_ns in dirs:
            cached = known.get(name)
            if cached is not None:
                out[name] = cached
                # The usual case, without a call: unchanged, older than the window, not large.
                if (
                    cached.ctime_ns == ctime_ns
                    and ctime_ns <= recent
                    and cached.entries <= self.limits.max_entries
                ):
                    continue
            if self._due(cached, ctime_ns, now):
                due.append((-1.0 if cached is None else cached.listed_at, name, path, ctime_ns))
        spent = 0.0
        for _, name, path, ctime_ns in sorted(due):
            if name in out and spent >= self.limits.budget_s:
                self.stats.deferred += 1  # keep the last listing; list it next scan
                if out[name].failed:
                    self.unlisted.add(path)  # still unknown, not empty
                continue
            started = time.perf_counter()
            out[name] = self._list(name, path, ctime_ns, now)
            spent += time.perf_counter() - started
        return out

    def _due(self, cached: _Dir | None, ctime_ns: int, now: float) -> bool:
        if cached is None:
            return True
        if cached.entries > self.limits.max_entries:
            return now - cached.listed_at >= self.limits.relist_s
        # A change within the filesystem's timestamp granularity can leave its ctime as it was,
        # so a directory touched in the last two seconds is listed again anyway.
        recent = time.time_ns() - ctime_ns < TIMESTAMP_WINDOW_NS
        return cached.ctime_ns != ctime_ns or recent

    def _list(self, name: str, path: str, ctime_ns: int, now: float) -> _Dir:
        pod_uid, container = name.split("_", 1)  # split on the first '_' only
        self.stats.listings += 1
        d = _Dir(ctime_ns, listed_at=now)
        try:
            fd = self._open_dir(name)
        except FileNotFoundError:
            d.ctime_ns = -1  # gone since the stat: nothing to list
            return d
        except OSError as exc:
            return self._unlisted(d, path, exc)
        regular: list[tuple[bool, bool, int, str, CacheFile]] = []
        prev = self._dirs.get(name)
        before = {f.path for f in prev.files} if prev is not None else set()
        try:
            found: list[str] = []
            with os.scandir(fd) as it:
                for entry in it:
                    d.entries += 1
                    if entry.name.endswith(".cache"):
                        found.append(entry.name)
            for file_name in sorted(found):
                file_path = os.path.join(path, file_name)
                if not file_name.isascii() and not utf8(file_name):
                    d.skipped.append(Skipped(shown_path(file_path), NOT_UTF8))
                    continue
                # An lstat, not the listing's d_type and d_ino: some filesystems give no type
                # (XFS without ftype), and overlayfs's d_ino need not be the st_ino that a
                # later open must find again.
                try:
                    st = os.stat(file_name, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue  # removed since the listing
                if stat.S_ISLNK(st.st_mode):
                    d.skipped.append(Skipped(file_path, SYMLINK))
                elif not stat.S_ISREG(st.st_mode):
                    d.skipped.append(Skipped(file_path, NOT_REGULAR))
                else:
                    f = CacheFile(pod_uid, container, file_path, st.st_ino, st.st_dev)
                    big = st.st_size >= MIN_REGION
                    regular.append((big, file_path in before, st.st_ctime_ns, file_name, f))
        except OSError as exc:
            return self._unlisted(d, path, exc)
        finally:
            os.close(fd)
        if len(regular) > MAX_FILES:
            # The tenant's own files, and times: empty files changed later than the container's
            # real one (a live file's ctime barely moves) pushed it out, and its container was
            # gone. A file the size of a cache file, and one read before, go first.
            d.skipped.append(Skipped(path, MANY_FILES, "large_directory"))
            first = sorted(regular, key=lambda r: r[:4], reverse=True)[:MAX_FILES]
            regular = sorted(first, key=lambda r: r[3])
        d.files = [r[4] for r in regular]
        return d

    def _unlisted(self, d: _Dir, path: str, exc: OSError) -> _Dir:
        if exc.errno == errno.ELOOP:
            d.skipped.append(Skipped(path, SYMLINK))  # swapped for a symlink: not ours now
        else:
            d.skipped.append(Skipped(path, f"cannot list: {exc.strerror}"))
            d.failed = True
            self.unlisted.add(path)
        d.ctime_ns = -1  # never a cache hit: list it again next scan
        return d

    def open(self, f: CacheFile) -> Opened | Skipped:
        """A read-only descriptor of `f`, opened beneath the root through no symlink (or kept
        from an earlier scan while its name still is that file), or why it is refused. Raises
        FileNotFoundError when it is gone and OSError when it cannot be opened for another
        reason."""
        if self._root_fd is None:
            raise FileNotFoundError(2, "the root is not open", f.path)
        dir_name, name = f.names
        h = self._held.get(dir_name)
        kept = h.files.get(name) if h is not None else None
        if h is not None and kept is not None:
            stamp = h.stamp
            try:
                if stamp is not None and kept[3] == stamp:
                    # Nothing in the folder was created, removed or renamed since the name was
                    # last checked (its times are as then, and were old enough to change with
                    # any change): the name is still the kept file. The file's own `fstat`
                    # gives its links and size.
                    st = os.fstat(kept[0])
                else:
                    st = os.stat(name, dir_fd=h.fd, follow_symlinks=False)
            except OSError:
                self._drop_file(h, name)
                raise
            if st.st_ino == kept[2] and st.st_dev == kept[1] and stat.S_ISREG(st.st_mode):
                if st.st_nlink > 1:
                    self._drop_file(h, name)
                    return _hard_linked(f.path, st.st_nlink)
                if kept[3] != stamp:
                    h.files[name] = (kept[0], kept[1], kept[2], stamp)
                return Opened(kept[0], st, True)
            self._drop_file(h, name)  # replaced: open what the name is now
        try:
            dir_fd, dir_kept = self._dir_fd(dir_name)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return Skipped(os.path.dirname(f.path), SYMLINK)
            raise
        try:
            opened = self._open_regular(name, dir_fd, f, dir_name)
        finally:
            if not dir_kept:
                os.close(dir_fd)
        if isinstance(opened, Skipped):
            return opened
        fd, st = opened
        h = self._held.get(dir_name)
        if h is not None and self._open_count < self.max_open:
            h.files[name] = (fd, st.st_dev, st.st_ino, None)
            self._open_count += 1
            return Opened(fd, st, True)
        return Opened(fd, st, False)

    def _open_regular(
        self, name: str, dir_fd: int, f: CacheFile, dir_name: str
    ) -> tuple[int, os.stat_result] | Skipped:
        """The listed file `f`, by its `name` in the folder `dir_fd`, opened for reading if it
        still is that file and a regular one with one link. The name is looked up once, into
        an `O_PATH` descriptor (which opens nothing: no device acts on it, no FIFO blocks), and
        what that descriptor is is what gets opened. A name that is not what the listing found
        has the folder listed again at the next scan: its ctime may not have moved (a change
        in the same timestamp tick as the one before the listing)."""
        try:
            path_fd = os.open(name, _PATH_FLAGS, dir_fd=dir_fd)
        except FileNotFoundError:
            self._list_again(dir_name)
            raise
        try:
            st = os.fstat(path_fd)
            if stat.S_ISLNK(st.st_mode):  # (O_PATH|O_NOFOLLOW gives the link itself)
                self._list_again(dir_name)
                return Skipped(f.path, SYMLINK)
            if not stat.S_ISREG(st.st_mode):
                self._list_again(dir_name)
                return Skipped(f.path, NOT_REGULAR)
            if st.st_ino != f.ino or st.st_dev != f.dev:
                # Another file by the listed name: the listed one is gone, this one is new
                # (a file is identified by its inode) and is read once the folder is listed.
                self._list_again(dir_name)
                raise FileNotFoundError(errno.ENOENT, "replaced since it was listed", f.path)
            if st.st_nlink > 1:  # (as listed: listing it again would find the same)
                return _hard_linked(f.path, st.st_nlink)
            try:
                fd = os.open(f"/proc/self/fd/{path_fd}", _FILE_FLAGS)
            except FileNotFoundError as exc:  # (no /proc: never a reason to call a file gone)
                raise OSError(errno.EOPNOTSUPP, "cannot open through /proc/self/fd") from exc
            return fd, st
        finally:
            os.close(path_fd)

    def _list_again(self, dir_name: str) -> None:
        listing = self._dirs.get(dir_name)
        if listing is not None:
            listing.ctime_ns = -1

    def _dir_fd(self, name: str) -> tuple[int, bool]:
        """A container directory's descriptor: the kept one, or a new one kept when the bound
        allows (True) or to be closed by the caller (False)."""
        h = self._held.get(name)
        if h is not None:
            return h.fd, True
        fd = self._open_dir(name)
        # Room for the directory and one file in it, or neither is kept.
        if self._open_count + 2 <= self.max_open:
            try:
                st = os.fstat(fd)
            except OSError:
                os.close(fd)
                raise
            self._held[name] = _Held(fd, st.st_dev, st.st_ino)
            self._open_count += 1
            return fd, True
        return fd, False

    def _drop_file(self, h: _Held, name: str) -> None:
        kept = h.files.pop(name, None)
        if kept is not None:
            os.close(kept[0])
            self._open_count -= 1

    def _drop_dir(self, name: str) -> None:
        h = self._held.pop(name)
        for fd, _, _, _ in h.files.values():
            os.close(fd)
        os.close(h.fd)
        self._open_count -= 1 + len(h.files)

    def forget(self, f: CacheFile) -> None:
        """Close `f`'s kept descriptor, if any (the scanner no longer reads it), and its
        folder's once no file in it is kept: a stale folder stays for good and would hold
        both, leaving live containers none. Reading it again opens both anew."""
        dir_name, name = f.names
        h = self._held.get(dir_name)
        if h is not None:
            self._drop_file(h, name)
            if not h.files:
                self._drop_dir(dir_name)

    def _open_dir(self, name: str) -> int:
        """A container directory's descriptor. Raises OSError with ELOOP for a symlink and
        FileNotFoundError for something that is no longer a directory."""
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=self._root_fd)
        except NotADirectoryError:
            # O_DIRECTORY|O_NOFOLLOW answers ENOTDIR for a symlink as for a file: tell them apart.
            st = os.stat(name, dir_fd=self._root_fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), name) from None
            raise FileNotFoundError(errno.ENOENT, "no longer a directory", name) from None


def _hard_linked(path: str, links: int) -> Skipped:
    return Skipped(path, f"a hard-linked file ({links} links): not read")


def _fd_bound(wanted: int) -> int:
    """`wanted`, or fewer where RLIMIT_NOFILE would not leave FD_RESERVE descriptors for the
    rest. The soft limit is raised towards the hard one first, as Go programs do at start."""
    if wanted <= 0:
        return 0
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        need = wanted + FD_RESERVE
        if soft != resource.RLIM_INFINITY and soft < need:
            raised = need if hard == resource.RLIM_INFINITY else min(need, hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
    except (OSError, ValueError):
        return 0
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(0, min(wanted, soft - FD_RESERVE))
