"""File outputs of billing records: CSV and JSON lines, exactly once across restarts.

A file sink only appends. The service flushes it (fsync) before it commits its input position
and stores `tell()` in the commit metadata; on restart the sink is opened with
`resume_at=<that length>`, which truncates whatever was written after the last commit, so the
records that get recomputed are not written twice. The CSV header row is written only to an
empty file (so also after a truncation back to 0).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, Self

from ..csvtext import Writer
from .records import CSV_FIELDS, BillingRecord, csv_row, jsonl_line

__all__ = ["CsvSink", "FileSink", "JsonlSink"]

log = logging.getLogger(__name__)


class FileSink:
    """Append-only record file; subclasses say how records and the header are encoded."""

    def __init__(self, path: str | Path, *, resume_at: int | None = None) -> None:
        self.path = Path(path)
        # Bytes the checkpoint promised but the file no longer has (someone cut or replaced it):
        # those records cannot be recreated here, so this is reported instead of hidden.
        self.missing_bytes = 0
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        self._file: BinaryIO = os.fdopen(fd, "r+b")
        size = self._file.seek(0, os.SEEK_END)
        if resume_at is not None:
            if resume_at < 0:
                raise ValueError(f"resume_at must be >= 0, got {resume_at}")
            if resume_at <= size:
                self._file.truncate(resume_at)
                size = self._file.seek(resume_at)
            else:
                self.missing_bytes = resume_at - size
                log.warning(
                    "%s is %d bytes, shorter than its checkpoint (%d): appending after it",
                    self.path,
                    size,
                    resume_at,
                )
        self._size = size
        if size == 0:
            header = self._header()
            if header:
                self._append(header)

    def _header(self) -> bytes:
        return b""

    def _encode(self, records: list[BillingRecord]) -> bytes:
        raise NotImplementedError

    def _append(self, data: bytes) -> None:
        self._file.write(data)
        self._size += len(data)

    def write(self, records: list[BillingRecord]) -> None:
        if records:
            self._append(self._encode(records))

    def flush(self) -> None:
        """Make everything written so far durable (call before committing `tell()`)."""
        self._file.flush()
        os.fsync(self._file.fileno())

    def tell(self) -> int:
        """Length of the file in bytes, including what is not flushed yet."""
        return self._size

    def close(self) -> None:
        """Closed even when the flush fails (a full disk): the error is raised, and the buffer
        it could not write is dropped (a restart cuts the file back to its last commit)."""
        if self._file.closed:
            return
        try:
            self.flush()
        except OSError:
            with contextlib.suppress(OSError):  # (its flush fails the same way)
                self._file.close()
            raise
        self._file.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _csv_bytes(rows: list[list[str]]) -> bytes:
    buf = io.StringIO()
    Writer(buf).writerows(rows)
    return buf.getvalue().encode()


class CsvSink(FileSink):
    """CSV with a header row (`records.CSV_FIELDS`), `\\n` line ends, UTF-8.

    A file begun by an earlier record version has fewer columns (later versions only append
    columns): rows appended to it keep its columns, so the file stays one valid table, and the
    columns it lacks are named once in a warning (a new file gets them)."""

    def __init__(self, path: str | Path, *, resume_at: int | None = None) -> None:
        super().__init__(path, resume_at=resume_at)
        self.columns = len(CSV_FIELDS)
        head = os.pread(self._file.fileno(), 1 << 16, 0).split(b"\n", 1)[0].decode(errors="replace")
        names = head.split(",")
        if len(names) < len(CSV_FIELDS) and names == list(CSV_FIELDS[: len(names)]):
            self.columns = len(names)
            log.warning(
                "%s has the columns of an earlier record version: %s not written to it",
                self.path,
                ", ".join(CSV_FIELDS[self.columns :]),
            )

    def _header(self) -> bytes:
        return _csv_bytes([list(CSV_FIELDS)])

    def _encode(self, records: list[BillingRecord]) -> bytes:
        n = self.columns
        return _csv_bytes([csv_row(r)[:n] for r in records])


class JsonlSink(FileSink):
    """One JSON object per line (`records.jsonl_line`)."""

    def _encode(self, records: list[BillingRecord]) -> bytes:
        return b"".join(jsonl_line(r) for r in records)
