"""How long one consistent snapshot of a cache file takes, against plain copies of its bytes.

A v1.2 file with 8 live processes on 4 devices (written by CacheWriter). Four ways to read it,
measured interleaved in the same run (round-robin, so drift hits all of them alike):

  (a) read_snapshot(path)        open + detect + seqlock-consistent read + parse + close
  (b) snapshot_fd(fd)            the same on an already open descriptor
  (c) plain copy, needed bytes   open, pread header + the 8 slots + tail, close (no parsing)
  (d) plain copy, whole file     open(path, "rb").read() of the 2 MB region

Each round times CALLS calls of each way one by one; the figure is the median over ROUNDS of
the per-round medians, in microseconds. Goal: (a) <= 50 us per file on one core and
(a)/(c) <= 20.

    .venv/bin/python bench/bench_snapshot.py [--rounds 20] [--calls 2000] [--cpu N]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from collector.layout.declarations import V12
from collector.layout.detect import HEADER_BYTES
from collector.layout.reader import read_snapshot, snapshot_fd
from collector.simulate import CacheWriter, SimDevice

MiB = 1 << 20
GOAL_US = 50.0
GOAL_RATIO = 20.0
PROCS = 8
DEVICES = 4


def make_file(path: Path) -> None:
    devices = [
        SimDevice(f"GPU-{d:08x}-1111-2222-3333-444455556666", (10 + d) << 30, 50)
        for d in range(DEVICES)
    ]
    w = CacheWriter(path, V12, devices)
    for i in range(PROCS):
        pid, hostpid = 100 + i, 4000 + i
        w.add_process(pid, hostpid)
        for d in range(DEVICES):
            w.add_memory(pid, d, "context", 300 * MiB)
            w.add_memory(pid, d, "data", (i + 1) * (d + 1) * 64 * MiB)
    w.watch(
        {4000 + i: {d: ((i + 1) * 700 * MiB, 10 * i + d) for d in range(DEVICES)} for i in range(8)}
    )
    w.kernel_launched(time.time())
    w.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--cpu", type=int, default=None, help="pin to this CPU (default: the first)")
    args = ap.parse_args(argv)

    if hasattr(os, "sched_setaffinity"):
        cpu = args.cpu if args.cpu is not None else min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
        where = f"pinned to CPU {cpu}"
    else:
        where = "not pinned"

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.cache"
        make_file(path)
        spath = str(path)
        snap = read_snapshot(path)
        assert snap.layout == "v1.2" and len(snap.procs) == PROCS and not snap.anomalies, snap
        slots = PROCS * V12.slot_size
        tail = V12.region_size - V12.proc_num
        needed = HEADER_BYTES + slots + tail

        fd = os.open(path, os.O_RDONLY)

        def a() -> object:
            return read_snapshot(spath)

        def b() -> object:
            return snapshot_fd(fd, spath)

        def c() -> object:
            f = os.open(spath, os.O_RDONLY | os.O_CLOEXEC)
            try:
                return (
                    os.pread(f, HEADER_BYTES, 0),
                    os.pread(f, slots, V12.procs),
                    os.pread(f, tail, V12.proc_num),
                )
            finally:
                os.close(f)

        def d() -> object:
            with open(spath, "rb") as f:
                return f.read()

        ways: dict[str, Callable[[], object]] = {
            "(a) read_snapshot(path)": a,
            "(b) snapshot_fd(open fd)": b,
            f"(c) plain copy, {needed} B": c,
            f"(d) plain copy, whole {V12.file_size} B": d,
        }
        per_round: dict[str, list[float]] = {name: [] for name in ways}
        clock = time.perf_counter_ns
        for fn in ways.values():  # warm up
            for _ in range(200):
                fn()
        for _ in range(args.rounds):
            for name, fn in ways.items():
                times = []
                for _ in range(args.calls):
                    t0 = clock()
                    fn()
                    times.append(clock() - t0)
                per_round[name].append(statistics.median(times) / 1000)
        os.close(fd)

    med = {name: statistics.median(v) for name, v in per_round.items()}
    names = list(ways)
    print(
        f"bench_snapshot: v1.2, {PROCS} live processes x {DEVICES} devices; "
        f"{args.rounds} rounds x {args.calls} calls, interleaved; {where}"
    )
    print(f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs")
    for name in names:
        spread = f"{min(per_round[name]):.2f}..{max(per_round[name]):.2f}"
        print(f"  {name:<40} median {med[name]:9.2f} us   (round medians {spread})")
    ra = med[names[0]] / med[names[2]]
    rb = med[names[1]] / med[names[2]]
    rd = med[names[0]] / med[names[3]]
    print(f"  ratio (a)/(c) snapshot / plain copy of needed bytes: {ra:6.2f}")
    print(f"  ratio (b)/(c) snapshot_fd / plain copy of needed bytes: {rb:6.2f}")
    print(f"  ratio (a)/(d) snapshot / plain copy of the whole file: {rd:6.2f}")
    ok_time = med[names[0]] <= GOAL_US
    ok_ratio = ra <= GOAL_RATIO
    print(
        f"  goal (a) <= {GOAL_US:.0f} us: {'met' if ok_time else 'NOT met'}; "
        f"goal (a)/(c) <= {GOAL_RATIO:.0f}: {'met' if ok_ratio else 'NOT met'}"
    )
    return 0 if ok_time and ok_ratio else 1


if __name__ == "__main__":
    sys.exit(main())
