"""Append-only, checksummed, segmented log on local disk.

Used instead of Kafka when no broker is configured (an aggregator in another process reads the
same directory) and as the collector's outage spool (events go here while Kafka is down and are
drained in order when it returns).

Layout of a log directory::

    00000000000000000000.log   segment files, named by the offset of their first record
    00000000000000004096.log
    writer.lock                flock'd by the single writer process
    consumers/<group>.json     consumer checkpoints (next offset to read + metadata)
    consumers/<group>.lock     flock'd by the one process reading as that group

`frames` declares the frame of one record and how a damaged one is passed over; `writer` is
the single writer (`LocalLog`); `reader` reads without a lock (`LogReader`); `checkpoint`
keeps the consumer checkpoints.
"""

from .checkpoint import CorruptCheckpointError, GroupInUseError, group_lock
from .frames import FRAME_OVERHEAD
from .reader import LogReader, LogRecord, ReaderStats
from .writer import LocalLog, LogLockedError, LogOpenError, WriterStats

__all__ = [
    "FRAME_OVERHEAD",
    "CorruptCheckpointError",
    "GroupInUseError",
    "LocalLog",
    "LogLockedError",
    "LogOpenError",
    "LogReader",
    "LogRecord",
    "ReaderStats",
    "WriterStats",
    "group_lock",
]
