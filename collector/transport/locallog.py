"""Append-only, checksummed, segmented log on local disk.

Used instead of Kafka when no broker is configured (an aggregator in another process reads the
same directory) and as the collector's outage spool (events go here while Kafka is down and are
drained in order when it returns).

Layout of a log directory::

    00000000000000000000.log   segment files, named by the offset of their first record
    00000000000000004096.log
    writer.lock                flock'd by the single writer process
    consumers/<group>.json     consumer checkpoints (next offset to read + metadata)

Frame of one record, little-endian::

    u32 length      bytes of the frame after this field
    u32 crc32       zlib.crc32 of the frame after this field
    u64 offset      dense, starting at 0
    i64 timestamp_ms
    u16 key_len
    key bytes, value bytes

Only the writer changes segment files: it appends to the newest one, truncates a torn tail of
the newest one when it opens, and deletes whole older segments. Readers take no lock, so they
treat an incomplete frame at the end of the newest segment as "not written yet".
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import os
import re
import struct
import tempfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Annotated, BinaryIO

import msgspec

__all__ = [
    "FRAME_OVERHEAD",
    "CorruptCheckpointError",
    "LocalLog",
    "LogLockedError",
    "LogReader",
    "LogRecord",
    "ReaderStats",
    "WriterStats",
]

_MIB = 1024 * 1024

_FRAME_HEAD = struct.Struct("<IIQqH")  # length, crc32, offset, timestamp_ms, key_len
_BODY_HEAD = struct.Struct("<QqH")  # the part of the head covered by the crc
_LENGTH_AND_CRC = struct.Struct("<II")
_LENGTH = struct.Struct("<I")
FRAME_OVERHEAD = _FRAME_HEAD.size  # bytes a record takes on disk besides its key and value
_LENGTH_FIELD = _LENGTH.size
_CRC_END = _LENGTH_AND_CRC.size  # the crc covers the frame from here on
_MIN_LENGTH = FRAME_OVERHEAD - _LENGTH_FIELD  # the length field of a frame with empty key/value
_MAX_KEY = 0xFFFF
_I64_MIN = -(2**63)
_I64_MAX = 2**63 - 1

_SEGMENT_SUFFIX = ".log"
_SEGMENT_NAME = re.compile(r"^(\d{20})\.log$")
_LOCK_NAME = "writer.lock"
_CONSUMERS_DIR = "consumers"
_CHECKPOINT_SUFFIX = ".json"
# Group names become file names, so they are kept to a portable, traversal-free alphabet.
_GROUP_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,199}$")

# Appends are gathered in memory and written with one syscall; readers see them after flush().
_WRITE_BUFFER_BYTES = 64 * 1024
# Readers parse frames from memory, reading a segment in chunks that start small (a poll at
# the tail or a short read should not copy megabytes) and double up to a cap.
_READ_CHUNK_MIN_BYTES = 64 * 1024
_READ_CHUNK_MAX_BYTES = 1 * _MIB
# A reader remembers the position of one frame per this many bytes of a segment, so a read
# from an arbitrary offset re-walks at most this much of the segment.
_INDEX_INTERVAL_BYTES = 16 * 1024


class LogLockedError(RuntimeError):
    """Another process (or another LocalLog in this one) holds the log's writer lock."""


class CorruptCheckpointError(ValueError):
    """A consumer checkpoint file exists but cannot be decoded."""


class LogRecord(msgspec.Struct, frozen=True):
    offset: int
    timestamp_ms: int
    key: bytes
    value: bytes


@dataclass(slots=True)
class WriterStats:
    appended_records: int = 0
    rejected_records: int = 0
    rejected_bytes: int = 0  # on-disk size (frame bytes) the rejected records would have taken
    torn_tail_bytes: int = 0  # cut from the newest segment by crash recovery on open
    reclaimed_bytes: int = 0  # deleted by the size bound to make room for appends


@dataclass(slots=True)
class ReaderStats:
    corrupt_frames: int = 0  # distinct invalid frames met inside sealed segments
    # Distinct offsets the reader skipped without returning: segments deleted before they were
    # read, and the unreadable rest of a sealed segment after a corrupt frame.
    missing_records: int = 0


class _Checkpoint(msgspec.Struct, frozen=True):
    offset: Annotated[int, msgspec.Meta(ge=0)]
    metadata: str = ""


_checkpoint_encoder = msgspec.json.Encoder()
_checkpoint_decoder = msgspec.json.Decoder(_Checkpoint)


def _segment_name(base_offset: int) -> str:
    return f"{base_offset:020d}{_SEGMENT_SUFFIX}"


def _list_segments(directory: Path) -> list[int]:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    bases = []
    for name in names:
        match = _SEGMENT_NAME.match(name)
        if match:
            bases.append(int(match.group(1)))
    bases.sort()
    return bases


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _checkpoint_path(directory: Path, group: str) -> Path:
    if not _GROUP_NAME.match(group):
        raise ValueError(f"invalid consumer group name {group!r}")
    return directory / _CONSUMERS_DIR / f"{group}{_CHECKPOINT_SUFFIX}"


def _load_checkpoint(path: Path) -> _Checkpoint | None:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return _checkpoint_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise CorruptCheckpointError(f"{path}: {exc}") from exc


@dataclass(slots=True)
class _SegmentState:
    """What a reader has verified about one segment file, so it never re-walks it needlessly."""

    base: int
    inode: int
    frontier_pos: int = 0  # every frame before this byte position is known valid
    frontier_offset: int = 0
    max_timestamp_ms: int | None = None  # over the frames before the frontier
    index_offsets: list[int] = field(default_factory=list)  # sparse offset -> position
    index_positions: list[int] = field(default_factory=list)
    cursor_offset: int = -1  # where the previous read in this segment stopped
    cursor_pos: int = 0

    def __post_init__(self) -> None:
        self.frontier_offset = self.base
        self.index_offsets.append(self.base)
        self.index_positions.append(0)

    def start_for(self, offset: int) -> tuple[int, int]:
        """The closest known frame boundary at or before `offset`: (position, offset)."""
        if offset >= self.frontier_offset:
            return self.frontier_pos, self.frontier_offset
        i = bisect.bisect_right(self.index_offsets, offset) - 1
        pos, at = self.index_positions[i], self.index_offsets[i]
        if at < self.cursor_offset <= offset:
            return self.cursor_pos, self.cursor_offset
        return pos, at


@dataclass(slots=True)
class _ScanEnd:
    """Where a scan stopped once it ran out of valid frames."""

    pos: int = 0
    offset: int = 0
    clean: bool = True  # at end of file on a frame boundary, rather than at a bad/partial frame


# (file position, offset, timestamp_ms, key_len, buffer, frame start in buffer, frame size)
_Frame = tuple[int, int, int, int, bytes, int, int]


def _scan_frames(
    f: BinaryIO,
    size: int,
    pos: int,
    offset: int,
    verify_from: int,
    end: _ScanEnd,
    state: _SegmentState | None,
) -> Iterator[_Frame]:
    """Yield consecutive valid frames of a segment, starting at a known frame boundary.

    Frames with offset < verify_from lie in a region already verified, so their crc is not
    recomputed. Stops at end of file or at the first frame that is short, has a bad crc or an
    unexpected offset, and then fills `end`. Extends `state` (when given) past its frontier.
    """
    f.seek(pos)
    chunk = _READ_CHUNK_MIN_BYTES
    buf = f.read(min(chunk, size - pos))
    if len(buf) < min(chunk, size - pos):
        size = pos + len(buf)  # truncated since we looked
    buf_pos = pos  # file position of buf[0]
    p = 0
    while True:
        file_pos = buf_pos + p
        avail = len(buf) - p
        want = FRAME_OVERHEAD
        if avail >= _LENGTH_FIELD:
            want = max(want, _LENGTH_FIELD + _LENGTH.unpack_from(buf, p)[0])
        buffered_to = buf_pos + len(buf)
        if avail < want and buffered_to < size and file_pos + want <= size:
            chunk = min(2 * chunk, _READ_CHUNK_MAX_BYTES)
            count = min(max(chunk, want - avail), size - buffered_to)
            more = f.read(count)
            if len(more) < count:
                size = buffered_to + len(more)
            buf = buf[p:] + more
            buf_pos, p = file_pos, 0
            continue
        if avail == 0 and file_pos >= size:
            end.pos, end.offset, end.clean = file_pos, offset, True
            return
        if avail < FRAME_OVERHEAD:
            break
        length, crc, frame_offset, timestamp_ms, key_len = _FRAME_HEAD.unpack_from(buf, p)
        n = _LENGTH_FIELD + length
        if (
            length < _MIN_LENGTH
            or n > avail
            or frame_offset != offset
            or key_len > length - _MIN_LENGTH
            or (offset >= verify_from and zlib.crc32(buf[p + _CRC_END : p + n]) != crc)
        ):
            break
        if state is not None and file_pos >= state.frontier_pos:
            if file_pos - state.index_positions[-1] >= _INDEX_INTERVAL_BYTES:
                state.index_offsets.append(offset)
                state.index_positions.append(file_pos)
            if state.max_timestamp_ms is None or timestamp_ms > state.max_timestamp_ms:
                state.max_timestamp_ms = timestamp_ms
            state.frontier_pos = file_pos + n
            state.frontier_offset = offset + 1
        yield file_pos, offset, timestamp_ms, key_len, buf, p, n
        p += n
        offset += 1
    end.pos, end.offset, end.clean = buf_pos + p, offset, False


class LocalLog:
    """The single writer of a log directory. Not thread-safe.

    Appended records become visible to readers at flush() (or earlier, when the write buffer
    fills); with fsync=True, flush() also makes them durable across power loss. A record that
    append() accepted is only lost if the process dies before the next flush().

    A segment is rolled before a record would take it past segment_bytes, so segments only
    exceed it when a single record does. When the segments would exceed max_bytes, segments
    that every consumer group has committed past are deleted first; if that is not enough the
    record is rejected and counted.
    """

    def __init__(
        self,
        directory: Path,
        *,
        segment_bytes: int = 8 * _MIB,
        max_bytes: int = 256 * _MIB,
        fsync: bool = False,
    ) -> None:
        if segment_bytes < 1 or max_bytes < 1:
            raise ValueError("segment_bytes and max_bytes must be positive")
        self._dir = directory
        self._segment_bytes = segment_bytes
        self._max_bytes = max_bytes
        self._fsync = fsync
        self.stats = WriterStats()
        self._pending = bytearray()
        self._unsynced = False
        self._closed = False
        directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = self._lock()
        try:
            self._open_segments()
        except BaseException:
            os.close(self._lock_fd)
            raise

    def _lock(self) -> int:
        fd = os.open(self._dir / _LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
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
        # The pid is only there to make the error above useful.
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
        return fd

    def _open_segments(self) -> None:
        self._bases = _list_segments(self._dir)
        if not self._bases:
            self._bases = [0]
            self._sizes = [0]
            self._fd = self._create_segment(0)
            self._next_offset = 0
        else:
            self._sizes = [os.stat(self._dir / _segment_name(b)).st_size for b in self._bases]
            self._fd = os.open(self._dir / _segment_name(self._bases[-1]), os.O_RDWR)
            try:
                self._recover_active()
            except BaseException:
                os.close(self._fd)
                raise
        self._total_bytes = sum(self._sizes)
        self._written_offset = self._next_offset  # records below this reached the OS

    def _recover_active(self) -> None:
        """Cut the newest segment back to its last valid frame (a crash can tear the tail)."""
        base, size = self._bases[-1], self._sizes[-1]
        end = _ScanEnd()
        with open(self._dir / _segment_name(base), "rb") as f:
            for _ in _scan_frames(f, size, 0, base, base, end, None):
                pass
        if end.pos < size:
            os.ftruncate(self._fd, end.pos)
            if self._fsync:
                os.fsync(self._fd)
            self.stats.torn_tail_bytes += size - end.pos
            self._sizes[-1] = end.pos
        self._next_offset = end.offset

    def _create_segment(self, base: int) -> int:
        fd = os.open(self._dir / _segment_name(base), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        if self._fsync:
            _fsync_dir(self._dir)
        return fd

    @property
    def next_offset(self) -> int:
        return self._next_offset

    @property
    def first_offset(self) -> int:
        return self._bases[0]

    def append(self, key: bytes, value: bytes, timestamp_ms: int) -> int | None:
        """Store a record and return its offset, or None when the size bound rejects it."""
        self._check_open()
        if len(key) > _MAX_KEY:
            raise ValueError(f"key of {len(key)} bytes is longer than {_MAX_KEY}")
        if not _I64_MIN <= timestamp_ms <= _I64_MAX:
            raise ValueError(f"timestamp_ms {timestamp_ms} does not fit in 64 bits")
        n = FRAME_OVERHEAD + len(key) + len(value)
        if self._total_bytes + n > self._max_bytes and not self._make_room(n):
            self.stats.rejected_records += 1
            self.stats.rejected_bytes += n
            return None
        active_bytes = self._sizes[-1] + len(self._pending)
        if active_bytes > 0 and active_bytes + n > self._segment_bytes:
            self._roll()
        elif len(self._pending) + n > _WRITE_BUFFER_BYTES:
            self._write_pending()
        # Only from here on is the record given an offset: if anything above raised, it was
        # simply not stored, and the caller saw the exception.
        offset = self._next_offset
        body = _BODY_HEAD.pack(offset, timestamp_ms, len(key))
        crc = zlib.crc32(value, zlib.crc32(key, zlib.crc32(body)))
        self._pending += _LENGTH_AND_CRC.pack(n - _LENGTH_FIELD, crc)
        self._pending += body
        self._pending += key
        self._pending += value
        self._next_offset = offset + 1
        self._total_bytes += n
        self.stats.appended_records += 1
        return offset

    def flush(self) -> None:
        """Hand buffered records to the OS (visible to readers); with fsync, make them durable."""
        self._check_open()
        self._write_pending()
        if self._fsync and self._unsynced:
            os.fsync(self._fd)
            self._unsynced = False

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            os.close(self._fd)
            os.close(self._lock_fd)

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
        counts up to there. An unreadable checkpoint keeps everything.
        """
        try:
            names = os.listdir(self._dir / _CONSUMERS_DIR)
        except FileNotFoundError:
            return None
        lowest: int | None = None
        for name in names:
            group = name.removesuffix(_CHECKPOINT_SUFFIX)
            if name == group or not _GROUP_NAME.match(group):
                continue  # temp files of an in-flight commit, strays
            try:
                checkpoint = _load_checkpoint(self._dir / _CONSUMERS_DIR / name)
            except CorruptCheckpointError:
                return self.first_offset
            if checkpoint is not None and (lowest is None or checkpoint.offset < lowest):
                lowest = checkpoint.offset
        return None if lowest is None else min(lowest, self._written_offset)

    def _make_room(self, n: int) -> bool:
        """Delete segments every consumer is done with until `n` more bytes fit the bound."""
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
            self._roll()
            while len(self._bases) > 1:
                self.stats.reclaimed_bytes += self._delete_oldest()
        return self._total_bytes + n <= self._max_bytes

    def _delete_oldest(self) -> int:
        base, size = self._bases[0], self._sizes[0]
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._dir / _segment_name(base))
        del self._bases[0], self._sizes[0]
        self._total_bytes -= size
        return size

    def _roll(self) -> None:
        self._write_pending()
        if self._fsync and self._unsynced:
            os.fsync(self._fd)
            self._unsynced = False
        fd = self._create_segment(self._next_offset)
        os.close(self._fd)
        self._fd = fd
        self._bases.append(self._next_offset)
        self._sizes.append(0)

    def _write_pending(self) -> None:
        if not self._pending:
            return
        position = self._sizes[-1]
        written = 0
        # pwrite at an explicit position: if a write fails part way, the retry by the next
        # flush overwrites the same bytes instead of appending after a torn frame.
        with memoryview(self._pending) as view:
            while written < len(view):
                written += os.pwrite(self._fd, view[written:], position + written)
        self._sizes[-1] = position + written
        self._pending.clear()
        self._unsynced = True
        self._written_offset = self._next_offset

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("I/O operation on closed LocalLog")


class LogReader:
    """Reads a log directory, possibly while a LocalLog in another process appends to it.

    Not thread-safe: use one reader per thread.
    """

    def __init__(self, directory: Path) -> None:
        self._dir = directory
        self.stats = ReaderStats()
        self._segments: dict[int, _SegmentState] = {}
        self._reported_corrupt: set[tuple[int, int, int]] = set()
        self._reported_missing: list[tuple[int, int]] = []  # disjoint, sorted [lo, hi)

    def read(self, from_offset: int, max_records: int = 1000) -> list[LogRecord]:
        """Up to `max_records` valid records in offset order, starting at `from_offset`.

        Starts at the oldest record still on disk if `from_offset` was deleted, and skips the
        rest of a sealed segment after a corrupt frame; both gaps are counted in stats. A bad
        or partial frame in the newest segment ends the read without counting anything: it is
        either still being written, or a torn tail the writer truncates when it next opens (or
        skipped as corrupt once the writer has moved on to a newer segment).
        """
        if from_offset < 0:
            raise ValueError("from_offset must be >= 0")
        if max_records < 1:
            raise ValueError("max_records must be >= 1")
        out: list[LogRecord] = []
        want = from_offset
        bases = self._list()
        while bases:
            if want < bases[0]:
                self._report_missing(want, bases[0])
                want = bases[0]
            i = bisect.bisect_right(bases, want) - 1
            base = bases[i]
            newest = i == len(bases) - 1
            end = self._read_segment(base, want, max_records, out)
            if out:
                want = out[-1].offset + 1
            if len(out) >= max_records:
                break
            if end is None:  # deleted underneath us
                bases = [b for b in self._list() if b != base]
                continue
            if newest:
                if out:
                    break  # the caller polls again; no need to look for a newer segment now
                # Only a newer segment proves the writer is done with this one; without it,
                # a partial frame at the end is one that is still being written.
                fresh = self._list()
                if fresh and fresh[-1] > base:
                    bases = fresh
                    continue
                break
            next_base = bases[i + 1]
            if not end.clean:
                self._report_corrupt(base, end)
            self._report_missing(max(want, end.offset), next_base)
            want = max(want, next_base)
        return out

    def end_offset(self) -> int:
        """The offset the next appended record will get, as far as the disk shows."""
        while True:
            bases = self._list()
            if not bases:
                return 0
            opened = self._open(bases[-1])
            if opened is None:
                continue
            f, state, size = opened
            pos, offset = state.frontier_pos, state.frontier_offset
            end = _ScanEnd()
            with f:
                for _ in _scan_frames(f, size, pos, offset, offset, end, state):
                    pass
            return end.offset

    def offset_for_time(self, timestamp_ms: int) -> int:
        """The earliest offset whose timestamp is >= `timestamp_ms`, or end_offset() if none.

        Timestamps are not assumed to be ordered, so every segment that may hold such a record
        is searched in order; a segment whose largest timestamp is smaller is skipped.
        """
        bases = self._list()
        for i, base in enumerate(bases):
            opened = self._open(base)
            if opened is None:
                continue
            f, state, size = opened
            pos, offset = 0, base
            if state.max_timestamp_ms is None or state.max_timestamp_ms < timestamp_ms:
                pos, offset = state.frontier_pos, state.frontier_offset
            end = _ScanEnd()
            with f:
                for _, at, ts, _, _, _, _ in _scan_frames(
                    f, size, pos, offset, state.frontier_offset, end, state
                ):
                    if ts >= timestamp_ms:
                        return at
            if not end.clean and i < len(bases) - 1:
                self._report_corrupt(base, end)
        return self.end_offset()

    def commit(self, group: str, offset: int, metadata: str = "") -> None:
        """Record that `group` has consumed everything below `offset`.

        The checkpoint file is replaced atomically: after a crash it holds the old or the new
        checkpoint. The writer keeps every segment that any group still needs.
        """
        if offset < 0:
            raise ValueError("offset must be >= 0")
        path = _checkpoint_path(self._dir, group)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _checkpoint_encoder.encode(_Checkpoint(offset, metadata))
        # Temp names start with a dot and do not end in .json, so no reader mistakes them for
        # a checkpoint if a crash leaves one behind.
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{group}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        _fsync_dir(path.parent)

    def committed(self, group: str) -> tuple[int, str] | None:
        """The (offset, metadata) last committed by `group`, or None if it never committed."""
        checkpoint = _load_checkpoint(_checkpoint_path(self._dir, group))
        return None if checkpoint is None else (checkpoint.offset, checkpoint.metadata)

    def _list(self) -> list[int]:
        bases = _list_segments(self._dir)
        for base in [b for b in self._segments if b not in bases]:
            del self._segments[base]
        return bases

    def _open(self, base: int) -> tuple[BinaryIO, _SegmentState, int] | None:
        try:
            f = open(self._dir / _segment_name(base), "rb")  # noqa: SIM115
        except FileNotFoundError:
            self._segments.pop(base, None)
            return None
        st = os.fstat(f.fileno())
        state = self._segments.get(base)
        # A new inode or a file shorter than what we verified is not the file we knew.
        if state is None or state.inode != st.st_ino or st.st_size < state.frontier_pos:
            state = _SegmentState(base, st.st_ino)
            self._segments[base] = state
        return f, state, st.st_size

    def _read_segment(
        self, base: int, want: int, max_records: int, out: list[LogRecord]
    ) -> _ScanEnd | None:
        """Append records >= `want` of one segment to `out`; None if the segment is gone."""
        opened = self._open(base)
        if opened is None:
            return None
        f, state, size = opened
        pos, offset = state.start_for(want)
        end = _ScanEnd()
        verify_from = min(want, state.frontier_offset)
        with f:
            for file_pos, at, ts, key_len, buf, p, n in _scan_frames(
                f, size, pos, offset, verify_from, end, state
            ):
                if at < want:
                    continue
                key_at = p + FRAME_OVERHEAD
                value_at = key_at + key_len
                out.append(LogRecord(at, ts, buf[key_at:value_at], buf[value_at : p + n]))
                if len(out) >= max_records:
                    state.cursor_offset, state.cursor_pos = at + 1, file_pos + n
                    break
            else:
                state.cursor_offset, state.cursor_pos = end.offset, end.pos
        return end

    def _report_corrupt(self, base: int, end: _ScanEnd) -> None:
        key = (base, end.pos, end.offset)
        if key not in self._reported_corrupt:
            self._reported_corrupt.add(key)
            self.stats.corrupt_frames += 1

    def _report_missing(self, lo: int, hi: int) -> None:
        """Count the offsets in [lo, hi) not counted before (callers may retry the same gap)."""
        if hi <= lo:
            return
        new = hi - lo
        kept: list[tuple[int, int]] = []
        merged_lo, merged_hi = lo, hi
        for a, b in self._reported_missing:
            if b < lo or a > hi:
                kept.append((a, b))
                continue
            new -= max(0, min(b, hi) - max(a, lo))
            merged_lo, merged_hi = min(merged_lo, a), max(merged_hi, b)
        kept.append((merged_lo, merged_hi))
        kept.sort()
        self._reported_missing = kept
        self.stats.missing_records += new
