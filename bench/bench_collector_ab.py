"""The collector's CPU per scan, this tree against another tree's collector, side by side.

The other tree's `collector` package (e.g. a checkout of main before a change) is copied into
a temporary folder as the package `collector_base` and imported next to this tree's, so both
scanners run in one process over the very same simulated node (bench_collector_scale.py's
steady or busy node, built once by this tree's simulator). One writer step per round, then
one scan by each, the order alternating every round; each scan timed with
`time.process_time`. The ratio base / this of the medians is what to read on a shared
machine (the best scans of each are printed too).

    .venv/bin/python bench/bench_collector_ab.py --base /path/to/other/tree
        [--sizes 256] [--rounds 12] [--kinds steady] [--profile]

`--profile` prints a cProfile of this tree's scans (own time) after the timed rounds.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import os
import pstats
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_collector import build  # noqa: E402
from bench_collector_scale import steady_step  # noqa: E402

from collector.node.scan import Scanner  # noqa: E402


def base_scanner_class(tree: Path, into: Path) -> Any:
    """`Scanner` of the collector package under `tree`, imported as `collector_base`."""
    shutil.copytree(
        tree / "collector", into / "collector_base", ignore=shutil.ignore_patterns("__pycache__")
    )
    sys.path.insert(0, str(into))
    return importlib.import_module("collector_base.node.scan").Scanner


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, type=Path, help="a tree with a collector/ package")
    ap.add_argument("--sizes", default="256")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--kinds", default="steady", help="steady, busy or steady,busy")
    ap.add_argument("--churn", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    if not (args.base / "collector" / "node" / "scan.py").is_file():
        print(f"bench_collector_ab: {args.base} has no collector/node/scan.py", file=sys.stderr)
        return 2
    load0 = os.getloadavg()
    rows: list[tuple[str, int, float, float, float, float]] = []
    with tempfile.TemporaryDirectory(prefix="hami-bench-ab-") as tmp:
        Base = base_scanner_class(args.base, Path(tmp))
        for kind in args.kinds.split(","):
            for n in [int(x) for x in args.sizes.split(",")]:
                root = Path(tmp) / f"{kind}-{n}"
                root.mkdir()
                sim = build(root, n, args.seed)
                # Folders just made are within the timestamp window (see discover.py): a
                # node in steady state has older ones.
                time.sleep(2.1)
                step: Callable[[], None] = (
                    steady_step(sim, random.Random(args.seed), args.churn)
                    if kind == "steady"
                    else (lambda s=sim: s.step(time.time()))
                )
                now_ms = 1_700_000_000_000
                scanners = {
                    "base": Base(root, heartbeat_s=30, inc=1),
                    "this": Scanner(root, heartbeat_s=30, inc=1),
                }
                for s in scanners.values():
                    s.scan(now_ms=now_ms)
                    s.scan(now_ms=now_ms + 1)
                cpu: dict[str, list[float]] = {"base": [], "this": []}
                for r in range(args.rounds):
                    step()
                    now_ms += 1000
                    for name in ("base", "this") if r % 2 == 0 else ("this", "base"):
                        t0 = time.process_time()
                        scanners[name].scan(now_ms=now_ms)
                        cpu[name].append((time.process_time() - t0) * 1000)
                base, this = statistics.median(cpu["base"]), statistics.median(cpu["this"])
                rows.append((kind, n, base, this, min(cpu["base"]), min(cpu["this"])))
                if args.profile:
                    prof = cProfile.Profile()
                    for _ in range(10):
                        step()
                        now_ms += 1000
                        scanners["base"].scan(now_ms=now_ms)
                        prof.enable()
                        scanners["this"].scan(now_ms=now_ms)
                        prof.disable()
                    print(f"\nprofile of 10 scans of this tree, {kind} node of {n} (own time):")
                    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
                for s in scanners.values():
                    s.discovery.close()
                sim.close()
    load1 = os.getloadavg()
    print(
        f"bench_collector_ab: base {args.base}, {args.rounds} rounds, order alternating; "
        f"load average {load0[0]:.2f} at start, {load1[0]:.2f} at end ({os.cpu_count()} CPUs)"
    )
    print(
        f"  {'node':<7} {'containers':>10} {'base ms':>9} {'this ms':>9} {'base/this':>9}"
        f" {'(best of each:':>15} {'base':>7} {'this':>7} {'ratio)':>7}"
    )
    for kind, n, base, this, b_min, t_min in rows:
        print(
            f"  {kind:<7} {n:>10} {base:>9.2f} {this:>9.2f} {base / this:>9.2f}"
            f" {'':>15} {b_min:>7.2f} {t_min:>7.2f} {b_min / t_min:>7.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
