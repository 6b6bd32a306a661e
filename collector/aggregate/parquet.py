"""Columnar billing sink: `--parquet DIR`, Parquet files partitioned by day (Hive style,
`DIR/day=YYYY-MM-DD/`), written with pyarrow.

Exactly once like the file sinks: each write is one *part*, numbered from 0, and written to a
temporary name, fsynced and renamed, one file per day it covers
(`part-<instance>-NNNNNNNNNN.parquet`: replicas sharing the folder never touch each other's).
The service commits the number of parts with its input position (`tell()`); on restart the sink
is opened with `resume_at=<that number>` and deletes the parts numbered from it on, which hold
only records that will be recomputed - the counterpart of truncating a CSV file."""

from __future__ import annotations

import datetime as dt
import logging
import os
import re
from pathlib import Path

from .columns import to_table
from .records import BillingRecord

__all__ = ["ParquetSink", "day_of"]

log = logging.getLogger(__name__)

# A part or a write of one not finished; the instance is everything between `part-` and the
# number (it may hold `-`: replica `a` must never take replica `a-b`'s files for its own).
_PART = re.compile(r"part-(?P<instance>.+)-(?P<n>\d{10})\.parquet(?P<tmp>\.tmp)?")
DAY_MS = 86_400_000


def day_of(ms: int) -> str:
    # (strftime's %Y does not pad a year below 1000: "300-01-01" sorted after "2026-…", and
    # `report --from 0300-01-01 --parquet` read no folder)
    d = dt.datetime.fromtimestamp(ms // 1000, tz=dt.UTC)
    return f"{d.year:04d}-{d.month:02d}-{d.day:02d}"


class ParquetSink:
    def __init__(
        self, root: str | Path, *, instance: str = "0", resume_at: int | None = None
    ) -> None:
        import pyarrow  # noqa: F401  (fail at start, not at the first window, when missing)

        self.path = Path(root)
        self.instance = instance
        self.path.mkdir(parents=True, exist_ok=True)
        parts = self._parts()
        top = max(parts, default=-1) + 1
        if resume_at is not None:
            removed = 0
            for n, files in parts.items():
                if n >= resume_at:
                    for f in files:
                        f.unlink()
                        removed += 1
            if removed:
                log.info("%s: removed %d parts written after the last commit", self.path, removed)
            top = resume_at
        self._next = top

    def _parts(self) -> dict[int, list[Path]]:
        parts: dict[int, list[Path]] = {}
        for day in self.path.glob("day=*"):
            if not day.is_dir():
                continue  # (not ours: parts are only ever written in folders)
            for f in day.iterdir():
                m = _PART.fullmatch(f.name)
                if m is None or m["instance"] != self.instance:
                    continue
                if m["tmp"]:
                    f.unlink()  # a write that never finished
                else:
                    parts.setdefault(int(m["n"]), []).append(f)
        return parts

    def write(self, records: list[BillingRecord]) -> None:
        if not records:
            return
        import pyarrow.parquet as pq

        by_day: dict[str, list[BillingRecord]] = {}
        for r in records:
            by_day.setdefault(day_of(r.window_start_ms), []).append(r)
        name = f"part-{self.instance}-{self._next:010d}.parquet"
        for day, rs in sorted(by_day.items()):
            folder = self.path / f"day={day}"
            folder.mkdir(exist_ok=True)
            tmp = folder / (name + ".tmp")
            pq.write_table(to_table(rs), tmp, compression="zstd")
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            tmp.rename(folder / name)
        self._next += 1

    def flush(self) -> None:
        """Each part is durable once written."""

    def tell(self) -> int:
        """The number of parts written (the next part's number)."""
        return self._next

    def close(self) -> None:
        """Nothing stays open between parts."""
