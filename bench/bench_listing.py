"""Discovery's CPU per scan when one tenant folder holds 100 000 entries and is touched often.

A node of 32 ordinary container folders plus one hostile folder with `--entries` files, whose
mtime changes before every scan (as a tenant touching it every 0.5 s at a 1 s interval would).
Two `Scanner`s side by side over the same tree, each timed with `time.process_time`:

* unbounded: `dir_max_entries` above the folder's size, i.e. what every scan cost before listing
  was bounded (the big folder is listed again on every scan);
* bounded: the defaults (more than 1000 entries: listed at most once per 60 s).

    .venv/bin/python bench/bench_listing.py [--entries 100000] [--scans 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from collector.node.discover import TIMESTAMP_WINDOW_NS, ListingLimits  # noqa: E402
from collector.node.scan import Scanner  # noqa: E402
from collector.simulate import NodeSimulator  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--entries", type=int, default=100_000)
    ap.add_argument("--scans", type=int, default=20)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        sim = NodeSimulator(root, 32, "v1.2", seed=3)
        sim.step(time.time())
        big = root / "ffffffff-0000-4000-8000-000000000000_hostile"
        big.mkdir()
        for i in range(args.entries):
            (big / f"{i:06d}").touch()
        old = time.time() - 3600
        time.sleep(TIMESTAMP_WINDOW_NS / 1e9 + 0.1)  # the folders' ctime older than the window
        scanners = {
            "unbounded (before)": Scanner(
                root,
                heartbeat_s=3600,
                listing=ListingLimits(max_entries=args.entries * 2, budget_s=3600.0),
            ),
            "bounded (defaults)": Scanner(root, heartbeat_s=3600),
        }
        for s in scanners.values():
            s.scan()  # first scan lists everything in both
        cpu: dict[str, list[float]] = {name: [] for name in scanners}
        for i in range(args.scans):
            for name, s in scanners.items():
                when = old + i + 1
                os.utime(big, (when, when))  # the tenant touches its folder
                start = time.process_time()
                s.scan()
                cpu[name].append((time.process_time() - start) * 1000)
        sim.close()
    print(f"{args.entries} entries in one folder + 32 containers, {args.scans} scans each")
    for name, ms in cpu.items():
        print(
            f"  {name:<20} median {statistics.median(ms):8.2f} ms CPU per scan, max {max(ms):.2f}"
        )
    a, b = (statistics.median(v) for v in cpu.values())
    print(f"  ratio unbounded / bounded: {a / b:.1f}x")


if __name__ == "__main__":
    main()
