"""Collector memory at 5000 containers over time: RSS sampled every scan, slope after warm-up.

A steady node (bench_collector_scale.py's: every container launching kernels, a tenth of them
changing usage each second, no process starting or exiting) of `--containers` containers, one
`Scanner` scanning it at `--interval` for `--minutes`. After each scan the process's VmRSS is
read from /proc/self/status. Printed: RSS before the first scan, after warm-up (the first
`--warmup` fraction of the run), at the end and its maximum, and the least-squares slope of RSS
over the samples after warm-up, in MiB per minute and per hour. Flat means the slope stays
within noise (a few hundred KiB over the run).

    .venv/bin/python bench/bench_collector_rss.py [--minutes 10] [--containers 5000] [--python-gc]

The collector runs with the service's garbage-collector settings (`collector.runtime`);
`--python-gc` keeps Python's.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_collector import build  # noqa: E402
from bench_collector_scale import steady_step  # noqa: E402

from collector.node.scan import Scanner  # noqa: E402
from collector.runtime import tune_gc  # noqa: E402

MiB = 1 << 20


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over x."""
    xs = [x for x, _ in points]
    ys = [y for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in points) / den if den else 0.0


def collect(args: argparse.Namespace, root: Path) -> int:
    """The collector's side, in its own process: scan, sample RSS, print the figures."""
    load0 = os.getloadavg()
    if not args.python_gc:
        tune_gc()  # as the collector service does once it has started
    scanner = Scanner(root, heartbeat_s=30, inc=1)
    before = rss_bytes()
    start = time.monotonic()
    end = start + args.minutes * 60
    samples: list[tuple[float, float]] = []  # (minutes since start, RSS MiB)
    cpu: list[float] = []
    now_ms = 1_700_000_000_000
    late = 0
    while True:
        tick = time.monotonic()
        if tick >= end and samples:
            break
        c0 = time.process_time()
        scanner.scan(now_ms=now_ms)
        cpu.append((time.process_time() - c0) * 1000)
        samples.append(((time.monotonic() - start) / 60, rss_bytes() / MiB))
        now_ms += int(args.interval * 1000)
        wait = tick + args.interval - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        else:
            late += 1
    files = scanner.stats.files
    kept = scanner.discovery.open_count
    load1 = os.getloadavg()
    cut = args.minutes * args.warmup
    after = [(x, y) for x, y in samples if x >= cut] or samples
    per_min = slope(after)
    warm = after[0][1]
    top = max(y for _, y in samples)
    print(
        f"bench_collector_rss: {files} files, {kept} descriptors kept, {len(samples)} scans "
        f"over {samples[-1][0]:.1f} min ({late} late); load average {load0[0]:.2f} at start, "
        f"{load1[0]:.2f} at end ({os.cpu_count()} CPUs)"
    )
    print(
        f"  scan CPU: median {statistics.median(cpu):.1f} ms, mean {statistics.fmean(cpu):.1f} ms "
        f"(first scan {cpu[0]:.1f} ms)"
    )
    print(
        f"  RSS of the collector process: before the first scan {before / MiB:.1f} MiB; after "
        f"warm-up ({cut:.1f} min) {warm:.1f} MiB; at the end {samples[-1][1]:.1f} MiB; "
        f"max {top:.1f}"
    )
    print(
        f"  collector state: {(warm - before / MiB) / max(files, 1) * 1024:.1f} KiB per container "
        "(RSS after warm-up less RSS before the first scan)"
    )
    print(
        f"  slope after warm-up: {per_min * 1024:+.1f} KiB/min ({per_min * 60:+.2f} MiB/hour) "
        f"over {len(after)} samples; RSS change over that span "
        f"{(after[-1][1] - after[0][1]) * 1024:+.0f} KiB"
    )
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--containers", type=int, default=5000)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--warmup", type=float, default=0.2, help="fraction of the run (default 0.2)")
    ap.add_argument("--churn", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--python-gc",
        action="store_true",
        help="keep Python's garbage-collector settings, not the collector's (for comparison)",
    )
    ap.add_argument("--collect", metavar="ROOT", help=argparse.SUPPRESS)  # the child's side
    args = ap.parse_args()
    if args.collect:
        return collect(args, Path(args.collect))

    with tempfile.TemporaryDirectory(prefix="hami-bench-rss-") as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        sim = build(root, args.containers, args.seed)
        step = steady_step(sim, random.Random(args.seed), args.churn)
        procs = sum(len(c.procs) for c in sim.containers)
        print(f"built {args.containers} containers ({procs} processes) in "
              f"{time.perf_counter() - t0:.1f} s; the writer steps in this process, the "
              "collector scans in its own", flush=True)  # fmt: skip
        child = subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--collect", tmp])
        while child.poll() is None:
            tick = time.monotonic()
            step()
            time.sleep(max(0.0, tick + args.interval - time.monotonic()))
        sim.close()
        return child.returncode


if __name__ == "__main__":
    sys.exit(main())
