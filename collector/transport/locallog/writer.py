"""The single writer of a log directory.

Only the writer changes segment files: it appends to the newest one, truncates a torn tail of
the newest one when it opens, and deletes whole older segments.

A write that cannot happen - the disk is full (ENOSPC, EDQUOT, EFBIG), an I/O error (EIO), or
the log's own size bound - is one condition, a *blocked* episode: the record is rejected and
counted, nothing is raised, and the log keeps trying. Records it had already accepted stay in
memory and are written, at the same file position, once the disk takes them again; records it
had written are never touched.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Final

from .checkpoint import (
    CHECKPOINT_SUFFIX,
    CONSUMERS_DIR,
    GROUP_NAME,
    Checkpoint,
    CorruptCheckpointError,
    fsync_dir,
    load_checkpoint,
    store_checkpoint,
)
from .frames import (
    BODY_HEAD,
    FRAME_OVERHEAD,
    LENGTH_AND_CRC,
    LENGTH_FIELD,
    ScanEnd,
    list_segments,
    segment_name,
    walk_frames,
)

log = logging.getLogger(__name__)
# What a filesystem without fsync answers; the records are on it all the same.
_FSYNC_REFUSED = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS})

_MIB = 1024 * 1024
MAX_SEGMENT_BYTES: Final = 8 * _MIB
MIN_SEGMENT_BYTES: Final = 4096
_MAX_KEY = 0xFFFF
_I64_MIN = -(2**63)
_I64_MAX = 2**63 - 1
_LOCK_NAME = "writer.lock"

# Appends are gathered in memory and written with one syscall; readers see them after flush().
_WRITE_BUFFER_BYTES = 64 * 1024
# While blocked by the disk, an append retries the write at most this often (a flush always
# does): a full disk answers at once, but there is no point asking thousands of times a scan.
_RETRY_EVERY_S = 0.1


class LogOpenError(RuntimeError):
    """The log cannot be opened for writing; the message is one line."""


class LogLockedError(LogOpenError):
    """Another process (or another LocalLog in this one) holds the log's writer lock."""


@dataclass(slots=True)
class WriterStats:
    appended_records: int = 0
    rejected_records: int = 0  # by the size bound or by the disk, while blocked
    rejected_bytes: int = 0  # on-disk size (frame bytes) the rejected records would have taken
    torn_tail_bytes: int = 0  # cut from the newest segment by crash recovery on open
    damaged_frames: int = 0  # found (and kept: readers pass over them) by recovery on open
    reclaimed_bytes: int = 0  # deleted by the size bound to make room for appends
    write_errors: int = 0  # failed writes or fsyncs (each retried)
    blocked_episodes: int = 0  # times the log went from writing to rejecting
    unwritten_records: int = 0  # accepted, still unwritten at close: lost


class LocalLog:
    """The single writer of a log directory. Not thread-safe.

    Appended records become visible to readers at flush() (or earlier, when the write buffer
    fills); with fsync=True, flush() also makes them durable across power loss. A record that
    append() accepted is only lost if the process dies before a flush() manages to write it.

    A segment is rolled before a record would take it past segment_bytes, so segments only
    exceed it when a single record does. When the segments would exceed max_bytes, segments
    that every consumer group has committed past are deleted first; if that is not enough the
    record is rejected and counted.

    segment_bytes defaults to an eighth of max_bytes, at most 8 MiB (at least 4 KiB): whole
    segments must fall below a consumer that commits behind what it read. An aggregator of the
    log commits the earliest event its open windows need (minutes behind), and its windows
    close only with later events: with one 8 MiB segment under a 20 000-byte bound, nothing
    fell below its commit and no event got in again (1238 dropped in 9 minutes).
    """

    def __init__(
        self,
        directory: Path,
        *,
        segment_bytes: int | None = None,
        max_bytes: int = 256 * _MIB,
        fsync: bool = False,
    ) -> None:
        if segment_bytes is None:
            segment_bytes = min(MAX_SEGMENT_BYTES, max(MIN_SEGMENT_BYTES, max_bytes // 8))
        if segment_bytes < 1 or max_bytes < 1:
            raise ValueError("segment_bytes and max_bytes must be positive")
        self._dir = directory
        self._segment_bytes = segment_bytes
        self._max_bytes = max_bytes
        self._fsync = fsync
        self.stats = WriterStats()
        self._pending = bytearray()
        self._unsynced = False
        self._sync_failing = False  # fsync refused since the last flush that it took
        self._closed = False
        self._io_error: OSError | None = None  # the last failed write, until one succeeds
        self._blocked: str | None = None  # why appends are rejected, during an episode
        self.last_block: str | None = None  # why the last episode began
        self._need = 0  # frame bytes of the record the size bound rejected last, this episode
        self._unread: str | None = None  # why the consumers' checkpoints could not be read
        self._last_retry = 0.0
        self._fd: int | None = None  # the newest segment; None until the disk let it be created
        # Sealed segments the size bound let go while they held the last record written: out
        # of the bound's count at once, unlinked once a later record is written (see _make_room).
        self._doomed: list[int] = []
        directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = self._lock()
        try:
            self._open_segments()
            self._rewind_checkpoints()
        except BaseException:
            if self._fd is not None:
                os.close(self._fd)
            os.close(self._lock_fd)
            raise

    def _lock(self) -> int:
        try:
            fd = os.open(self._dir / _LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            # A first start on a full disk: without its lock no writer may open the log (a
            # supervisor restarts the collector, which opens it once the disk takes the file).
            raise LogOpenError(f"{self._dir}: cannot create {_LOCK_NAME}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise LogLockedError(
                f"{self._dir} is already open for writing (lock holder pid {holder})"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        # The pid is only there to make the error above useful: a full disk may refuse it.
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
        return fd

    def _open_segments(self) -> None:
        self._bases = list_segments(self._dir)
        if not self._bases:
            self._bases = [0]
            self._sizes = [0]
            self._next_offset = 0
            try:
                self._fd = self._create_segment(0)
            except OSError as exc:
                # A first start on a full disk: blocked from the start, like a failed write;
                # the segment is created by the first retry the disk takes.
                self._failed(exc)
                self._block(_describe(exc))
        else:
            self._sizes = [os.stat(self._dir / segment_name(b)).st_size for b in self._bases]
            self._fd = os.open(self._dir / segment_name(self._bases[-1]), os.O_RDWR)
            self._recover_active()
        self._total_bytes = sum(self._sizes)
        self._written_offset = self._next_offset  # records below this reached the OS
        self.opened_end = self._next_offset  # where the log ended when this writer opened it

    def _rewind_checkpoints(self) -> None:
        """Move every consumer checkpoint that lies past where the log ends back to that end.

        Checkpoints are fsync'd and segments are not (unless `fsync`): after a power loss the
        log can end below a checkpoint, and the records appended from now on take offsets the
        consumer would skip. Its metadata is kept (the aggregator's says which windows it has
        emitted, so none is emitted twice). An unreadable checkpoint (or folder of them) is left
        to its consumer.
        """
        try:
            consumers = self._consumers()
        except OSError:
            return
        for group, path in consumers:
            try:
                checkpoint = load_checkpoint(path)
            except (CorruptCheckpointError, OSError):
                continue
            if checkpoint is None or checkpoint.offset <= self.opened_end:
                continue
            try:
                store_checkpoint(path, group, Checkpoint(self.opened_end, checkpoint.metadata))
            except OSError as exc:
                log.error(
                    "local log %s: checkpoint of group %s is at offset %d, past where the log "
                    "ends (%d; segments lost in a crash), and could not be moved back (%s): "
                    "that consumer skips the records appended up to its offset",
                    self._dir,
                    group,
                    checkpoint.offset,
                    self.opened_end,
                    _describe(exc),
                )
                continue
            log.warning(
                "local log %s: checkpoint of group %s was at offset %d, past where the log ends "
                "(segments lost in a crash): moved back to %d",
                self._dir,
                group,
                checkpoint.offset,
                self.opened_end,
            )

    def _recover_active(self) -> None:
        """Cut the newest segment back to the end of its last valid frame (a crash can tear
        the tail). Damaged frames before that are not a torn tail: they and every valid frame
        after them stay, and readers pass over them."""
        base, size = self._bases[-1], self._sizes[-1]
        end = ScanEnd()

        def damaged(_pos: int, _offset: int, _next_pos: int, _next_offset: int) -> None:
            self.stats.damaged_frames += 1

        with open(self._dir / segment_name(base), "rb") as f:
            for _ in walk_frames(f, size, 0, base, base, end, None, None, damaged):
                pass
        if end.pos < size:
            fd = self._active_fd()
            os.ftruncate(fd, end.pos)
            if self._fsync:
                self._sync()
            self.stats.torn_tail_bytes += size - end.pos
            self._sizes[-1] = end.pos
        self._next_offset = end.offset

    def _active_fd(self) -> int:
        """The newest segment's descriptor, creating the file if a full disk refused it."""
        if self._fd is None:
            self._fd = self._create_segment(self._bases[-1])
        return self._fd

    def _create_segment(self, base: int) -> int:
        fd = os.open(self._dir / segment_name(base), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        if self._fsync:
            _fsync_quietly(self._dir)
        return fd

    @property
    def next_offset(self) -> int:
        return self._next_offset

    @property
    def first_offset(self) -> int:
        return self._bases[0]

    @property
    def blocked(self) -> str | None:
        """Why appends are being rejected (disk error or size bound), or None while writing."""
        return self._blocked

    @property
    def unwritten(self) -> int:
        """Records accepted but not yet handed to the OS (held while the disk refuses them)."""
        return self._next_offset - self._written_offset

    def append(
        self, key: bytes, value: bytes, timestamp_ms: int, *, beyond_bound: bool = False
    ) -> int | None:
        """Store a record and return its offset, or None when it is rejected: the disk
        refuses writes or the size bound is reached (see `blocked`). `beyond_bound`: the
        size bound does not reject it (a writer's last words, which say what it dropped)."""
        self._check_open()
        if len(key) > _MAX_KEY:
            raise ValueError(f"key of {len(key)} bytes is longer than {_MAX_KEY}")
        if not _I64_MIN <= timestamp_ms <= _I64_MAX:
            raise ValueError(f"timestamp_ms {timestamp_ms} does not fit in 64 bits")
        n = FRAME_OVERHEAD + len(key) + len(value)
        if self._io_error is not None:
            now = time.monotonic()
            if now - self._last_retry < _RETRY_EVERY_S or not self._retry():
                self._reject(n, _describe(self._io_error))
                return None
        # While the size bound rejects, a record fits only once the one it rejected would:
        # a smaller one slipping in would end the episode at once and put events in the log
        # after the ones they follow were dropped (one that can never fit does not wedge it).
        need = max(n, self._need) if n <= self._max_bytes else n
        if beyond_bound:
            self._make_room(n)  # (what it can; the record goes in regardless)
        elif self._total_bytes + need > self._max_bytes and not self._make_room(need):
            if n <= self._max_bytes:
                self._need = need
            reason = f"size bound of {self._max_bytes} bytes reached"
            if self._unread is not None:
                reason += f" (consumer checkpoints unreadable: {self._unread})"
            self._reject(n, reason)
            return None
        self._need = 0
        try:
            active_bytes = self._sizes[-1] + len(self._pending)
            if active_bytes > 0 and active_bytes + n > self._segment_bytes:
                self._roll()
            elif len(self._pending) + n > _WRITE_BUFFER_BYTES:
                self._write_pending()
        except OSError as exc:
            self._failed(exc)
            self._reject(n, _describe(exc))
            return None
        # Only from here on is the record given an offset: if anything above failed, it was
        # simply not stored, and the caller was told.
        offset = self._next_offset
        body = BODY_HEAD.pack(offset, timestamp_ms, len(key))
        crc = zlib.crc32(value, zlib.crc32(key, zlib.crc32(body)))
        self._pending += LENGTH_AND_CRC.pack(n - LENGTH_FIELD, crc)
        self._pending += body
        self._pending += key
        self._pending += value
        self._next_offset = offset + 1
        self._total_bytes += n
        self.stats.appended_records += 1
        if self._io_error is None and not beyond_bound:
            self._blocked = None
        return offset

    def flush(self) -> None:
        """Hand buffered records to the OS (visible to readers); with fsync, make them durable.
        A disk that refuses them does not raise: the records stay buffered, the log is
        blocked, and the next flush (or append) tries again."""
        self._check_open()
        try:
            self._write_pending()
        except OSError as exc:
            self._failed(exc)
            self._block(_describe(exc))
            return
        self._io_error = None
        if self._fsync and self._unsynced:
            try:
                self._sync()
            except OSError as exc:
                self._failed(exc)
                self._block(_describe(exc))

    def _sync(self) -> None:
        """fsync the active segment. A refusal (a filesystem without fsync: some FUSE and
        network ones) is counted and logged once an episode, and the records stay accepted:
        they are written, only not durable, and nothing is held back to retry. Any other
        error (EIO, ENOSPC at writeback: what was written may be lost) raises, as a failed
        write does."""
        try:
            os.fsync(self._active_fd())
        except OSError as exc:
            if exc.errno not in _FSYNC_REFUSED:
                raise
            self.stats.write_errors += 1
            if not self._sync_failing:
                log.error(
                    "local log %s: fsync refused (%s): records are written but not durable "
                    "across a power loss; tried again at each flush",
                    self._dir,
                    _describe(exc),
                )
            self._sync_failing = True
            return
        self._unsynced = False
        if self._sync_failing:
            log.warning("local log %s: fsync works again", self._dir)
        self._sync_failing = False

    def close(self) -> None:
        """Write what is buffered; what the disk still refuses is lost, and counted in
        `stats.unwritten_records` (the records not wholly on disk)."""
        if self._closed:
            return
        try:
            self.flush()
            if self._pending:
                with contextlib.suppress(OSError):
                    self._keep_whole_frames()
        finally:
            self._closed = True
            self.stats.unwritten_records = self.unwritten
            if self._fd is not None:
                os.close(self._fd)
            os.close(self._lock_fd)

    def _keep_whole_frames(self) -> None:
        """After a final write that failed part way: the records of the buffer that did reach
        the file whole stay written (and are not counted lost); the torn one after them is cut,
        as the next open would."""
        if self._fd is None:
            return
        position = self._sizes[-1]
        on_disk = os.pread(self._fd, len(self._pending), position)
        kept = records = 0
        while kept + LENGTH_FIELD <= len(on_disk):
            n = LENGTH_FIELD + int.from_bytes(self._pending[kept : kept + LENGTH_FIELD], "little")
            if (
                kept + n > len(on_disk)
                or on_disk[kept : kept + n] != self._pending[kept : kept + n]
            ):
                break
            kept += n
            records += 1
        self._pending = self._pending[kept:]
        self._sizes[-1] = position + kept
        self._written_offset += records
        with contextlib.suppress(OSError):  # else the next open cuts the torn frame
            os.ftruncate(self._fd, position + kept)
            if self._fsync:
                os.fsync(self._fd)

    def __enter__(self) -> LocalLog:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def release_before(self, offset: int) -> int:
        """Delete sealed segments whose records all lie below `offset`; return bytes freed."""
        self._check_open()
        freed = 0
        while len(self._bases) > 1 and self._bases[1] <= offset:
            freed += self._delete_oldest()
        return freed

    def retain_from(self) -> int | None:
        """Lowest offset some consumer still needs, or None when no consumer has committed.

        A checkpoint beyond what this writer has handed to the OS cannot be the result of
        reading this log (it is stale, e.g. from a log that used to live here), so it only
        counts up to there. An unreadable checkpoint keeps everything, and so do checkpoints
        that cannot be read now (out of descriptors, an I/O error).
        """
        self._unread = None
        try:
            checkpoints = [load_checkpoint(path) for _, path in self._consumers()]
        except CorruptCheckpointError as exc:
            self._unread = exc.unreadable  # (None for one that reads but does not decode)
            return self.first_offset
        except OSError as exc:
            self._unread = _describe(exc)
            return self.first_offset
        offsets = [c.offset for c in checkpoints if c is not None]
        return min(min(offsets), self._written_offset) if offsets else None

    def _consumers(self) -> list[tuple[str, Path]]:
        """(group, checkpoint file) of every consumer that committed, by group name."""
        try:
            names = sorted(os.listdir(self._dir / CONSUMERS_DIR))
        except FileNotFoundError:
            return []
        out = []
        for name in names:
            group = name.removesuffix(CHECKPOINT_SUFFIX)
            if name != group and GROUP_NAME.match(group):  # not a temp file of a commit, a stray
                out.append((group, self._dir / CONSUMERS_DIR / name))
        return out

    def _reject(self, n: int, reason: str) -> None:
        self.stats.rejected_records += 1
        self.stats.rejected_bytes += n
        self._block(reason)

    def _block(self, reason: str) -> None:
        if self._blocked is None:
            self.stats.blocked_episodes += 1
            self.last_block = reason
        self._blocked = reason

    def _failed(self, exc: OSError) -> None:
        self.stats.write_errors += 1
        self._io_error = exc
        self._last_retry = time.monotonic()

    def _retry(self) -> bool:
        """Try the write that failed again (the buffered records, at their position)."""
        self._last_retry = time.monotonic()
        try:
            self._write_pending()
        except OSError as exc:
            self._failed(exc)
            return False
        self._io_error = None
        return True

    def _make_room(self, n: int) -> bool:
        """Delete segments every consumer is done with until `n` more bytes fit the bound."""
        self._unread = None  # (said only of this attempt)
        if n > self._max_bytes:
            return False
        retain = self.retain_from()
        if retain is None:
            return False
        while (
            self._total_bytes + n > self._max_bytes
            and len(self._bases) > 1
            and self._bases[1] <= retain
        ):
            self.stats.reclaimed_bytes += self._delete_oldest()
        if (
            self._total_bytes + n > self._max_bytes
            and retain >= self._next_offset
            and self._sizes[-1] + len(self._pending) > 0
        ):
            # Consumers have read even the active segment: seal it so it can go too, or a
            # bound smaller than one segment would wedge the log.
            try:
                self._roll()
            except OSError as exc:
                self._failed(exc)
                return False
            # The segment just sealed holds the last record written, which a restart reads for
            # the last event time (its clock never starts before it): unlinked now, a kill
            # before the next write left no record at all, and the restart began at the wall
            # clock (behind its last event after a step back).
            while len(self._bases) > 1:
                self.stats.reclaimed_bytes += self._delete_oldest(later=True)
        return self._total_bytes + n <= self._max_bytes

    def _delete_oldest(self, *, later: bool = False) -> int:
        """Let the oldest segment go: unlinked now, or (`later`) once a later record is
        written (with `fsync`, once it is durable)."""
        base, size = self._bases[0], self._sizes[0]
        if later:
            self._doomed.append(base)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._dir / segment_name(base))
        del self._bases[0], self._sizes[0]
        self._total_bytes -= size
        return size

    def _roll(self) -> None:
        self._write_pending()
        if self._fsync and self._unsynced:
            self._sync()
        fd = self._create_segment(self._next_offset)
        os.close(self._active_fd())
        self._fd = fd
        self._bases.append(self._next_offset)
        self._sizes.append(0)

    def _write_pending(self) -> None:
        fd = self._active_fd()
        if not self._pending:
            return
        position = self._sizes[-1]
        written = 0
        # pwrite at an explicit position: if a write fails part way, the retry overwrites the
        # same bytes instead of appending after a torn frame.
        with memoryview(self._pending) as view:
            while written < len(view):
                written += os.pwrite(fd, view[written:], position + written)
        self._sizes[-1] = position + written
        self._pending.clear()
        self._unsynced = True
        self._written_offset = self._next_offset
        if self._doomed:
            if self._fsync:
                self._sync()
            for base in self._doomed:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._dir / segment_name(base))
            self._doomed.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("I/O operation on closed LocalLog")


def _describe(exc: OSError) -> str:
    return exc.strerror or str(exc)


def _fsync_quietly(directory: Path) -> None:
    # A directory fsync after creating a segment hardens durability; a disk that refuses it
    # will refuse the segment's first write as well, and that one is handled.
    with contextlib.suppress(OSError):
        fsync_dir(directory)
