"""Collector cost on a busy node: CPU per scan and bytes on the wire per usage sample.

256 simulated containers (every layout in turn, 4 processes each, totals in the GiB range),
one `Scanner` over them. Between scans the simulator steps (allocations, frees, NVML samples,
exits, SIGKILLs, compaction), so every scan has real changes to diff and encode. Each scan
runs in the main thread and is timed with `time.process_time` (CPU of every thread of the
process), so work the scan hands to other threads would be counted too.

    .venv/bin/python bench/bench_collector.py [--scans 30] [--containers 256] [--profile]

Goals: a scan every second costs <= 2 % of one core; a usage row costs <= 48 bytes of
msgpack before compression.
"""

from __future__ import annotations

import argparse
import cProfile
import gzip
import io
import pstats
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgspec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from collector.events import Event, Heartbeat, UsageSample, encode  # noqa: E402
from collector.node.discover import TIMESTAMP_WINDOW_NS  # noqa: E402
from collector.node.scan import Scanner  # noqa: E402
from collector.simulate import GiB, MiB, NodeSimulator  # noqa: E402

CPU_GOAL_PERCENT = 2.0
ROW_BYTES_GOAL = 48.0


def build(root: Path, containers: int, seed: int) -> NodeSimulator:
    sim = NodeSimulator(root, containers, "mixed", seed=seed, procs_per_container=4)
    sim.step(time.time())  # starts the processes
    rng = random.Random(seed)
    for c in sim.containers:
        for p in c.procs.values():
            for d in range(len(c.writer.devices)):
                # 4 processes of 0.5-0.9 GiB stay under the 4-5 GiB limits: no over_limit noise.
                n = rng.randrange(512, 920) * MiB
                c.writer.add_memory(p.pid, d, "data", n)
                c.writer.add_memory(p.pid, d, "context", 300 * MiB)
                p.memory[d] = p.memory.get(d, 0) + n
    # A node in steady state: the containers started a while ago. (Discovery lists a
    # directory again while its ctime is under two seconds old, and a ctime cannot be set back.)
    time.sleep(TIMESTAMP_WINDOW_NS / 1e9 + 0.1)
    return sim


def usage_bytes(events: list[Event]) -> tuple[int, int]:
    """(msgpack bytes of the UsageSample events, rows in them)."""
    samples = [e for e in events if isinstance(e, UsageSample)]
    return sum(len(encode(e)) for e in samples), sum(len(e.rows) for e in samples)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scans", type=int, default=30)
    ap.add_argument("--containers", type=int, default=256)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--profile", action="store_true", help="always print a cProfile of scans")
    ap.add_argument("--sort", default="tottime", help="profile order (cumulative, tottime)")
    ap.add_argument("--top", type=int, default=15, help="profile rows")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="hami-bench-") as tmp:
        root = Path(tmp)
        sim = build(root, args.containers, args.seed)
        scanner = Scanner(root, heartbeat_s=30, inc=1)
        now_ms = 1_700_000_000_000
        first = scanner.scan(now_ms=now_ms)  # every container appears: not a steady-state scan
        cpu_ms: list[float] = []
        wire = rows = 0
        last: list[Event] = []
        for _ in range(args.scans):
            sim.step(time.time())
            now_ms += 1000
            t0 = time.process_time()
            events = scanner.scan(now_ms=now_ms)
            cpu_ms.append((time.process_time() - t0) * 1000)
            b, r = usage_bytes(events)
            wire, rows = wire + b, rows + r
            last = events

        median = statistics.median(cpu_ms)
        share = median / 1000 * 100  # one scan a second
        per_row = wire / rows
        all_bytes = b"".join(encode(e) for e in last)
        gz_all = len(gzip.compress(all_bytes, 6))
        last_rows = sum(len(e.rows) for e in last if isinstance(e, UsageSample))
        usage_only = b"".join(encode(e) for e in last if isinstance(e, UsageSample))
        gz_usage = len(gzip.compress(usage_only, 6))
        files = scanner.stats.files
        hb = sum(isinstance(e, Heartbeat) for e in last)
        procs = sum(len(c.procs) for c in sim.containers)

        print(f"node: {files} cache files, {procs} live processes, layouts mixed")
        print(f"first scan (all containers appear): {len(first)} events")
        print(
            f"scan CPU over {args.scans} scans: median {median:.2f} ms, "
            f"min {min(cpu_ms):.2f} ms, max {max(cpu_ms):.2f} ms"
        )
        print(
            f"share of one core at 1 Hz: {share:.2f} % (goal <= {CPU_GOAL_PERCENT} %): "
            f"{'MET' if share <= CPU_GOAL_PERCENT else 'MISSED'}"
        )
        print(
            f"usage rows per scan: {rows / args.scans:.0f} "
            f"(in {sum(isinstance(e, UsageSample) for e in last)} UsageSample events last scan)"
        )
        print(
            f"msgpack bytes per usage row (UsageSample events / rows, all scans): "
            f"{per_row:.1f} (goal <= {ROW_BYTES_GOAL:.0f}): "
            f"{'MET' if per_row <= ROW_BYTES_GOAL else 'MISSED'}"
        )
        print(
            f"gzip per usage row, last scan: UsageSample events {gz_usage / last_rows:.1f} B, "
            f"all {len(last)} events ({hb} heartbeat parts) {gz_all / last_rows:.1f} B "
            f"(raw {len(usage_only) / last_rows:.1f} B and {len(all_bytes) / last_rows:.1f} B)"
        )
        # The same rows on a big GPU: totals of tens of GiB need 9-byte msgpack integers.
        big = 24 * GiB
        wide = [
            msgspec.structs.replace(
                e,
                rows=[
                    msgspec.structs.replace(
                        r, total=r.total + big, data=r.data + big, monitor=r.monitor + big
                    )
                    for r in e.rows
                ],
            )
            for e in last
            if isinstance(e, UsageSample)
        ]
        b, r = usage_bytes(list(wide))
        print(
            f"msgpack bytes per usage row with totals of 24+ GiB (u64 integers): {b / r:.1f} "
            f"(goal <= {ROW_BYTES_GOAL:.0f}): {'MET' if b / r <= ROW_BYTES_GOAL else 'MISSED'}"
        )
        example = next(e for e in last if isinstance(e, UsageSample))
        print(f"example row: {example.rows[0]}")

        if args.profile or share > CPU_GOAL_PERCENT:
            prof = cProfile.Profile()
            for _ in range(10):
                sim.step(time.time())
                now_ms += 1000
                prof.enable()
                scanner.scan(now_ms=now_ms)
                prof.disable()
            out = io.StringIO()
            stats = pstats.Stats(prof, stream=out)
            stats.sort_stats(args.sort).print_stats(args.top)
            print("\nprofile of 10 scans (by own time):")
            print(out.getvalue())
        sim.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
