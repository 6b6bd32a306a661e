"""What the collector's garbage-collector settings (collector/runtime.py) save, side by side.

Two parts, each comparing Python's default settings ("default") with `tune_gc`'s ("tuned":
start-up objects frozen, the youngest generation collected every 50 000 net allocations
instead of 700), each in processes of its own:

* collector: a steady node (bench_collector_scale.py's) of `--containers` containers whose
  writer steps once a second in this process; two scanner processes, one per setting, each
  with the modules the services import (the Kubernetes client among them), scan it
  in turn after every step (the order alternating). Printed per setting: CPU per scan (the
  whole process's, so collections are in it), its mean as well as its median (a full
  collection lands in one scan of many: the median hides it, a core's budget does not), the
  time spent in collections per scan, and the process's RSS at the end.
* aggregator: bench_aggregate_ab.py's stream of `--rows` usage rows through
  `bench_e2e.drive` (the service's consumption path without the broker), fresh processes
  alternating between the settings, `--inner` runs per process (the least CPU counts). The
  `aggregate` service keeps Python's defaults: this part measured it slower with `tune_gc`.

    .venv/bin/python bench/bench_gc.py [--containers 5000] [--scans 30] [--rows 400000]
                                       [--repeat 3] [--inner 3] [--parts collector,aggregator]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SETTINGS = ("default", "tuned")


class GcClock:
    """Seconds spent in collections and their count, from `gc.callbacks`."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.count = 0
        self._began = 0.0
        gc.callbacks.append(self._tick)

    def _tick(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._began
            self.count += 1


def set_up(setting: str) -> None:
    """As a service starts, after its imports: the setting (`tuned`: `tune_gc`)."""
    from collector.runtime import tune_gc

    if setting == "tuned":
        tune_gc()


def scanner_child(root: str, setting: str) -> int:
    """One scanner: a scan for each line on stdin, a JSON line of its costs on stdout."""
    import kubernetes_asyncio.client  # noqa: F401  (the pod watch's client: open_api imports it)
    from bench_collector_rss import MiB, rss_bytes

    import collector.node.service  # noqa: F401
    from collector.node.scan import Scanner

    set_up(setting)
    clock = GcClock()
    scanner = Scanner(Path(root), heartbeat_s=30, inc=1)
    now_ms = 1_700_000_000_000
    for _ in range(2):  # every container appears, the memos fill
        scanner.scan(now_ms=now_ms)
        now_ms += 1
    print("ready", flush=True)
    for line in sys.stdin:
        now_ms = int(line)
        gc_s, gc_n = clock.seconds, clock.count
        c0 = time.process_time()
        scanner.scan(now_ms=now_ms)
        cpu = time.process_time() - c0
        out = {
            "cpu": cpu,
            "gc": clock.seconds - gc_s,
            "n": clock.count - gc_n,
            "rss": rss_bytes() / MiB,
        }
        print(json.dumps(out), flush=True)
    return 0


def _ask(child: subprocess.Popen[str], line: str) -> dict[str, Any]:
    stdin, stdout = child.stdin, child.stdout
    assert stdin is not None and stdout is not None
    stdin.write(line + "\n")
    stdin.flush()
    got: dict[str, Any] = json.loads(stdout.readline())
    return got


def _wait_ready(out: IO[str] | None) -> None:
    assert out is not None
    line = out.readline().strip()
    if line != "ready":
        raise SystemExit(f"bench_gc: a scanner process failed to start ({line!r})")


def collector_part(containers: int, scans: int, seed: int) -> None:
    from bench_collector import build
    from bench_collector_scale import steady_step

    with tempfile.TemporaryDirectory(prefix="hami-bench-gc-") as tmp:
        t0 = time.perf_counter()
        sim = build(Path(tmp), containers, seed)
        step = steady_step(sim, random.Random(seed), 0.1)
        print(f"collector: built {containers} containers in {time.perf_counter() - t0:.1f} s")
        children = {
            s: subprocess.Popen(
                [sys.executable, __file__, "--scanner", tmp, "--setting", s],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for s in SETTINGS
        }
        try:
            for child in children.values():
                _wait_ready(child.stdout)
            time.sleep(2.1)  # folders older than discovery's timestamp window, as on a node
            load0 = os.getloadavg()[0]
            got: dict[str, list[dict[str, Any]]] = {s: [] for s in SETTINGS}
            now_ms = 1_700_000_001_000
            for i in range(scans):
                step()
                now_ms += 1000
                for s in SETTINGS if i % 2 == 0 else SETTINGS[::-1]:
                    got[s].append(_ask(children[s], str(now_ms)))
            load1 = os.getloadavg()[0]
        finally:
            for child in children.values():
                assert child.stdin is not None
                child.stdin.close()
                child.wait()
            sim.close()
    print(
        f"collector: {scans} scans of each setting, in turn; load average {load0:.2f} at start, "
        f"{load1:.2f} at end ({os.cpu_count()} CPUs)"
    )
    print(
        f"  {'setting':<8} {'CPU ms/scan mean':>16} {'median':>7} {'max':>7} "
        f"{'GC ms/scan':>10} {'collections':>11} {'RSS MiB':>8}"
    )
    mean: dict[str, float] = {}
    median: dict[str, float] = {}
    for s in SETTINGS:
        cpu = [r["cpu"] * 1000 for r in got[s]]
        mean[s], median[s] = statistics.fmean(cpu), statistics.median(cpu)
        print(
            f"  {s:<8} {mean[s]:>16.1f} {median[s]:>7.1f} {max(cpu):>7.1f} "
            f"{statistics.fmean(r['gc'] for r in got[s]) * 1000:>10.1f} "
            f"{sum(r['n'] for r in got[s]):>11} {got[s][-1]['rss']:>8.1f}"
        )
    print(
        f"  default/tuned: {mean['default'] / mean['tuned']:.2f}x by means, "
        f"{median['default'] / median['tuned']:.2f}x by medians; "
        f"tuned {mean['tuned'] / 10:.2f} % of a core at 1 Hz (mean)"
    )


def aggregator_child(setting: str, rows: int, inner: int) -> int:
    import bench_aggregate_ab
    import bench_e2e

    import collector.aggregate.service  # noqa: F401

    batches, total = bench_aggregate_ab.stream(rows)
    set_up(setting)
    clock = GcClock()
    best: dict[str, float] | None = None
    for _ in range(inner):
        consumer = bench_aggregate_ab.StandIn(batches)
        gc_s = clock.seconds
        with tempfile.TemporaryDirectory(prefix="bench-gc-") as out:
            _, _, _, _, cpu = asyncio.run(
                bench_e2e.drive(consumer, lambda nxt: sum(nxt.values()) >= total, out)
            )
        if best is None or cpu < best["cpu"]:
            best = {"cpu": cpu, "gc": clock.seconds - gc_s}
    assert best is not None
    best["maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(best), flush=True)
    os._exit(0)  # the aggregators' teardown is not part of the drive


def aggregator_part(rows: int, repeat: int, inner: int) -> None:
    got: dict[str, list[dict[str, float]]] = {s: [] for s in SETTINGS}
    for i in range(repeat):
        for s in SETTINGS if i % 2 == 0 else SETTINGS[::-1]:
            cmd = [sys.executable, __file__, "--aggregator", "--setting", s]
            cmd += ["--rows", str(rows), "--inner", str(inner)]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise SystemExit(f"bench_gc: the {s} run failed:\n{proc.stderr[-4000:]}")
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            got[s].append(r)
            print(
                f"  round {i + 1} {s}: {r['cpu']:.3f} s CPU ({rows / r['cpu']:,.0f} rows/s), "
                f"{r['gc'] * 1000:.0f} ms of it in collections, max RSS {r['maxrss']:.0f} MiB "
                f"(load {os.getloadavg()[0]:.2f})"
            )
    med = {s: statistics.median(r["cpu"] for r in got[s]) for s in SETTINGS}
    print(
        f"aggregator: {rows:,} rows, median CPU default {med['default']:.3f} s, tuned "
        f"{med['tuned']:.3f} s: {med['default'] / med['tuned']:.2f}x by medians"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--containers", type=int, default=5000)
    ap.add_argument("--scans", type=int, default=30)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rows", type=int, default=400_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--inner", type=int, default=3)
    ap.add_argument("--parts", default="collector,aggregator")
    ap.add_argument("--setting", choices=SETTINGS, help=argparse.SUPPRESS)
    ap.add_argument("--scanner", metavar="ROOT", help=argparse.SUPPRESS)
    ap.add_argument("--aggregator", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.scanner:
        return scanner_child(args.scanner, args.setting)
    if args.aggregator:
        return aggregator_child(args.setting, args.rows, args.inner)
    parts = args.parts.split(",")
    if "collector" in parts:
        collector_part(args.containers, args.scans, args.seed)
    if "aggregator" in parts:
        aggregator_part(args.rows, args.repeat, args.inner)
    return 0


if __name__ == "__main__":
    sys.exit(main())
