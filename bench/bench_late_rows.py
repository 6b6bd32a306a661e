"""CPU of the window close that applies one late usage sample, against the container's rows.

A container samples R rows a second for 500 s; then one sample of R rows of new processes
arrives 80 s behind the closed end (late: its rows are accounted as late key-milliseconds up to
the first later event of each key). Printed: the CPU of the next minute of input, whose first
close applies the late sample, beside the same minute without it, for R = 200, 400, 800. The
late rows' accounting reads the track's held history once per late event, so the extra cost
should grow with R, not with R squared.

    .venv/bin/python bench/bench_late_rows.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from collector.aggregate.intake import InputStats, add_record  # noqa: E402
from collector.aggregate.windows import Aggregator, WindowSettings  # noqa: E402
from collector.events import ContainerAppeared, DeviceLimit, UsageRow, UsageSample, encode  # noqa: E402

T0 = 1_800_000_000_000  # a window edge


def row(pid: int, total: int) -> UsageRow:
    return UsageRow(pid, pid + 1000, 0, total, 0, 0, total, 0, 0)


def minute_after(rows: int, late_rows: int) -> float:
    """CPU seconds of the minute of input after one late sample of `late_rows` rows."""
    agg = Aggregator(WindowSettings())
    stats = InputStats()
    seq = 0

    def send(event_of: object, rec: int) -> None:
        nonlocal seq
        add_record(agg, stats, b"n1", encode(event_of), source=0, offset=seq, record_ts_ms=rec)  # type: ignore[arg-type]
        seq += 1

    devices = [DeviceLimit(0, "GPU-0", 1000, 50)]
    send(ContainerAppeared(1, 7, seq, T0, 1, "pod-a", "main", "/p", "v1.2", devices), T0)
    sample = [row(p, 1000) for p in range(rows)]
    for s in range(1, 500):
        send(UsageSample(1, 7, seq, T0 + s * 1000, 1, sample), T0 + s * 1000)
        agg.advance()
    closed = agg.closed_until_ms
    assert closed is not None
    if late_rows:
        late = [row(100_000 + p, 7) for p in range(late_rows)]
        send(UsageSample(1, 7, seq, closed - 80_000, 1, late), T0 + 500_000)
    started = time.process_time()
    for s in range(500, 561):
        send(UsageSample(1, 7, seq, T0 + s * 1000, 1, sample), T0 + s * 1000)
        agg.advance()
    spent = time.process_time() - started
    assert agg.stats.late_events == (1 if late_rows else 0)
    return spent


def main() -> int:
    print("bench_late_rows: CPU s of the minute after one late sample (R rows a sample)")
    print(f"  {'R':>5} {'without':>8} {'with':>8} {'extra':>8}")
    for r in (200, 400, 800):
        without, with_late = minute_after(r, 0), minute_after(r, r)
        print(f"  {r:>5} {without:>8.3f} {with_late:>8.3f} {with_late - without:>8.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
