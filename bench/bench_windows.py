"""Pure windowing throughput on one core: Aggregator.add + advance, nothing else.

    .venv/bin/python bench/bench_windows.py [--containers 200] [--procs 4] [--devices 2]
                                            [--seconds 600] [--batch-seconds 1]

Every container sends one UsageSample per second with a row per process and device (values
change every second). Events are built before the clock starts; `advance()` runs after every
`--batch-seconds` of events, like the service does after each poll. The cyclic GC stays on
(the pre-built input is frozen out of it) unless --no-gc. Goal: >= 500 000 rows/s.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

from collector.aggregate.windows import Aggregator, WindowSettings
from collector.events import ContainerAppeared, DeviceLimit, Event, UsageRow, UsageSample

GOAL_ROWS_PER_S = 500_000
MIB = 1 << 20


def build(
    containers: int, procs: int, devices: int, seconds: int, t0: int
) -> tuple[list[Event], int]:
    inc = 42
    seq = 0
    events: list[Event] = []
    for cid in range(containers):
        limits = [DeviceLimit(d, f"GPU-{d:02d}", 8192 * MIB, 50) for d in range(devices)]
        events.append(
            ContainerAppeared(
                1, inc, seq, t0, cid, f"pod-{cid:04d}", "main", f"/c/{cid}", "v1.2", limits
            )
        )
        seq += 1
    rows = 0
    for s in range(seconds):
        ts = t0 + s * 1000
        for cid in range(containers):
            batch = [
                UsageRow(p, 10_000 + p, d, (256 + (s + p + cid) % 7) * MIB, MIB, 0, 0, MIB, s % 100)
                for p in range(procs)
                for d in range(devices)
            ]
            events.append(UsageSample(1, inc, seq, ts, cid, batch))
            seq += 1
            rows += len(batch)
    return events, rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--containers", type=int, default=200)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--seconds", type=int, default=600)
    ap.add_argument("--batch-seconds", type=int, default=1)
    ap.add_argument("--no-gc", action="store_true", help="disable the cyclic GC while timing")
    args = ap.parse_args(argv)

    t0 = 1_790_000_000_000  # aligned to the minute
    events, rows = build(args.containers, args.procs, args.devices, args.seconds, t0)
    per_batch = args.containers * args.batch_seconds
    head = args.containers  # the ContainerAppeared events
    agg = Aggregator(WindowSettings())
    records = 0

    gc.collect()
    if args.no_gc:
        gc.disable()
    else:
        # The service decodes and drops its input batch by batch; here the whole input is built
        # up front, and without this every full collection would walk all of it.
        gc.freeze()
    try:
        start = time.perf_counter()
        cpu_start = time.process_time()
        add = agg.add
        for e in events[:head]:
            add("node-1", e)
        for i in range(head, len(events), per_batch):
            for e in events[i : i + per_batch]:
                add("node-1", e)
            records += len(agg.advance())
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu_start
        flush_start = time.perf_counter()
        records += len(agg.flush())
        flush_s = time.perf_counter() - flush_start
    finally:
        gc.enable()
        gc.unfreeze()

    rate = rows / elapsed
    print(
        f"windows bench: {args.containers} containers x {args.procs} procs x {args.devices} "
        f"devices, {args.seconds} s of samples at 1/s, advance every {args.batch_seconds} s, "
        f"gc {'off' if args.no_gc else 'on'}"
    )
    print(f"  events   {len(events):>12,}")
    print(f"  rows     {rows:>12,}")
    print(f"  records  {records:>12,}")
    events_rate = len(events) / elapsed
    print(f"  add+advance  {elapsed:8.3f} s  {rate:>12,.0f} rows/s  {events_rate:>10,.0f} events/s")
    # CPU time: on a shared, loaded machine the wall clock also counts waiting for a core.
    print(f"  cpu          {cpu:8.3f} s  {rows / cpu:>12,.0f} rows/s per CPU second")
    print(f"  flush        {flush_s:8.3f} s")
    met = rate >= GOAL_ROWS_PER_S
    print(f"  goal {GOAL_ROWS_PER_S:,} rows/s: {'met' if met else 'NOT met'}")
    print(f"  python {sys.version.split()[0]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
