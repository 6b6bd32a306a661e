"""The on-disk frame of one record, walking a segment's frames, and finding the next valid frame
after a damaged one (resynchronisation). Shared by the writer's crash recovery and the reader.

Frame of one record, little-endian::

    u32 length      bytes of the frame after this field
    u32 crc32       zlib.crc32 of the frame after this field
    u64 offset      dense, starting at 0
    i64 timestamp_ms
    u16 key_len
    key bytes, value bytes
"""

from __future__ import annotations

import bisect
import os
import re
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

_MIB = 1024 * 1024

FRAME_HEAD = struct.Struct("<IIQqH")  # length, crc32, offset, timestamp_ms, key_len
BODY_HEAD = struct.Struct("<QqH")  # the part of the head covered by the crc
LENGTH_AND_CRC = struct.Struct("<II")
_LENGTH = struct.Struct("<I")
FRAME_OVERHEAD = FRAME_HEAD.size  # bytes a record takes on disk besides its key and value
LENGTH_FIELD = _LENGTH.size
_CRC_END = LENGTH_AND_CRC.size  # the crc covers the frame from here on
MIN_LENGTH = FRAME_OVERHEAD - LENGTH_FIELD  # the length field of a frame with empty key/value
_OFFSET_AT = _CRC_END  # the offset field's position in a frame
# A resync looks for the upper six bytes of a candidate offset (offsets near each other share
# them) and checks the whole frame around each hit.
_PATTERN_FROM = 2
_NONZERO = re.compile(rb"[^\x00]")

SEGMENT_SUFFIX = ".log"
_SEGMENT_NAME = re.compile(r"^(\d{20})\.log$")

# Readers parse frames from memory, reading a segment in chunks that start small (a poll at
# the tail or a short read should not copy megabytes) and double up to a cap.
_READ_CHUNK_MIN_BYTES = 64 * 1024
_READ_CHUNK_MAX_BYTES = 1 * _MIB
# A reader remembers the position of one frame per this many bytes of a segment, so a read
# from an arbitrary offset re-walks at most this much of the segment.
_INDEX_INTERVAL_BYTES = 16 * 1024


def segment_name(base_offset: int) -> str:
    return f"{base_offset:020d}{SEGMENT_SUFFIX}"


def list_segments(directory: Path) -> list[int]:
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


@dataclass(slots=True)
class SegmentState:
    """What a reader has verified about one segment file, so it never re-walks it needlessly."""

    base: int
    inode: int
    frontier_pos: int = 0  # every frame (or known damage) before this byte position is known
    frontier_offset: int = 0
    max_timestamp_ms: int | None = None  # over the frames before the frontier
    index_offsets: list[int] = field(default_factory=list)  # sparse offset -> position
    index_positions: list[int] = field(default_factory=list)
    cursor_offset: int = -1  # where the previous read in this segment stopped
    cursor_pos: int = 0
    # Damaged frames found before the frontier: position -> (position, offset) of the next
    # valid frame. A walk stops at one of these before trusting its bytes (crc is not
    # recomputed before the frontier) and jumps.
    damaged: dict[int, tuple[int, int]] = field(default_factory=dict)

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
class ScanEnd:
    """Where a scan stopped once it ran out of valid frames."""

    pos: int = 0
    offset: int = 0
    clean: bool = True  # at end of file on a frame boundary, rather than at a bad/partial frame


# (file position, offset, timestamp_ms, key_len, buffer, frame start in buffer, frame size)
Frame = tuple[int, int, int, int, bytes, int, int]


def scan_frames(
    f: BinaryIO,
    size: int,
    pos: int,
    offset: int,
    verify_from: int,
    end: ScanEnd,
    state: SegmentState | None,
) -> Iterator[Frame]:
    """Yield consecutive valid frames of a segment, starting at a known frame boundary.

    Frames with offset < verify_from lie in a region already verified, so their crc is not
    recomputed. Stops at end of file or at the first frame that is short, has a bad crc or an
    unexpected offset, or is known to be damaged, and then fills `end`. Extends `state` (when
    given) past its frontier.
    """
    damaged = state.damaged if state is not None else None
    f.seek(pos)
    chunk = _READ_CHUNK_MIN_BYTES
    buf = f.read(min(chunk, size - pos))
    if len(buf) < min(chunk, size - pos):
        size = pos + len(buf)  # truncated since we looked
    buf_pos = pos  # file position of buf[0]
    p = 0
    while True:
        file_pos = buf_pos + p
        if damaged and file_pos in damaged:
            break
        avail = len(buf) - p
        want = FRAME_OVERHEAD
        if avail >= LENGTH_FIELD:
            want = max(want, LENGTH_FIELD + _LENGTH.unpack_from(buf, p)[0])
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
        length, crc, frame_offset, timestamp_ms, key_len = FRAME_HEAD.unpack_from(buf, p)
        n = LENGTH_FIELD + length
        if (
            length < MIN_LENGTH
            or n > avail
            or frame_offset != offset
            or key_len > length - MIN_LENGTH
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


def _valid_at(data: bytes, p: int, lo: int, hi: int) -> int | None:
    """The offset of the frame at data[p:], if a whole valid frame with lo <= offset < hi is
    there, else None."""
    if p < 0 or p + FRAME_OVERHEAD > len(data):
        return None
    length, crc, at, _, key_len = FRAME_HEAD.unpack_from(data, p)
    n = LENGTH_FIELD + length
    if (
        length < MIN_LENGTH
        or p + n > len(data)
        or not lo <= at < hi
        or key_len > length - MIN_LENGTH
        or zlib.crc32(data[p + _CRC_END : p + n]) != crc
    ):
        return None
    return int(at)


def _first_hit(data: bytes, pattern: bytes, lo: int, hi: int) -> tuple[int, int] | None:
    """The earliest valid frame whose offset field ends in `pattern` (its upper six bytes)."""
    shift = _OFFSET_AT + _PATTERN_FROM
    zeros = not pattern.strip(b"\x00")
    run_start = run_end = -1  # the run of zero bytes the last hit lies in (zeros only)
    q = data.find(pattern, shift)
    while q != -1:
        at = _valid_at(data, q - shift, lo, hi)
        if at is not None:
            return q - shift, at
        nxt = q + 1
        if zeros:
            # Inside a run of zero bytes every position matches, but a frame whose length
            # field lies wholly in the run is no frame (a length is never zero): past the
            # first few hits of a run, the next candidate's length field reaches beyond it.
            if q >= run_end:
                m = _NONZERO.search(data, q)
                run_start, run_end = q, len(data) if m is None else m.start()
            if nxt >= run_start + shift:
                nxt = max(nxt, run_end + shift - (LENGTH_FIELD - 1))
        q = data.find(pattern, nxt)
    return None


def find_next_frame(
    f: BinaryIO, size: int, bad_pos: int, offset: int, upper: int | None
) -> tuple[int, int] | None:
    """Resynchronise after a damaged frame at `bad_pos` (where offset `offset` was due): the
    position and offset of the first valid frame after it whose offset is >= `offset` and
    < `upper` (None: as many as the rest of the file could hold), or None."""
    start = bad_pos + 1
    if size - start < FRAME_OVERHEAD:
        return None
    f.seek(start)
    data = f.read(size - start)
    hi = offset + len(data) // FRAME_OVERHEAD + 1
    if upper is not None:
        hi = min(hi, upper)
    if hi <= offset:
        return None
    best: tuple[int, int] | None = None
    for block in range(offset >> 16, ((hi - 1) >> 16) + 1):
        pattern = (block << 16).to_bytes(8, "little")[_PATTERN_FROM:]
        hit = _first_hit(data, pattern, max(offset, block << 16), hi)
        if hit is not None and (best is None or hit[0] < best[0]):
            best = hit
    return None if best is None else (start + best[0], best[1])


def walk_frames(
    f: BinaryIO,
    size: int,
    pos: int,
    offset: int,
    verify_from: int,
    end: ScanEnd,
    state: SegmentState | None,
    upper: int | None,
    on_damage: Callable[[int, int, int, int], None],
) -> Iterator[Frame]:
    """Like scan_frames, but past damaged frames: after a bad frame the walk resumes at the
    next valid one (offsets `< upper`), calling on_damage(bad_pos, bad_offset, next_pos,
    next_offset) once per jump. `end` is where no valid frame follows any more."""
    while True:
        yield from scan_frames(f, size, pos, offset, verify_from, end, state)
        if end.clean:
            return
        known = state.damaged.get(end.pos) if state is not None else None
        jump = known if known is not None else find_next_frame(f, size, end.pos, end.offset, upper)
        if jump is None:
            return
        bad_pos, bad_offset = end.pos, end.offset
        pos, offset = jump
        if state is not None and known is None:
            state.damaged[bad_pos] = jump
            if state.frontier_pos == bad_pos:
                state.frontier_pos, state.frontier_offset = jump
                state.index_offsets.append(jump[1])
                state.index_positions.append(jump[0])
        on_damage(bad_pos, bad_offset, pos, offset)
