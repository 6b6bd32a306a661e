"""The end-to-end bench's consumption path without the broker: two source trees side by side on
the same stream, in alternating fresh processes, by CPU seconds; and the records of both,
hash-compared (a change for speed must not change a byte of output).

    .venv/bin/python bench/bench_aggregate_ab.py --old DIR [--new DIR] [--rows 200000]
                                                  [--repeat 3] [--profile PREFIX] [--valgrind]

A tree is a folder with `collector/` and `bench/` (e.g. `git archive main collector bench |
tar -x -C /tmp/base`); `--new` defaults to this one. Each run builds the stream of
`bench_e2e.py` (same shape, fixed start time), encodes it, puts every node in one of 3
partitions and wraps each message in aiokafka's `ConsumerRecord` before the clock starts, then
hands it to that tree's own `bench_e2e.drive` through a stand-in consumer whose `getmany`
gives out batches of up to 5000 records of one partition, round robin; `--inner` times per
process, of which the least CPU time counts (this machine's noise is bursts of other work).
What is not measured: fetching, decompressing and parsing the batches (aiokafka, the same
for both trees).
`--profile PREFIX` writes a cProfile of each tree's last run to PREFIX.old / PREFIX.new.
`--valgrind` counts the instructions of each tree's drive under callgrind instead (valgrind
must be installed; one run of each, about 50x slower, so use a smaller `--rows`): a figure the
load of the machine does not change.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
T0 = 1_700_000_040_000  # a minute boundary: every run sees the same stream
PARTITIONS = 3


class StandIn:
    """What `drive` asks of an aiokafka consumer: `getmany`, over records made beforehand."""

    def __init__(self, batches: list[dict[Any, list[Any]]]) -> None:
        self._batches = batches
        self._next = 0

    async def getmany(self, timeout_ms: int = 0, max_records: int | None = None) -> Any:
        if self._next == len(self._batches):
            return {}
        self._next += 1
        return self._batches[self._next - 1]


def stream(rows: int) -> tuple[list[dict[Any, list[Any]]], int]:
    """bench_e2e's stream of `rows` usage rows as aiokafka `ConsumerRecord`s in `getmany`
    batches (up to 5000 records of one partition, round robin), and its message count; made
    with the collector and `bench_e2e` first on `sys.path`."""
    import bench_e2e
    from aiokafka.structs import ConsumerRecord, TopicPartition

    from collector.events import encode

    events, _, _ = bench_e2e.build(bench_e2e.Shape(), rows, T0)
    parts: list[list[Any]] = [[] for _ in range(PARTITIONS)]
    for node, e in events:
        p = int(node.rsplit("-", 1)[1]) % PARTITIONS
        key, value = node.encode(), encode(e)
        off = len(parts[p])
        parts[p].append(
            ConsumerRecord("t", p, off, e.ts, 0, key, value, None, len(key), len(value), ())
        )
    tps = [TopicPartition("t", p) for p in range(PARTITIONS)]
    batches: list[dict[Any, list[Any]]] = []
    pos = [0] * PARTITIONS
    while any(pos[p] < len(parts[p]) for p in range(PARTITIONS)):
        for p in range(PARTITIONS):
            if pos[p] < len(parts[p]):
                batches.append({tps[p]: parts[p][pos[p] : pos[p] + 5000]})
                pos[p] += 5000
    return batches, len(events)


def child(tree: str, rows: int, inner: int, profile: str | None) -> None:
    sys.path.insert(0, str(Path(tree) / "bench"))
    sys.path.insert(0, tree)
    import bench_e2e  # the tree's own: it imports that tree's collector

    batches, total = stream(rows)
    import collector.aggregate.service  # noqa: F401  (drive imports it: not the part measured)

    if inner == 0:  # the stream alone (the part of a run under --valgrind to subtract)
        print(json.dumps({"messages": 0, "records": 0, "cpu": 0.0, "sha256": ""}), flush=True)
        os._exit(0)  # like a full run: no teardown counted
    cpus: list[float] = []
    digests: set[str] = set()
    for i in range(inner):
        consumer = StandIn(batches)
        with tempfile.TemporaryDirectory(prefix="bench-ab-") as out:

            def go(
                consumer: StandIn = consumer, out: str = out
            ) -> tuple[int, float, float, int, float]:
                return asyncio.run(
                    bench_e2e.drive(consumer, lambda nxt: sum(nxt.values()) >= total, out)
                )

            if profile and i == inner - 1:
                import cProfile

                prof = cProfile.Profile()
                seen, _, _, written, cpu = prof.runcall(go)
                prof.dump_stats(profile)
            else:
                seen, _, _, written, cpu = go()
                cpus.append(cpu)
            digests.add(hashlib.sha256(Path(out, "records.csv").read_bytes()).hexdigest())
    print(
        json.dumps(
            {
                "messages": seen,
                "records": written,
                "cpu": min(cpus) if cpus else cpu,
                "sha256": digests.pop() if len(digests) == 1 else "differs between runs",
            }
        ),
        flush=True,
    )
    os._exit(0)  # the aggregators' teardown is not part of the drive


def run(
    tree: str, rows: int, inner: int, profile: str | None, valgrind: bool = False
) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", tree, "--rows", str(rows), "--inner", str(inner)]
    if profile:
        cmd += ["--profile", profile]
    if valgrind:
        cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"bench_aggregate_ab: the run of {tree} failed:\n{proc.stderr[-4000:]}")
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    if valgrind:
        found = re.search(r"Collected : (\d+)", proc.stderr)
        assert found, proc.stderr[-2000:]
        out["instructions"] = int(found.group(1))
    return out


def instructions(trees: dict[str, str], rows: int) -> int:
    """Instructions each tree's drive executes (callgrind: a run with the drive less one
    without it), and whether their records are the same; machine load does not change them."""
    counts: dict[str, int] = {}
    digests: set[str] = set()
    for side, tree in trees.items():
        full = run(tree, rows, 1, None, valgrind=True)
        stream = run(tree, rows, 0, None, valgrind=True)
        counts[side] = full["instructions"] - stream["instructions"]
        digests.add(full["sha256"])
        print(
            f"  {side}: {counts[side]:,} instructions for {rows:,} rows "
            f"({counts[side] / rows:,.0f} a row), sha256 {full['sha256'][:16]}"
        )
    same = len(digests) == 1
    print(
        f"  old/new instructions: {counts['old'] / counts['new']:.2f}x; records "
        + ("identical" if same else "DIFFER")
    )
    return 0 if same else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--old", help="the tree to compare against")
    ap.add_argument("--new", default=str(ROOT), help="the tree measured (default: this one)")
    ap.add_argument("--rows", type=int, default=200_000, help="usage rows in the stream")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each tree, alternating")
    ap.add_argument("--inner", type=int, default=3, help="runs per process (its best counts)")
    ap.add_argument("--profile", help="write cProfile stats of the last runs to PREFIX.old/.new")
    ap.add_argument(
        "--valgrind",
        action="store_true",
        help="count instructions under callgrind instead of timing (one run of each tree)",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, args.rows, args.inner, args.profile)
        return 0
    if not args.old:
        print("bench_aggregate_ab: --old DIR is required", file=sys.stderr)
        return 2
    trees = {"old": args.old, "new": args.new}
    if args.valgrind:
        if shutil.which("valgrind") is None:
            print("bench_aggregate_ab: --valgrind needs valgrind on PATH", file=sys.stderr)
            return 2
        return instructions(trees, args.rows)
    cpu: dict[str, list[float]] = {"old": [], "new": []}
    digests: dict[str, set[str]] = {"old": set(), "new": set()}
    for i in range(args.repeat):
        # the order alternates, so neither tree always runs second
        for side in ("old", "new") if i % 2 == 0 else ("new", "old"):
            last = i == args.repeat - 1
            prof = f"{args.profile}.{side}" if args.profile and last else None
            r = run(trees[side], args.rows, args.inner, prof)
            cpu[side].append(r["cpu"])
            digests[side].add(r["sha256"])
            print(
                f"  round {i + 1} {side}: {r['messages']:,} messages, {r['records']:,} records, "
                f"{r['cpu']:.3f} s CPU, sha256 {r['sha256'][:16]} (load {load()})"
            )
    old, new = statistics.median(cpu["old"]), statistics.median(cpu["new"])
    same = digests["old"] == digests["new"] and len(digests["new"]) == 1
    print(
        f"  {args.rows:,} rows: old median {old:.3f} s CPU ({args.rows / old:,.0f} rows/s), "
        f"new {new:.3f} s ({args.rows / new:,.0f} rows/s): {old / new:.2f}x by medians, "
        f"{min(cpu['old']) / min(cpu['new']):.2f}x best to best; records "
        + ("identical" if same else "DIFFER")
    )
    return 0 if same else 1


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    raise SystemExit(main())
