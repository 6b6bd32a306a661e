"""A disk that really fills and frees, for tests of what the collector does on a full disk.

As root (and where mounting is allowed) it is a small tmpfs mounted under the test's folder:
`fill()` writes a filler file until the kernel answers ENOSPC, `free()` deletes it. Elsewhere
(an unprivileged CI container) it is the kernel's file-size limit of the writing process
(RLIMIT_FSIZE, set with prlimit): `fill()` lowers it to the files' current sizes, so the next
write fails with EFBIG, and `free()` lifts it. Both are real write errors from the kernel at the
same boundary; `HAMI_USAGE_TEST_FULL_DISK=rlimit` forces the second kind.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path


class FullDisk:
    def __init__(self, directory: Path, kind: str) -> None:
        self.directory = directory
        self.kind = kind
        self.pid: int | None = None  # the writer whose file-size limit stands for the disk
        self.full = False
        self._saved = resource.getrlimit(resource.RLIMIT_FSIZE)

    @property
    def errno(self) -> int:
        return errno.ENOSPC if self.kind == "tmpfs" else errno.EFBIG

    @property
    def strerror(self) -> str:
        return os.strerror(self.errno)

    def attach(self, pid: int) -> None:
        self.pid = pid
        if self.full:
            self.fill()

    def _newest_segment(self) -> int:
        segments = sorted(self.directory.rglob("*.log"), key=lambda p: p.name)
        return segments[-1].stat().st_size if segments else 0

    def fill(self, page_room: bool = False) -> None:
        """A full tmpfs still takes writes into the last page a file already has (a write
        across its end is cut short there); `page_room` makes the file-size limit do the same
        (by default it stops at the newest segment's current size)."""
        self.full = True
        if self.kind == "tmpfs":
            chunk = b"\0" * (64 * 1024)
            with (self.directory / "filler").open("ab", buffering=0) as f:
                with contextlib.suppress(OSError):
                    while True:
                        f.write(chunk)
                with contextlib.suppress(OSError):
                    while True:
                        f.write(b"\0")
        elif self.pid is not None:
            self._saved = resource.prlimit(self.pid, resource.RLIMIT_FSIZE)
            limit = self._newest_segment()
            if page_room:
                page = resource.getpagesize()
                limit = -(-limit // page) * page
            resource.prlimit(self.pid, resource.RLIMIT_FSIZE, (limit, self._saved[1]))

    def free(self) -> None:
        self.full = False
        if self.kind == "tmpfs":
            (self.directory / "filler").unlink(missing_ok=True)
        elif self.pid is not None:
            hard = self._saved[1]
            with contextlib.suppress(ProcessLookupError):
                resource.prlimit(self.pid, resource.RLIMIT_FSIZE, (hard, hard))

    def preexec(self, limit: int | None = None) -> Callable[[], None] | None:
        """For a writer started while the disk is full (rlimit kind): no file of it grows past
        `limit` bytes (by default the newest segment's size)."""
        if self.kind != "rlimit" or not self.full:
            return None
        if limit is None:
            limit = self._newest_segment()
        hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
        return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))


@contextlib.contextmanager
def full_disk(directory: Path, size: int = 4 * 1024 * 1024) -> Iterator[FullDisk]:
    directory.mkdir(parents=True, exist_ok=True)
    kind = os.environ.get("HAMI_USAGE_TEST_FULL_DISK", "")
    if kind != "rlimit" and os.geteuid() == 0:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "hami-usage-test", str(directory)],
            capture_output=True,
            check=False,
        )
        kind = "tmpfs" if done.returncode == 0 else "rlimit"
    else:
        kind = "rlimit"
    try:
        yield FullDisk(directory, kind)
    finally:
        if kind == "tmpfs":
            subprocess.run(["umount", "-l", str(directory)], check=False)
