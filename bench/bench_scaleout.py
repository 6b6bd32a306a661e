"""Scale-out: the aggregator's consumption path on a 4-partition usage topic, one replica against
two replicas of one consumer group, in the same run.

    KAFKA_HOME=... .venv/bin/python bench/bench_scaleout.py [--rows 400000] [--repeat 3]
                                                             [--bootstrap HOST:PORT]

One topic is produced first: 8 nodes (2 per partition, placed explicitly so the partitions
hold the same load), 25 containers x 4 processes x 2 devices each, gzip, record time = event
time, as `bench_e2e.py`. Each replica is a process of its own running `bench_e2e.drive` (decode,
an `Aggregator` per partition, `advance` after each batch into a CSV sink, `flush` at the end
of its partitions) in one consumer group. Replicas join, wait until the group has given every
one its share (4 partitions / replicas), then start together; the clock runs from the first
record any replica is handed to the last replica's end. Rates are usage rows per second; the
replicas' CPU seconds over that span say how much of the machine's cores they got.
Runs alternate (1 replica, 2 replicas, 1, ...) so both see the same load; the ratio is of the
medians, and the load average is printed with each run. Goal: two >= 1.7 x one.

The machine this was written for has 2 cores, shared with the broker (a JVM) and, here, with
nothing else of this bench while the clock runs (the producer has finished before): the
second replica can only be as fast as the core the broker and the rest of the machine leave it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_e2e import Shape, bootstrap_address, build, drive, load, produce, subscribe  # noqa: E402

from collector.events import UsageSample  # noqa: E402

GOAL_RATIO = 1.7
PARTITIONS = 4
MINUTE_MS = 60_000


async def replica(bootstrap: str, topic: str, group: str, replicas: int) -> dict[str, object]:
    """One replica: join, wait for its share, say `ready`, wait for `go` on stdin, consume its
    partitions to their end; returns its partitions, messages and clock (time.monotonic)."""
    consumer = await subscribe(bootstrap, topic, group)
    try:
        share = PARTITIONS // replicas
        while len(consumer.assignment()) != share:
            await asyncio.sleep(0.05)
        mine = sorted(consumer.assignment())
        ends = await consumer.end_offsets(mine)
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        if set(consumer.assignment()) != set(mine):
            raise SystemExit("bench_scaleout: the group rebalanced after the start")
        want = {tp.partition: end for tp, end in ends.items()}
        with tempfile.TemporaryDirectory(prefix="bench-scaleout-") as out_dir:
            seen, started, ended, written, cpu = await drive(
                consumer,
                lambda nxt: all(nxt.get(p, 0) >= end for p, end in want.items()),
                out_dir,
            )
    finally:
        await consumer.stop()
    return {
        "partitions": sorted(want),
        "messages": seen,
        "started": started,
        "ended": ended,
        "records": written,
        "cpu": cpu,
    }


def run_group(
    bootstrap: str, topic: str, replicas: int, rows_of: dict[int, int]
) -> tuple[float, int, float, float]:
    """Start `replicas` processes in one new group; (rows/s, messages, seconds, CPU seconds of
    all replicas)."""
    group = f"bench-scaleout-{uuid.uuid4().hex[:8]}"
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--replica", bootstrap, topic, group, str(replicas)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(replicas)
    ]
    try:
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline().strip()
            if line != "ready":
                raise SystemExit(f"bench_scaleout: a replica said {line!r} instead of ready")
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        results = []
        for p in procs:
            out, _ = p.communicate(timeout=1800)
            if p.returncode != 0:
                raise SystemExit(f"bench_scaleout: a replica failed (exit {p.returncode})")
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    parts = sorted(q for r in results for q in r["partitions"])
    assert parts == list(range(PARTITIONS)), parts
    seconds = max(r["ended"] for r in results) - min(r["started"] for r in results)
    messages = sum(r["messages"] for r in results)
    cpu = sum(r["cpu"] for r in results)
    return sum(rows_of.values()) / seconds, messages, seconds, cpu


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--replica"]:
        bootstrap, topic, group, replicas = sys.argv[2:6]
        print(json.dumps(asyncio.run(replica(bootstrap, topic, group, int(replicas)))))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, default=400_000, help="usage rows to produce")
    ap.add_argument("--bootstrap", help="broker (default: scripts/kafka.sh start)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds (one run of each)")
    args = ap.parse_args(argv)

    bootstrap = args.bootstrap or bootstrap_address()
    shape = Shape(nodes=2 * PARTITIONS)
    seconds = -(-args.rows // shape.rows_per_second)
    start = int(time.time() * 1000) - (seconds + 120) * 1000  # past, within retention
    t0 = start - start % MINUTE_MS
    events, usage_rows, _ = build(shape, args.rows, t0)
    partition_of = {f"node-{n}": n % PARTITIONS for n in range(shape.nodes)}
    rows_of: dict[int, int] = {}
    for node, e in events:
        if isinstance(e, UsageSample):
            p = partition_of[node]
            rows_of[p] = rows_of.get(p, 0) + len(e.rows)
    topic = f"bench-scaleout-{uuid.uuid4().hex[:10]}"
    asyncio.run(produce(bootstrap, topic, events, PARTITIONS, partition_of))
    print(
        f"bench_scaleout: broker {bootstrap}, topic {topic} ({PARTITIONS} partitions, gzip), "
        f"{shape.nodes} nodes x {shape.containers} containers x {shape.procs} procs x "
        f"{shape.devices} devices, {seconds} s of event time: {len(events):,} messages, "
        f"{usage_rows:,} usage rows; {os.cpu_count()} CPUs"
    )
    rates: dict[int, list[float]] = {1: [], 2: []}
    for i in range(args.repeat):
        for n in (1, 2):
            rate, messages, secs, cpu = run_group(bootstrap, topic, n, rows_of)
            assert messages == len(events), (messages, len(events))
            rates[n].append(rate)
            print(
                f"  round {i + 1} (load {load()}): {n} replica{'s' if n > 1 else ''}: "
                f"{secs:.3f} s, {rate:,.0f} samples/s; {cpu:.3f} CPU s = {cpu / secs:.2f} cores"
            )
    one = statistics.median(rates[1])
    two = statistics.median(rates[2])
    ratio = two / one
    verdict = "met" if ratio >= GOAL_RATIO else "NOT met"
    print(f"  1 replica : median {one:>12,.0f} samples/s of {len(rates[1])} runs")
    print(f"  2 replicas: median {two:>12,.0f} samples/s of {len(rates[2])} runs")
    print(
        f"  ratio two/one by medians: {ratio:.2f}x (goal >= {GOAL_RATIO}x: {verdict}); per "
        f"round: " + ", ".join(f"{b / a:.2f}x" for a, b in zip(rates[1], rates[2], strict=True))
    )
    print(f"  python {sys.version.split()[0]}, load average at the end {load()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
