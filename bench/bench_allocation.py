"""What the fair-share allocation costs the aggregator: the windowing benchmark
(`bench_windows.py`, the aggregator's core, with no transport around it) run on this tree and on
the tree before allocation existed, alternately in fresh processes, side by side.

    .venv/bin/python bench/bench_allocation.py [--baseline REV] [--repeat 5] [-- bench_windows args]

The baseline is `git archive REV collector` unpacked into a temporary folder (default: the
commit before allocation was added). The end-to-end path adds decoding and Kafka around the
same code, so the share measured here is an upper bound for the end-to-end figure.
Goal: allocation costs <= 15 % of the throughput.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = "fb4679e7be243eebf5e9e8cf6687d4ab1fbed2fd"  # main just before the allocation
GOAL = 0.15
_RATE = re.compile(r"add\+advance\s+[\d.]+ s\s+([\d,]+) rows/s")


def rate(tree: Path, extra: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_windows.py"), *extra],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=tree,
    ).stdout
    m = _RATE.search(out)
    assert m, out
    return float(m.group(1).replace(",", ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--baseline", default=BASELINE)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("extra", nargs="*", help="arguments for bench_windows.py")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", args.baseline, "collector"],
            capture_output=True,
            check=True,
        ).stdout
        tar = base / "base.tar"
        tar.write_bytes(archive)
        with tarfile.open(tar) as t:
            t.extractall(base, filter="data")
        now: list[float] = []
        before: list[float] = []
        for _ in range(args.repeat):
            before.append(rate(base, args.extra))
            now.append(rate(ROOT, args.extra))
    b, n = statistics.median(before), statistics.median(now)
    cost = 1 - n / b
    print(f"allocation bench: bench_windows.py {' '.join(args.extra)} x {args.repeat}, alternating")
    print(f"  before allocation ({args.baseline[:10]})  median {b:>12,.0f} rows/s  {before}")
    print(f"  with allocation (this tree)     median {n:>12,.0f} rows/s  {now}")
    print(
        f"  cost {100 * cost:.1f} % of the throughput; goal <= {100 * GOAL:.0f} %: "
        f"{'met' if cost <= GOAL else 'NOT met'}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
