"""Collector CPU per scan against node size: the curve at 16, 256, 1000 and 5000 containers.

Each node is built like bench_collector.py's (every layout in turn, 4 processes per container,
totals in the GiB range, folders older than the listing's two-second window), all of them in
one run; the scans are interleaved (one scan of each node per round, in turn) so load drift on
this shared machine hits every size alike. A scan is timed with `time.process_time` (CPU of
the whole process) and the writer's changes between scans are not timed. The garbage
collector runs with the collector service's settings (`collector.runtime.tune_gc`, applied
once the nodes are built). Printed: the median CPU per scan and, beside it, the mean (a
collection of the old generation lands in one scan of many: a core's budget is the mean).

Two kinds of node, both printed:

* steady: every container's processes keep launching kernels (its tail's `last_kernel_time`
  moves every second), and a fraction `--churn` (default 0.1) of the containers change per
  second: one process allocates or frees and the utilization watcher writes new samples. No
  process starts or exits.
* busy: `NodeSimulator.step` between scans (bench_collector.py's node): every process allocates
  or frees every second, every watcher sample changes, 5 % of containers see an exit, 2 % a
  SIGKILL, 3 % a compaction.

`--reuse-off` adds the same scans with `Scanner(reuse=False)` and no descriptor kept (every
file opened, parsed and diffed in full on each scan, as before) beside them. The simulator's
writers hold a descriptor per file and the kept ones two: run one kind at a time under a
RLIMIT_NOFILE of 20 000.

    .venv/bin/python bench/bench_collector_scale.py [--kinds steady|busy] [--sizes 16,256,1000,5000]
        [--rounds 7] [--reuse-off]

Goals: steady 256 containers <= 0.5 % of one core at 1 Hz (5 ms CPU per scan); 5000 containers
<= 120 ms CPU per scan; the per-container cost flat across sizes (linear growth).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_collector import build  # noqa: E402

from collector.node.discover import ListingLimits  # noqa: E402
from collector.node.scan import Scanner  # noqa: E402
from collector.runtime import tune_gc  # noqa: E402
from collector.simulate import MiB, NodeSimulator  # noqa: E402


def steady_step(sim: NodeSimulator, rng: random.Random, churn: float) -> Callable[[], None]:
    # Each step is one second of the node's life, whatever the wall clock says (the rounds
    # run back to back): `last_kernel_time` is in seconds, so it moves at every step.
    clock = [time.time()]

    def step() -> None:
        clock[0] += 1.0
        now = clock[0]
        for c in sim.containers:
            c.writer.kernel_launched(now)
            if rng.random() >= churn or not c.procs:
                continue
            p = rng.choice(list(c.procs.values()))
            d = rng.randrange(len(c.writer.devices))
            n = (
                rng.randrange(1, 64)
                * MiB
                * (1 if rng.random() < 0.5 or not p.memory.get(d) else -1)
            )
            if p.memory.get(d, 0) + n >= 0:
                c.writer.add_memory(p.pid, d, "data", n)
                p.memory[d] = p.memory.get(d, 0) + n
            c.writer.watch(
                {
                    q.hostpid: {
                        d: (m + 300 * MiB, rng.randrange(0, 101)) for d, m in q.memory.items()
                    }
                    for q in c.procs.values()
                }
            )

    return step


Run = tuple[str, int, bool, Callable[[], None], Scanner]


def calls_alone(scanner: Scanner) -> Callable[[], int]:
    """The system calls of one steady scan of `scanner`'s node, in a tight loop of their own:
    the root's listing (`scandir`, sorted as discovery sorts it), per container the `fstat` of
    its kept folder and of its kept file, and the reads `_snapshot_known` makes of a file whose
    header and slots are as last scan (the tail with the probed bytes, then the header and
    slots once), of the lengths it read last scan. Returns the calls made. Their time is a
    floor: no Python collector that keeps the protocol and the path checks can scan faster."""
    discovery = scanner.discovery
    root_fd = discovery._root_fd
    plan: list[tuple[int, int, int, int, int]] = []
    for dir_name, held in discovery._held.items():
        for name, kept in held.files.items():
            key = (os.path.join(discovery.root, dir_name, name), kept[1], kept[2])
            memo = scanner._memos.get(key)
            if memo is None or memo.header is None or memo.past is None:
                continue
            hdr = memo.header
            plan.append((held.fd, kept[0], hdr.hi - hdr.lo, hdr.lo, len(memo.past[2])))
    if not plan:  # a floor of the listing alone would be a wrong figure, not a small one
        raise SystemExit("bench_collector_scale: no kept file has a memo (did the keys change?)")
    fstat, pread = os.fstat, os.pread

    def run() -> int:
        calls = 1
        sorted(os.scandir(root_fd), key=lambda e: e.name)
        for dir_fd, fd, window, lo, m in plan:
            fstat(dir_fd)
            fstat(fd)
            pread(fd, window, lo)
            pread(fd, m, 0)
            calls += 4
        return calls

    return run


def _swapped(runs: list[Run]) -> list[Run]:
    """The runs with each node's scanners in the reverse order."""
    out: list[Run] = []
    for run in runs:
        same_node = bool(out) and out[-1][3] is run[3]
        out.insert(len(out) - 1 if same_node else len(out), run)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="16,256,1000,5000")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--churn", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kinds", default="steady", help="steady, busy or steady,busy")
    ap.add_argument("--reuse-off", action="store_true", help="also scan with reuse=False")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    kinds = args.kinds.split(",")
    modes = [True, False] if args.reuse_off else [True]
    load0 = os.getloadavg()

    with tempfile.TemporaryDirectory(prefix="hami-bench-scale-") as tmp:
        runs: list[Run] = []
        now_ms = 1_700_000_000_000
        sims = []
        for kind in kinds:
            for n in sizes:
                t0 = time.perf_counter()
                root = Path(tmp) / f"{kind}-{n}"
                root.mkdir()
                sim = build(root, n, args.seed)
                sims.append(sim)
                rng = random.Random(args.seed)
                step = (
                    steady_step(sim, rng, args.churn)
                    if kind == "steady"
                    else (lambda s=sim: s.step(time.time()))
                )
                for reuse in modes:
                    # reuse off is the collector as it was: every file opened on each scan.
                    listing = ListingLimits() if reuse else ListingLimits(open_files=0)
                    scanner = Scanner(root, heartbeat_s=30, inc=1, reuse=reuse, listing=listing)
                    scanner.scan(now_ms=now_ms)  # every container appears
                    scanner.scan(now_ms=now_ms + 1)  # memos filled
                    runs.append((kind, n, reuse, step, scanner))
                print(f"built {kind} node of {n} containers in {time.perf_counter() - t0:.1f} s")
        # Folders just made are within the timestamp window (see discover.py): on a node in
        # steady state they are older.
        time.sleep(2.1)
        tune_gc()  # as the collector service does once it has started
        cpu: dict[tuple[str, int, bool], list[float]] = {(k, n, r): [] for k, n, r, _, _ in runs}
        events: dict[tuple[str, int, bool], list[int]] = {(k, n, r): [] for k, n, r, _, _ in runs}
        floor: dict[int, list[float]] = {n: [] for n in sizes}  # steady nodes' calls alone
        calls: dict[int, int] = {}
        for r in range(args.rounds):
            now_ms += 1000
            stepped: set[int] = set()
            # Every other round the reuse-off scan of a node goes first: the first scan after
            # the writer's step finds the caches cold, and neither should always get that.
            order = runs if r % 2 == 0 else _swapped(runs)
            for kind, n, reuse, step, scanner in order:
                if id(step) not in stepped:  # one writer step per node per round
                    step()
                    stepped.add(id(step))
                t0 = time.process_time()
                out = scanner.scan(now_ms=now_ms)
                cpu[kind, n, reuse].append((time.process_time() - t0) * 1000)
                events[kind, n, reuse].append(len(out))
                if reuse and kind == "steady":
                    alone = calls_alone(scanner)  # (planned from the scan just made)
                    t0 = time.process_time()
                    calls[n] = alone()
                    floor[n].append((time.process_time() - t0) * 1000)
        load1 = os.getloadavg()
        procs = {n: None for n in sizes}
        for sim in sims:
            procs[len(sim.containers)] = sum(len(c.procs) for c in sim.containers)
        for sim in sims:
            sim.close()

    print(
        f"bench_collector_scale: {args.rounds} rounds, scans interleaved (order alternating); "
        f"steady churn "
        f"{args.churn:g}; load average {load0[0]:.2f} at start, {load1[0]:.2f} at end "
        f"({os.cpu_count()} CPUs)"
    )
    print(
        f"  {'node':<7} {'containers':>10} {'processes':>9} {'reuse':>5} "
        f"{'CPU ms/scan':>11} {'us/container':>12} {'% core @1Hz':>11} {'mean ms':>8} "
        f"{'events':>7}"
    )
    med = {key: statistics.median(v) for key, v in cpu.items()}
    mean = {key: statistics.fmean(v) for key, v in cpu.items()}
    for kind, n, reuse, _, _ in runs:
        m = med[kind, n, reuse]
        ev = statistics.median(events[kind, n, reuse])
        print(
            f"  {kind:<7} {n:>10} {procs[n]:>9} {'on' if reuse else 'off':>5} {m:>11.2f} "
            f"{m / n * 1000:>12.1f} {m / 10:>11.2f} "
            f"{mean[kind, n, reuse]:>8.2f} {ev:>7.0f}"
        )
    for n in sizes:
        if floor[n]:
            f, m = statistics.median(floor[n]), med["steady", n, True]
            print(
                f"  steady {n}: its {calls[n]:,} system calls alone {f:.2f} ms "
                f"({f / n * 1000:.1f} us/container, {f / 10:.2f} % of a core at 1 Hz): "
                f"{f / m:.0%} of the scan, the Python around them {m - f:.2f} ms"
            )
    if args.reuse_off:
        for kind in kinds:
            for n in sizes:
                print(
                    f"  {kind} {n}: reuse off / on = {med[kind, n, False] / med[kind, n, True]:.2f}"
                )
    if 256 in sizes and "steady" in kinds:
        m, a = med["steady", 256, True], mean["steady", 256, True]
        verdict = "met" if max(m, a) <= 5 else "NOT met"
        print(
            f"  goal steady 256 <= 0.5 % of a core: {m / 10:.2f} % (mean {a / 10:.2f} %): {verdict}"
        )
    if 5000 in sizes:
        for kind in kinds:
            m, a = med[kind, 5000, True], mean[kind, 5000, True]
            print(
                f"  goal {kind} 5000 <= 120 ms CPU per scan: {m:.1f} ms (mean {a:.1f} ms): "
                f"{'met' if max(m, a) <= 120 else 'NOT met'}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
