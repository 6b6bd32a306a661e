from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collector.aggregate.service import CheckpointError, open_checkpoint
from collector.node.service import last_event_ms
from collector.transport import locallog
from collector.transport.kafka import FORWARDER_GROUP, KafkaForwarder, ProducerSettings
from collector.transport.locallog import (
    FRAME_OVERHEAD,
    CorruptCheckpointError,
    LocalLog,
    LogLockedError,
    LogReader,
    LogRecord,
    ReaderStats,
)

KEY = b"k"
# Records of the fixed-size tests: 26 bytes of frame head + 1 key byte + 48 value bytes.
FRAME = FRAME_OVERHEAD + 1 + 48
REPO_ROOT = Path(__file__).resolve().parents[1]


def value(i: int) -> bytes:
    return i.to_bytes(8, "big") * 6


def record(i: int) -> LogRecord:
    return LogRecord(offset=i, timestamp_ms=1000 + i, key=KEY, value=value(i))


def fill(log: LocalLog, start: int, stop: int) -> None:
    for i in range(start, stop):
        assert log.append(KEY, value(i), 1000 + i) == i


def segment_path(directory: Path, base: int) -> Path:
    return directory / f"{base:020d}.log"


def segment_bases(directory: Path) -> list[int]:
    return sorted(int(p.name[:20]) for p in directory.glob("*.log"))


def read_all(reader: LogReader, batch: int = 1000) -> list[LogRecord]:
    out: list[LogRecord] = []
    pos = 0
    while True:
        got = reader.read(pos, batch)
        if not got:
            return out
        out.extend(got)
        pos = got[-1].offset + 1


def test_frame_size_matches_layout() -> None:
    assert FRAME_OVERHEAD == 4 + 4 + 8 + 8 + 2
    assert FRAME == 75


def test_round_trip_across_segment_rolls(tmp_path: Path) -> None:
    with LocalLog(tmp_path, segment_bytes=4 * FRAME) as log:
        fill(log, 0, 50)
        assert log.next_offset == 50
        assert log.first_offset == 0
    assert segment_bases(tmp_path) == list(range(0, 50, 4))
    assert [segment_path(tmp_path, b).stat().st_size for b in range(0, 48, 4)] == [4 * FRAME] * 12
    assert segment_path(tmp_path, 48).stat().st_size == 2 * FRAME

    reader = LogReader(tmp_path)
    assert read_all(reader, batch=7) == [record(i) for i in range(50)]
    assert reader.read(13, 5) == [record(i) for i in range(13, 18)]
    assert reader.read(49) == [record(49)]
    assert reader.read(50) == []
    assert reader.read(500) == []
    assert reader.end_offset() == 50
    assert reader.stats == locallog.ReaderStats(corrupt_frames=0, missing_records=0)


def test_random_access_inside_a_large_segment(tmp_path: Path) -> None:
    # Far more than one index interval, so reads start from the sparse index or the cursor.
    with LocalLog(tmp_path) as log:
        fill(log, 0, 3000)
    reader = LogReader(tmp_path)
    for start in (2999, 0, 1500, 1499, 2222, 7, 1501):
        assert reader.read(start, 3) == [record(i) for i in range(start, min(start + 3, 3000))]
    assert read_all(reader, batch=333) == [record(i) for i in range(3000)]


def test_reopen_continues_offsets(tmp_path: Path) -> None:
    with LocalLog(tmp_path, segment_bytes=4 * FRAME) as log:
        fill(log, 0, 10)
    with LocalLog(tmp_path, segment_bytes=4 * FRAME) as log:
        assert log.next_offset == 10
        assert log.first_offset == 0
        assert log.stats.torn_tail_bytes == 0
        fill(log, 10, 13)
    assert read_all(LogReader(tmp_path)) == [record(i) for i in range(13)]
    assert segment_bases(tmp_path) == [0, 4, 8, 12]


def test_empty_log(tmp_path: Path) -> None:
    reader = LogReader(tmp_path / "not-yet")
    assert reader.read(0) == []
    assert reader.end_offset() == 0
    assert reader.offset_for_time(0) == 0
    with LocalLog(tmp_path / "not-yet") as log:
        assert (log.first_offset, log.next_offset) == (0, 0)
    assert reader.read(0) == []
    assert reader.end_offset() == 0


def test_unflushed_records_are_invisible_until_flush(tmp_path: Path) -> None:
    reader = LogReader(tmp_path)
    with LocalLog(tmp_path) as log:
        fill(log, 0, 3)
        assert reader.read(0) == []
        log.flush()
        assert reader.read(0) == [record(0), record(1), record(2)]


def _last_segment_with_three_records(directory: Path) -> tuple[Path, bytes]:
    with LocalLog(directory, segment_bytes=4 * FRAME) as log:
        fill(log, 0, 11)  # segments 0 (0-3), 4 (4-7), 8 (8-10)
    path = segment_path(directory, 8)
    return path, path.read_bytes()


def _assert_recovered(directory: Path, torn: int) -> None:
    with LocalLog(directory, segment_bytes=4 * FRAME) as log:
        assert log.stats.torn_tail_bytes == torn
        assert log.next_offset == 10
        assert segment_path(directory, 8).stat().st_size == 2 * FRAME
        assert read_all(LogReader(directory)) == [record(i) for i in range(10)]
        assert log.append(KEY, value(10), 1010) == 10
    assert read_all(LogReader(directory)) == [record(i) for i in range(11)]


def test_torn_tail_cut_at_every_byte_of_the_last_frame(tmp_path: Path) -> None:
    path, pristine = _last_segment_with_three_records(tmp_path)
    last_frame = 2 * FRAME
    assert len(pristine) == 3 * FRAME
    for cut in range(last_frame, len(pristine)):
        path.write_bytes(pristine[:cut])
        _assert_recovered(tmp_path, torn=cut - last_frame)


def test_torn_tail_garbage_in_every_byte_of_the_last_frame(tmp_path: Path) -> None:
    path, pristine = _last_segment_with_three_records(tmp_path)
    last_frame = 2 * FRAME
    for i in range(last_frame, len(pristine)):
        damaged = bytearray(pristine)
        damaged[i] ^= 0xFF
        path.write_bytes(bytes(damaged))
        _assert_recovered(tmp_path, torn=FRAME)


def test_torn_tail_wrong_offset_zeros_and_junk(tmp_path: Path) -> None:
    path, pristine = _last_segment_with_three_records(tmp_path)
    two_frames = pristine[: 2 * FRAME]
    # A crc-valid frame that repeats offset 9 where 10 belongs.
    path.write_bytes(two_frames + pristine[FRAME : 2 * FRAME])
    _assert_recovered(tmp_path, torn=FRAME)
    # Power loss without fsync can leave zero-filled blocks.
    path.write_bytes(two_frames + bytes(4096))
    _assert_recovered(tmp_path, torn=4096)
    path.write_bytes(two_frames + b"\x07" * 37)
    _assert_recovered(tmp_path, torn=37)


def test_whole_newest_segment_torn(tmp_path: Path) -> None:
    with LocalLog(tmp_path, segment_bytes=4 * FRAME) as log:
        fill(log, 0, 9)  # offset 8 alone in segment 8
    path = segment_path(tmp_path, 8)
    path.write_bytes(path.read_bytes()[:10])
    with LocalLog(tmp_path, segment_bytes=4 * FRAME) as log:
        assert log.stats.torn_tail_bytes == 10
        assert log.next_offset == 8
        assert log.append(KEY, value(8), 1008) == 8
    assert read_all(LogReader(tmp_path)) == [record(i) for i in range(9)]


_CHILD = """
import sys
from pathlib import Path
from collector.transport.locallog import LocalLog

log = LocalLog(Path(sys.argv[1]), segment_bytes=4096)
i = 0
while True:
    offset = log.append(b"k", i.to_bytes(8, "big") * 6, 1000 + i)
    log.flush()
    print(offset, flush=True)
    i += 1
"""


def test_sigkill_mid_append_loses_nothing_flushed(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(tmp_path)], stdout=subprocess.PIPE, env=env
    )
    assert child.stdout is not None
    reported = -1
    try:
        while reported < 2000:  # spans dozens of 4 KiB segments
            line = child.stdout.readline()
            assert line, "child exited early"
            assert int(line) == reported + 1
            reported += 1
        with pytest.raises(LogLockedError):
            LocalLog(tmp_path)
        child.send_signal(signal.SIGKILL)
        # Offsets the child printed before it died are flushed too.
        for line in child.stdout:
            assert int(line) == reported + 1
            reported += 1
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL

    with LocalLog(tmp_path, segment_bytes=4096) as log:
        survived = log.next_offset
        assert survived >= reported + 1
        records = read_all(LogReader(tmp_path))
        assert records == [record(i) for i in range(survived)]
        assert log.append(KEY, value(survived), 1000 + survived) == survived
    assert read_all(LogReader(tmp_path))[-1] == record(survived)


def test_bound_without_checkpoint_rejects_and_counts(tmp_path: Path) -> None:
    with LocalLog(tmp_path, segment_bytes=4 * FRAME, max_bytes=10 * FRAME) as log:
        fill(log, 0, 10)
        for i in range(10, 15):
            assert log.append(KEY, value(i), 1000 + i) is None
        assert log.append(KEY, bytes(11 * FRAME), 0) is None  # could never fit
        assert log.stats.rejected_records == 6
        assert log.stats.rejected_bytes == 5 * FRAME + FRAME_OVERHEAD + 1 + 11 * FRAME
        assert log.stats.reclaimed_bytes == 0
        assert log.stats.appended_records == 10
        assert (log.first_offset, log.next_offset) == (0, 10)
        assert log.retain_from() is None
    assert sum(p.stat().st_size for p in tmp_path.glob("*.log")) == 10 * FRAME
    assert read_all(LogReader(tmp_path)) == [record(i) for i in range(10)]


def test_no_smaller_record_slips_in_while_the_bound_rejects(tmp_path: Path) -> None:
    """A record the bound rejects keeps rejecting until it would fit: a smaller one after it
    (which alone would fit) is rejected too, so the episode does not end at once and no event
    is stored after the ones it follows were dropped. Room made by a consumer ends it."""
    reader = LogReader(tmp_path)
    with LocalLog(tmp_path, segment_bytes=4 * FRAME, max_bytes=10 * FRAME) as log:
        fill(log, 0, 9)  # room for one more frame
        assert log.append(KEY, bytes(2 * FRAME), 0) is None
        assert log.append(KEY, value(9), 1009) is None  # one frame: it alone would fit
        assert (log.blocked, log.stats.blocked_episodes) == (
            f"size bound of {10 * FRAME} bytes reached",
            1,
        )
        assert log.append(KEY, bytes(11 * FRAME), 0) is None  # can never fit: wedges nothing
        log.flush()
        reader.commit("agg", 4)  # segment 0 can go: room for the big one again
        fill(log, 9, 10)
        assert log.blocked is None and log.stats.rejected_records == 3
    assert [r.offset for r in reader.read(4, 100)] == list(range(4, 10))


def test_bound_reclaims_segments_consumers_are_done_with(tmp_path: Path) -> None:
    reader = LogReader(tmp_path)
    with LocalLog(tmp_path, segment_bytes=4 * FRAME, max_bytes=10 * FRAME) as log:
        fill(log, 0, 10)  # segments 0 (0-3), 4 (4-7), 8 (8-9): the bound is full
        assert log.append(KEY, value(10), 1010) is None
        reader.commit("agg", 8)
        assert log.retain_from() == 8
        fill(log, 10, 11)  # needs only segment 0 to go
        assert log.stats.reclaimed_bytes == 4 * FRAME
        assert segment_bases(tmp_path) == [4, 8]
        fill(log, 11, 14)  # rolls to segment 12, fills the bound again
        fill(log, 14, 15)  # segment 4 lies below 8 as well
        assert log.stats.reclaimed_bytes == 8 * FRAME
        assert segment_bases(tmp_path) == [8, 12]
        fill(log, 15, 18)
        # Segment 8 holds offsets 8-11, and "agg" still needs offset 8.
        assert log.append(KEY, value(18), 1018) is None
        assert log.stats.rejected_records == 2
        assert log.stats.rejected_bytes == 2 * FRAME

        # 16 and 17 are still in the write buffer, so no consumer can have read them: the
        # checkpoint only counts up to what reached the disk.
        reader.commit("agg", 18)
        assert log.retain_from() == 16
        fill(log, 18, 19)
        assert segment_bases(tmp_path) == [12, 16]
        assert log.first_offset == 12

        # The lowest checkpoint of all groups decides.
        reader.commit("billing", 12)
        fill(log, 19, 22)  # segments 12, 16 and 20: full again
        assert log.append(KEY, value(22), 1022) is None
        reader.commit("billing", 16)
        fill(log, 22, 23)
        assert log.stats.rejected_records == 3
        assert log.stats.reclaimed_bytes == 16 * FRAME
        assert segment_bases(tmp_path) == [16, 20]
        assert (log.first_offset, log.next_offset) == (16, 23)
    assert reader.read(0) == [record(i) for i in range(16, 23)]
    assert reader.stats.missing_records == 16


def test_bound_smaller_than_a_segment_reclaims_the_active_one(tmp_path: Path) -> None:
    """The segment sealed for that holds the last record written: it is unlinked only once a
    later one is written (unlinked at once, a kill before the next write left no record on
    disk, and a restart found no last event time: its clock fell back to the wall clock,
    behind its last event after a step back)."""
    reader = LogReader(tmp_path)
    with LocalLog(tmp_path, segment_bytes=100 * FRAME, max_bytes=4 * FRAME) as log:
        fill(log, 0, 4)
        reader.commit("spool", 1000)  # stale: counts only up to what reached the disk
        assert log.append(KEY, value(4), 1004) is None
        log.flush()
        reader.commit("spool", 4)
        fill(log, 4, 5)
        assert log.stats.reclaimed_bytes == 4 * FRAME  # out of the bound's count at once
        assert segment_bases(tmp_path) == [0, 4]
        assert last_event_ms(tmp_path, log.next_offset - 1) == 1003  # what a kill now leaves
        log.flush()
        assert segment_bases(tmp_path) == [4]
        assert last_event_ms(tmp_path, log.next_offset) == 1004
        assert log.stats.rejected_records == 1
    assert reader.read(4) == [record(4)]


@contextlib.contextmanager
def no_descriptor_left() -> Iterator[None]:
    """The process may open no more files (RLIMIT_NOFILE at its lowest free descriptor): every
    open, listing or socket fails with EMFILE until the limit is lifted."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    free = os.open(os.devnull, os.O_RDONLY)
    os.close(free)
    resource.setrlimit(resource.RLIMIT_NOFILE, (free, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_checkpoints_that_cannot_be_read_now_keep_everything(tmp_path: Path) -> None:
    """The bound is reached while the process is out of descriptors: what the consumers still
    need is not known, so nothing is deleted and the record is rejected and counted, saying
    why (the EMFILE of listing the checkpoints escaped from append, and ended the collector's
    scan loop). With descriptors again, room is made as before."""
    reader = LogReader(tmp_path)
    with LocalLog(tmp_path, segment_bytes=2 * FRAME, max_bytes=4 * FRAME) as log:
        fill(log, 0, 4)
        log.flush()
        reader.commit("agg", 4)
        with no_descriptor_left():
            rejected = log.append(KEY, value(4), 1004)
        assert rejected is None
        assert log.blocked == (
            f"size bound of {4 * FRAME} bytes reached "
            "(consumer checkpoints unreadable: Too many open files)"
        )
        assert (log.stats.rejected_records, log.stats.reclaimed_bytes) == (1, 0)
        assert segment_bases(tmp_path) == [0, 2]
        assert log.append(KEY, value(5), 1005) == 4
        assert log.blocked is None
        assert (log.stats.blocked_episodes, log.stats.reclaimed_bytes) == (1, 2 * FRAME)
        assert segment_bases(tmp_path) == [2, 4]
    assert reader.read(2) == [record(2), record(3), LogRecord(4, 1005, KEY, value(5))]


def test_corrupt_checkpoint_keeps_everything(tmp_path: Path) -> None:
    reader = LogReader(tmp_path)
    with LocalLog(tmp_path, segment_bytes=2 * FRAME, max_bytes=4 * FRAME) as log:
        fill(log, 0, 4)
        reader.commit("good", 4)
        (tmp_path / "consumers" / "broken.json").write_bytes(b'{"offset": ')
        assert log.retain_from() == 0
        assert log.append(KEY, value(4), 1004) is None
        assert segment_bases(tmp_path) == [0, 2]
    with pytest.raises(CorruptCheckpointError):
        reader.committed("broken")


def test_checkpoints_past_where_a_power_loss_left_the_log_are_moved_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Checkpoints are fsync'd, segments are not: after a power loss the log can end below a
    consumer's checkpoint. The writer that reopens it moves the checkpoint back to where the log
    ends (keeping its metadata), so the records it appends from there are read, not skipped."""
    reader = LogReader(tmp_path)
    with LocalLog(tmp_path) as log:
        fill(log, 0, 100)
    reader.commit("hami-usage-aggregator", 100, '{"emitted_until_ms": 7}')
    reader.commit("behind", 40, "b")
    reader.commit("at-end", 60)
    (tmp_path / "consumers" / "broken.json").write_bytes(b'{"offset": ')
    os.truncate(segment_path(tmp_path, 0), 60 * FRAME)  # the last 40 frames never hit the disk
    # The aggregator starting first still refuses the checkpoint (exit 4): nothing moved it.
    with pytest.raises(CheckpointError, match="at offset 100, beyond the end of the log"):
        open_checkpoint(LogReader(tmp_path), "hami-usage-aggregator", tmp_path)
    writer_log = "collector.transport.locallog.writer"
    with caplog.at_level(logging.WARNING, logger=writer_log), LocalLog(tmp_path) as log:
        assert log.opened_end == 60
        for i in range(50):
            assert log.append(KEY, value(1000 + i), 5000 + i) == 60 + i
    assert [r.getMessage() for r in caplog.records] == [
        f"local log {tmp_path}: checkpoint of group hami-usage-aggregator was at offset 100, "
        "past where the log ends (segments lost in a crash): moved back to 60"
    ]
    reader = LogReader(tmp_path)
    assert open_checkpoint(reader, "hami-usage-aggregator", tmp_path) == (
        60,
        '{"emitted_until_ms": 7}',
    )
    assert reader.committed("behind") == (40, "b")
    assert reader.committed("at-end") == (60, "")
    assert (tmp_path / "consumers" / "broken.json").read_bytes() == b'{"offset": '
    got = reader.read(60, 1000)
    assert [(r.offset, r.value) for r in got] == [(60 + i, value(1000 + i)) for i in range(50)]
    assert reader.stats == ReaderStats()


def test_forwarder_with_an_unreadable_spool_checkpoint_sends_the_spool_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Sending again what the broker may have is safe (the aggregator drops duplicates); a
    collector that cannot start is not. The next commit replaces the file."""
    with LocalLog(tmp_path, segment_bytes=10 * FRAME) as spool:
        fill(spool, 0, 30)
        spool.flush()
        spool.release_before(10)  # what the broker had acknowledged
    (tmp_path / "consumers").mkdir()
    checkpoint = tmp_path / "consumers" / f"{FORWARDER_GROUP}.json"
    checkpoint.write_bytes(b"")
    with LocalLog(tmp_path, segment_bytes=10 * FRAME) as spool:
        with caplog.at_level(logging.WARNING, logger="collector.transport.kafka"):
            fwd = KafkaForwarder(ProducerSettings("127.0.0.1:9"), spool, tmp_path)
        assert (spool.first_offset, spool.next_offset, fwd.depth()) == (10, 30, 20)
        assert [r.getMessage() for r in caplog.records] == [
            f"spool checkpoint unreadable ({checkpoint}: Input data was truncated): "
            "forwarding the whole spool again"
        ]


def test_release_before_deletes_only_whole_sealed_segments(tmp_path: Path) -> None:
    reader = LogReader(tmp_path)
    with LocalLog(tmp_path, segment_bytes=4 * FRAME) as log:
        fill(log, 0, 11)
        log.flush()
        assert read_all(reader) == [record(i) for i in range(11)]
        assert log.release_before(3) == 0
        assert log.release_before(6) == 4 * FRAME
        assert segment_bases(tmp_path) == [4, 8]
        assert log.release_before(1000) == 4 * FRAME  # never the active segment
        assert segment_bases(tmp_path) == [8]
        assert (log.first_offset, log.next_offset) == (8, 11)
    # The reader had cached state for the deleted segments.
    assert reader.read(0) == [record(8), record(9), record(10)]
    assert reader.stats.missing_records == 8
    assert reader.read(2, 1) == [record(8)]
    assert reader.stats.missing_records == 8  # the same gap is counted once
    with LocalLog(tmp_path, segment_bytes=4 * FRAME) as log:
        assert (log.first_offset, log.next_offset) == (8, 11)


def test_partial_frame_at_the_tail_is_not_written_yet(tmp_path: Path) -> None:
    whole = tmp_path / "whole"
    with LocalLog(whole) as log:
        fill(log, 0, 4)
    fourth = segment_path(whole, 0).read_bytes()[3 * FRAME :]
    growing = tmp_path / "growing"
    with LocalLog(growing) as log:
        fill(log, 0, 3)
    reader = LogReader(growing)
    path = segment_path(growing, 0)
    for split in (1, 4, 8, 26, 30, FRAME - 1):
        with path.open("r+b") as f:
            f.truncate(3 * FRAME)
            f.seek(3 * FRAME)
            f.write(fourth[:split])
        assert reader.read(0) == [record(0), record(1), record(2)]
        assert reader.read(3) == []
        assert reader.end_offset() == 3
    with path.open("ab") as f:
        f.write(fourth[FRAME - 1 :])
    assert reader.read(3) == [record(3)]
    assert reader.end_offset() == 4
    assert reader.stats == locallog.ReaderStats(corrupt_frames=0, missing_records=0)


def test_reader_resynchronises_after_a_corrupt_frame_in_a_sealed_segment(tmp_path: Path) -> None:
    with LocalLog(tmp_path, segment_bytes=4 * FRAME) as log:
        fill(log, 0, 11)
    path = segment_path(tmp_path, 4)
    damaged = bytearray(path.read_bytes())
    damaged[FRAME + 40] ^= 0x01  # inside offset 5
    path.write_bytes(bytes(damaged))

    reader = LogReader(tmp_path)
    expected = [record(i) for i in (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)]
    assert read_all(reader, batch=3) == expected
    assert reader.stats == locallog.ReaderStats(corrupt_frames=1, missing_records=1)
    assert reader.read(5) == [record(6), record(7), record(8), record(9), record(10)]
    assert reader.read(6, 1) == [record(6)]
    assert read_all(reader) == expected
    assert reader.stats == locallog.ReaderStats(corrupt_frames=1, missing_records=1)

    # A sealed segment cut short is corrupt as well, not "not written yet": nothing follows.
    path = segment_path(tmp_path, 0)
    path.write_bytes(path.read_bytes()[: 2 * FRAME + 10])
    reader = LogReader(tmp_path)
    assert [r.offset for r in read_all(reader)] == [0, 1, 4, 6, 7, 8, 9, 10]
    assert reader.stats == locallog.ReaderStats(corrupt_frames=2, missing_records=3)


@pytest.mark.parametrize("newest", [False, True])
def test_reader_passes_over_a_huge_frame_length(tmp_path: Path, newest: bool) -> None:
    with LocalLog(tmp_path, segment_bytes=(20 if newest else 4) * FRAME) as log:
        fill(log, 0, 12)
    path = segment_path(tmp_path, 0 if newest else 4)
    damaged = bytearray(path.read_bytes())
    damaged[FRAME : FRAME + 4] = (0xFFFFFFF0).to_bytes(4, "little")  # offset 1 (or 5)
    path.write_bytes(bytes(damaged))
    reader = LogReader(tmp_path)
    lost = 1 if newest else 5
    assert [r.offset for r in read_all(reader)] == [i for i in range(12) if i != lost]
    assert reader.stats == locallog.ReaderStats(corrupt_frames=1, missing_records=1)
    assert reader.end_offset() == 12
    assert reader.torn_tail() == 0


def test_flipped_bytes_in_the_newest_segment_are_damage_not_a_tail(tmp_path: Path) -> None:
    with LocalLog(tmp_path) as log:
        fill(log, 0, 10)
    path = segment_path(tmp_path, 0)
    damaged = bytearray(path.read_bytes())
    for i in (2, 3, 7):
        damaged[i * FRAME + 30] ^= 0x5A
    path.write_bytes(bytes(damaged))
    reader = LogReader(tmp_path)
    assert [r.offset for r in read_all(reader)] == [0, 1, 4, 5, 6, 8, 9]
    assert reader.stats == locallog.ReaderStats(corrupt_frames=2, missing_records=3)
    # The writer keeps them too: only a tail with nothing valid after it is cut.
    with LocalLog(tmp_path) as log:
        assert log.stats.torn_tail_bytes == 0
        assert log.stats.damaged_frames == 2
        assert log.append(KEY, value(10), 1010) == 10
    assert [r.offset for r in read_all(LogReader(tmp_path))] == [0, 1, 4, 5, 6, 8, 9, 10]


def test_torn_tail_is_reported_by_the_reader(tmp_path: Path) -> None:
    with LocalLog(tmp_path) as log:
        fill(log, 0, 6)
    path = segment_path(tmp_path, 0)
    data = path.read_bytes()
    reader = LogReader(tmp_path)
    assert reader.torn_tail() == 0
    path.write_bytes(data[: 3 * FRAME + 20])
    assert [r.offset for r in read_all(reader)] == [0, 1, 2]
    assert reader.torn_tail() == 20
    assert reader.end_offset() == 3


def test_deleted_middle_segment_is_a_missing_segment(tmp_path: Path) -> None:
    with LocalLog(tmp_path, segment_bytes=4 * FRAME) as log:
        fill(log, 0, 12)
    segment_path(tmp_path, 4).unlink()
    reader = LogReader(tmp_path)
    assert [r.offset for r in read_all(reader, batch=2)] == [0, 1, 2, 3, 8, 9, 10, 11]
    assert reader.stats == locallog.ReaderStats(missing_records=4, missing_segments=1)
    assert reader.read(5) == [record(8), record(9), record(10), record(11)]
    assert reader.stats == locallog.ReaderStats(missing_records=4, missing_segments=1)


def test_resync_through_a_zeroed_region(tmp_path: Path) -> None:
    with LocalLog(tmp_path) as log:
        fill(log, 0, 2000)
    path = segment_path(tmp_path, 0)
    damaged = bytearray(path.read_bytes())
    damaged[100 * FRAME + 7 : 1500 * FRAME + 3] = bytes(1400 * FRAME - 4)
    path.write_bytes(bytes(damaged))
    reader = LogReader(tmp_path)
    started = time.monotonic()
    offsets = [r.offset for r in read_all(reader)]
    assert time.monotonic() - started < 5
    assert offsets == [*range(100), *range(1501, 2000)]
    assert reader.stats == locallog.ReaderStats(corrupt_frames=1, missing_records=1401)


def test_reader_in_parallel_with_writer(tmp_path: Path) -> None:
    total = 3000
    errors: list[BaseException] = []

    def write() -> None:
        try:
            with LocalLog(tmp_path, segment_bytes=1000) as log:
                for i in range(total):
                    assert log.append(KEY, value(i), 1000 + i) == i
                    if i % 7 == 0:
                        log.flush()
        except BaseException as exc:
            errors.append(exc)

    writer = threading.Thread(target=write)
    writer.start()
    reader = LogReader(tmp_path)
    pos = 0
    try:
        while pos < total and not errors:
            for r in reader.read(pos, 100):
                assert r == record(pos)
                pos += 1
    finally:
        writer.join()
    assert not errors
    assert pos == total
    assert reader.end_offset() == total
    assert reader.stats == locallog.ReaderStats(corrupt_frames=0, missing_records=0)


def test_spool_drain_in_parallel_reclaims_without_losing_records(tmp_path: Path) -> None:
    total = 2000
    bound = 40 * FRAME
    reader = LogReader(tmp_path)
    reader.commit("drain", 0)  # the drainer's group exists before the writer needs space
    errors: list[BaseException] = []
    rejected: list[int] = []
    peak: list[int] = [0]

    def write() -> None:
        try:
            with LocalLog(tmp_path, segment_bytes=10 * FRAME, max_bytes=bound) as log:
                i = 0
                while i < total:
                    if log.append(KEY, value(i), 1000 + i) is None:
                        log.flush()  # the drainer can only commit what it can see
                        time.sleep(0.0002)
                        continue
                    i += 1
                    if i % 5 == 0:
                        log.flush()
                    peak[0] = max(peak[0], sum(p.stat().st_size for p in tmp_path.glob("*.log")))
                rejected.append(log.stats.rejected_records)
        except BaseException as exc:
            errors.append(exc)

    writer = threading.Thread(target=write)
    writer.start()
    pos = committed = 0
    deadline = time.monotonic() + 60
    try:
        while pos < total and not errors and time.monotonic() < deadline:
            got = reader.read(pos, 50)
            for r in got:
                assert r == record(pos)
                pos += 1
            if not got and committed < pos:
                reader.commit("drain", pos)
                committed = pos
    finally:
        writer.join()
    assert not errors
    assert pos == total
    assert rejected[0] > 0  # the bound was actually hit, and drained past
    assert peak[0] <= bound
    assert reader.stats == locallog.ReaderStats(corrupt_frames=0, missing_records=0)


def test_offset_for_time_is_earliest_offset_at_or_after(tmp_path: Path) -> None:
    timestamps = [10, 20, 15, 30, 25, 40, 5]
    with LocalLog(tmp_path, segment_bytes=2 * FRAME) as log:
        for i, ts in enumerate(timestamps):
            log.append(KEY, value(i), ts)
    expected = {-(2**63): 0, 0: 0, 5: 0, 10: 0, 11: 1, 15: 1, 20: 1, 21: 3}
    expected |= {25: 3, 30: 3, 31: 5, 40: 5, 41: 7, 2**63 - 1: 7}
    shared = LogReader(tmp_path)
    for t in [*expected, *reversed(expected)]:
        assert shared.offset_for_time(t) == expected[t]
        assert LogReader(tmp_path).offset_for_time(t) == expected[t]


def test_commit_round_trip(tmp_path: Path) -> None:
    reader = LogReader(tmp_path)
    assert reader.committed("agg") is None
    reader.commit("agg", 5)
    assert reader.committed("agg") == (5, "")
    reader.commit("agg", 7, "epoch=3 ✓")
    assert reader.committed("agg") == (7, "epoch=3 ✓")
    assert LogReader(tmp_path).committed("agg") == (7, "epoch=3 ✓")
    reader.commit("spool.drain-1", 0)
    assert reader.committed("spool.drain-1") == (0, "")
    assert sorted(p.name for p in (tmp_path / "consumers").iterdir()) == [
        "agg.json",
        "spool.drain-1.json",
    ]
    for bad in ("", "../x", "a/b", ".hidden", "x" * 201):
        with pytest.raises(ValueError):
            reader.commit(bad, 1)
    with pytest.raises(ValueError):
        reader.commit("agg", -1)


def test_commit_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with LocalLog(tmp_path) as log:
        fill(log, 0, 6)
    reader = LogReader(tmp_path)
    reader.commit("agg", 5, "old")
    consumers = tmp_path / "consumers"
    # What a crash between writing the temp file and renaming it leaves behind.
    (consumers / ".agg.abc123.tmp").write_bytes(b'{"offs')
    assert reader.committed("agg") == (5, "old")
    with LocalLog(tmp_path) as log:
        assert log.retain_from() == 5

    def crash(src: object, dst: object) -> None:
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated"):
        reader.commit("agg", 9, "new")
    monkeypatch.undo()
    assert reader.committed("agg") == (5, "old")
    assert sorted(p.name for p in consumers.iterdir()) == [".agg.abc123.tmp", "agg.json"]
    reader.commit("agg", 9, "new")
    assert reader.committed("agg") == (9, "new")


def test_second_writer_is_locked_out(tmp_path: Path) -> None:
    log = LocalLog(tmp_path)
    with pytest.raises(LogLockedError, match=f"pid {os.getpid()}"):
        LocalLog(tmp_path)
    log.close()
    log.close()
    with LocalLog(tmp_path) as again:
        assert again.next_offset == 0


def test_append_argument_errors(tmp_path: Path) -> None:
    log = LocalLog(tmp_path)
    with pytest.raises(ValueError):
        log.append(b"x" * 65536, b"", 0)
    with pytest.raises(ValueError):
        log.append(b"", b"", 2**63)
    assert log.append(b"x" * 65535, b"", -(2**63)) == 0
    log.close()
    with pytest.raises(ValueError):
        log.append(b"", b"", 0)
    with pytest.raises(ValueError):
        LocalLog(tmp_path / "other", segment_bytes=0)
    assert LogReader(tmp_path).read(0) == [LogRecord(0, -(2**63), b"x" * 65535, b"")]


_records = st.lists(
    st.tuples(
        st.binary(max_size=20),
        st.binary(max_size=300),
        st.integers(min_value=-(2**63), max_value=2**63 - 1),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(
    records=_records,
    segment_bytes=st.integers(min_value=1, max_value=2000),
    flush_every=st.integers(min_value=1, max_value=10),
    batch=st.integers(min_value=1, max_value=50),
)
def test_property_round_trip(
    records: list[tuple[bytes, bytes, int]], segment_bytes: int, flush_every: int, batch: int
) -> None:
    with tempfile.TemporaryDirectory() as d:
        directory = Path(d)
        with LocalLog(directory, segment_bytes=segment_bytes) as log:
            for i, (key, val, ts) in enumerate(records):
                assert log.append(key, val, ts) == i
                if i % flush_every == 0:
                    log.flush()
        expected = [LogRecord(i, ts, k, v) for i, (k, v, ts) in enumerate(records)]
        reader = LogReader(directory)
        assert read_all(reader, batch) == expected
        assert reader.end_offset() == len(records)
        for _, _, t in records[:5]:
            first = next((i for i, r in enumerate(records) if r[2] >= t), len(records))
            assert reader.offset_for_time(t) == first
        with LocalLog(directory, segment_bytes=segment_bytes) as log:
            assert log.stats.torn_tail_bytes == 0
            assert log.next_offset == len(records)


_damage = st.lists(
    st.one_of(
        st.tuples(st.just("flip"), st.integers(0, 50), st.floats(0, 1), st.integers(1, 255)),
        st.tuples(st.just("cut"), st.integers(0, 50), st.floats(0, 1), st.just(0)),
        st.tuples(st.just("delete"), st.integers(0, 50), st.just(0.0), st.just(0)),
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    records=_records,
    segment_bytes=st.integers(min_value=50, max_value=1500),
    damage=_damage,
    batch=st.integers(min_value=1, max_value=20),
)
def test_property_corruption_is_counted_never_raised(
    records: list[tuple[bytes, bytes, int]],
    segment_bytes: int,
    damage: list[tuple[str, int, float, int]],
    batch: int,
) -> None:
    with tempfile.TemporaryDirectory() as d:
        directory = Path(d)
        with LocalLog(directory, segment_bytes=segment_bytes) as log:
            for key, val, ts in records:
                log.append(key, val, ts)
        expected = [LogRecord(i, ts, k, v) for i, (k, v, ts) in enumerate(records)]
        bases = segment_bases(directory)
        # Where each record's frame lies: (segment base, first byte, end byte).
        extent: dict[int, tuple[int, int, int]] = {}
        for base, upper in zip(bases, [*bases[1:], len(records)], strict=True):
            pos = 0
            for i in range(base, upper):
                size = FRAME_OVERHEAD + len(records[i][0]) + len(records[i][1])
                extent[i] = (base, pos, pos + size)
                pos += size

        first_damage = {b: segment_path(directory, b).stat().st_size for b in bases}
        touched: dict[int, set[int]] = {b: set() for b in bases}
        cut_at = dict(first_damage)
        for kind, which, where, xor in damage:
            base = bases[which % len(bases)]
            path = segment_path(directory, base)
            if not path.exists():
                continue
            data = bytearray(path.read_bytes())
            if kind == "delete":
                path.unlink()
                first_damage[base] = -1
                cut_at[base] = -1
                continue
            if not data:
                continue
            at = min(int(where * len(data)), len(data) - 1)
            if kind == "flip":
                data[at] ^= xor
                touched[base].add(at)
            else:
                del data[at:]
                cut_at[base] = min(cut_at[base], at)
            path.write_bytes(bytes(data))
            first_damage[base] = min(first_damage[base], at)

        reader = LogReader(directory)
        got = read_all(reader, batch)
        offsets = [r.offset for r in got]
        assert offsets == sorted(set(offsets))
        assert all(r == expected[r.offset] for r in got)
        # Damage in one segment never costs records of another, nor frames before it.
        intact = {i for i, (b, _, end) in extent.items() if end <= first_damage[b]}
        assert intact <= set(offsets)
        # ... and a damaged frame costs only itself: every untouched frame after it is read
        # (unless a cut took what follows it in the newest segment).
        untouched = {
            i
            for i, (b, start, end) in extent.items()
            if all(not (start <= at < end) for at in touched[b]) and end <= cut_at[b]
        }
        assert untouched <= set(offsets)
        assert reader.stats.missing_records <= len(records)
        reader.end_offset()
        for _, _, t in records[:3]:
            reader.offset_for_time(t)

        with LocalLog(directory, segment_bytes=segment_bytes) as log:
            next_offset = log.next_offset
            assert log.append(b"k", b"v", 0) == next_offset
        assert LogReader(directory).read(next_offset) == [LogRecord(next_offset, 0, b"k", b"v")]


@pytest.mark.parametrize("kind", ["folder", "fifo", "device", "consumers-a-file"])
def test_a_checkpoint_that_is_no_file_is_one_reason_never_a_hang(tmp_path: Path, kind: str) -> None:
    """The aggregator's checkpoint path holding a folder, a FIFO or a device (a symlink to
    /dev/zero), or `consumers` a file: a traceback (folder, `consumers`), a wait for a writer
    that never came (FIFO) or memory until it ran out (/dev/zero). Now CheckpointError (exit
    4), and a writer opening the log leaves it to that consumer."""
    with LocalLog(tmp_path) as log:
        fill(log, 0, 10)
    consumers = tmp_path / "consumers"
    path = consumers / "hami-usage-aggregator.json"
    if kind == "consumers-a-file":
        consumers.write_bytes(b"")
        reason = "Not a directory"
    else:
        consumers.mkdir()
        {"folder": path.mkdir, "fifo": lambda: os.mkfifo(path),
         "device": lambda: path.symlink_to("/dev/zero")}[kind]()  # fmt: skip
        reason = "not a regular file"
    result: list[BaseException] = []

    def load() -> None:
        try:
            open_checkpoint(LogReader(tmp_path), "hami-usage-aggregator", tmp_path)
        except BaseException as exc:
            result.append(exc)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive()  # no wait on the FIFO, no endless read
    (exc,) = result
    assert isinstance(exc, CheckpointError)
    assert str(exc) == (f"checkpoint of group hami-usage-aggregator unreadable: {path}: {reason}")
    with LocalLog(tmp_path) as log:  # (it rewinds checkpoints past its end when it opens)
        assert log.append(KEY, value(99), 5000) == 10


class FailingFsync:
    """`os.fsync` failing with `code` while `failing`, then the real one."""

    def __init__(self, code: int) -> None:
        self.code = code
        self.failing = True
        self._real = os.fsync

    def __call__(self, fd: int) -> None:
        if self.failing:
            raise OSError(self.code, os.strerror(self.code))
        self._real(fd)


def test_a_filesystem_that_refuses_fsync_loses_no_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`--fsync` on a filesystem without it (some FUSE and network ones: EINVAL). Every write
    succeeded, yet a refused fsync blocked the log like a full disk: the records of the next
    0.1 s were dropped, and each flush blocked it again, for good. Now each refusal is counted,
    the episode is logged once and its end once, and every record is kept."""
    fsync = FailingFsync(errno.EINVAL)
    writer_log = "collector.transport.locallog.writer"
    with (
        caplog.at_level(logging.WARNING, logger=writer_log),
        LocalLog(tmp_path, segment_bytes=20 * FRAME, fsync=True) as log,
    ):
        monkeypatch.setattr(os, "fsync", fsync)
        for i in range(50):  # (rolls a segment every 20)
            assert log.append(KEY, value(i), 1000 + i) == i
            log.flush()
        assert (log.blocked, log.stats.rejected_records) == (None, 0)
        assert log.stats.write_errors == 52  # each flush and each roll
        fsync.failing = False
        fill(log, 50, 51)
        log.flush()
    assert [r.getMessage() for r in caplog.records] == [
        f"local log {tmp_path}: fsync refused (Invalid argument): records are written but not "
        "durable across a power loss; tried again at each flush",
        f"local log {tmp_path}: fsync works again",
    ]
    assert list(LogReader(tmp_path).read(0, 100)) == [record(i) for i in range(51)]


def test_a_second_aggregator_of_the_same_group_is_refused(tmp_path: Path) -> None:
    """Two aggregators on one log directory and group each billed the whole log (1236 records
    twice) and overwrote each other's checkpoint. The second now gets one line and exit 1;
    once the first has stopped, it runs."""
    hami_usage = Path(sys.executable).parent / "hami-usage"
    with LocalLog(tmp_path / "log") as log:
        fill(log, 0, 3)
    first = subprocess.Popen(
        [hami_usage, "aggregate", "--log", tmp_path / "log", "--csv", tmp_path / "a.csv"],
        stderr=subprocess.PIPE,
    )
    try:
        lock = tmp_path / "log" / "consumers" / "hami-usage-aggregator.lock"
        deadline = time.monotonic() + 30
        while not (tmp_path / "log" / "consumers" / "hami-usage-aggregator.json").exists():
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        assert lock.exists()
        second = [hami_usage, "aggregate", "--log", tmp_path / "log", "--drain",
                  "--csv", tmp_path / "b.csv"]  # fmt: skip
        proc = subprocess.run(second, capture_output=True, text=True, timeout=60)
        assert (proc.returncode, proc.stderr) == (
            1,
            f"hami-usage aggregate: group hami-usage-aggregator of {tmp_path / 'log'} is in use "
            "by another aggregator\n",
        )
        assert not (tmp_path / "b.csv").exists()
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(30)
    assert subprocess.run(second, capture_output=True, timeout=60).returncode == 0


@pytest.mark.parametrize(
    "errno_, kind", [(28, "cannot write"), (20, "checkpoint unreadable")], ids=["full", "not-dir"]
)
def test_a_group_lock_that_cannot_be_made_says_why_as_its_checkpoint_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, errno_: int, kind: str
) -> None:
    """A full disk is a checkpoint that cannot be written (exit 1), as before the lock; a
    path that is not a folder of ours is an unreadable one (exit 4)."""
    from streams import WINDOW

    from collector.aggregate.service import AggregateSettings, OutputError, run_local

    with LocalLog(tmp_path / "log") as log:
        fill(log, 0, 3)
    real_open = os.open

    def refusing(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if str(path).endswith(".lock"):
            raise OSError(errno_, os.strerror(errno_))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing)
    settings = AggregateSettings(window=WINDOW, kafka=None, topic="t", billing_topic="b",
                                 group="g", log_dir=tmp_path / "log", drain=True)  # fmt: skip
    lock = tmp_path / "log" / "consumers" / "g.lock"
    with pytest.raises((OutputError, CheckpointError)) as raised:
        asyncio.run(run_local(settings, asyncio.Event()))
    if kind == "cannot write":
        assert type(raised.value) is OutputError
        assert str(raised.value) == f"cannot write {lock}: No space left on device"
    else:
        assert type(raised.value) is CheckpointError
        assert str(raised.value) == f"checkpoint of group g unreadable: {lock}: Not a directory"


def test_an_fsync_that_fails_with_an_io_error_blocks_the_log_as_a_failed_write_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EIO from fsync means what was written may be lost: an episode (the log blocked, its
    records held), not the refusal of a filesystem without fsync."""
    fsync = FailingFsync(errno.EIO)
    with LocalLog(tmp_path, fsync=True) as log:
        monkeypatch.setattr(os, "fsync", fsync)
        fill(log, 0, 3)
        log.flush()
        assert log.blocked == "Input/output error"
        assert log.stats.blocked_episodes == 1
        fsync.failing = False
        log.flush()
        fill(log, 3, 4)  # (an append after a flush that went through ends the episode)
        assert log.blocked is None
    assert list(LogReader(tmp_path).read(0, 10)) == [record(i) for i in range(4)]


def test_a_consumer_committing_behind_what_it_read_does_not_wedge_a_small_bound(
    tmp_path: Path,
) -> None:
    """An aggregator of the log commits the earliest event its open windows need, minutes
    behind what it read, and closes them only with later events. Under a bound smaller than a
    segment nothing fell below its commit, the active segment was never sealed (its commit
    never reached the end), and no event got in again: the collector dropped everything from
    then on. Segments are an eighth of the bound now, so whole ones fall below the commit."""
    reader = LogReader(tmp_path)
    lag = 40  # records the consumer commits behind the newest one
    with LocalLog(tmp_path, max_bytes=20_000) as log:
        stored = 0
        for i in range(2000):
            if log.append(KEY, value(i), 1000 + i) is not None:
                stored += 1
            log.flush()
            reader.commit("agg", max(0, log.next_offset - lag))
        assert stored == 2000, log.stats
        assert log.stats.blocked_episodes == 0
        assert sum(p.stat().st_size for p in tmp_path.glob("*.log")) <= 20_000
    assert [r.offset for r in reader.read(2000 - lag, 100)] == list(range(2000 - lag, 2000))
