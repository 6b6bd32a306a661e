"""Aggregator memory: RSS per 1000 live container x device keys, and whether it stays flat.

    .venv/bin/python bench/bench_rss.py [--minutes 10] [--containers 1000] [--devices 2]
                                        [--procs 2] [--speed 10] [--churn 0.02]

One process, no broker: a steady stream of encoded events goes through the service's input
path (`add_record`: msgpack decode, damage accounting, `Aggregator.add`) and `advance()` after
every second of event time, with identity and allocation on (every pod has a `PodIdentity`;
heartbeats restate containers and pods every 30 s; a `DeviceInventory` per node). Every event
minute `--churn` of the containers end (`ContainerGone`) and as many new ones appear with new
pods and new cids, so names, identities and tracks come and go as on a real cluster, while the
number of live keys stays the same. Event time runs `--speed` times the wall clock (0: as fast
as it goes), for `--minutes` of wall time.

RSS (`/proc/self/statm`) is sampled every `--sample-s`. Printed: the RSS before the aggregator
exists, the median RSS after the warm-up (the first `--warmup` fraction of the run) and from
them the RSS per 1000 live container x device keys; a line per minute; and the least-squares
slope of RSS over wall time after the warm-up (MiB per minute, and per hour of event time).
Goal: no growth after warm-up (the slope's total over the run below 1 % of the RSS).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from collector.aggregate.intake import InputStats, add_record  # noqa: E402
from collector.aggregate.windows import Aggregator, WindowSettings  # noqa: E402
from collector.events import (  # noqa: E402
    SCHEMA_VERSION,
    ContainerAppeared,
    ContainerGone,
    ContainerState,
    DeviceInventory,
    DeviceLimit,
    GpuInfo,
    Heartbeat,
    Identity,
    PodIdentity,
    UsageRow,
    UsageSample,
    encode,
)

MIB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")
NODES = 4
SOURCES = 2
HEARTBEAT_S = 30


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over x."""
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    sxy = sum((x - mx) * (y - my) for x, y in points)
    return sxy / sxx if sxx else 0.0


class Node:
    """One collector: its containers (cid -> pod number) and its event counter."""

    def __init__(self, n: int, containers: int, devices: int, procs: int) -> None:
        self.name = f"node-{n}"
        self.source = n % SOURCES
        self.inc = 9000 + n
        self.seq = 0
        self.offset = 0
        self.devices = [
            DeviceLimit(d, f"GPU-{n:02d}-{d:02d}", 8 * 1024 * MIB, 50) for d in range(devices)
        ]
        self.procs = procs
        self.next_cid = 0
        self.next_pod = 0
        self.live: dict[int, int] = {}
        self.out: list[bytes] = []
        for _ in range(containers):
            self.appear(0)

    def stamp(self) -> tuple[int, int, int]:
        self.seq += 1
        return SCHEMA_VERSION, self.inc, self.seq - 1

    def pod(self, p: int) -> str:
        return f"{self.name}-pod-{p:06d}"

    def identity(self, p: int) -> Identity:
        return Identity(self.pod(p), f"ns-{p % 7}", f"pod-{p}", "Deployment", f"wl-{p % 11}")

    def appear(self, ts: int) -> None:
        cid, p = self.next_cid, self.next_pod
        self.next_cid += 1
        self.next_pod += 1
        self.live[cid] = p
        if ts:
            pod = self.pod(p)
            ev = ContainerAppeared(
                *self.stamp(), ts, cid, pod, "main", f"/c/{pod}", "v1.2", self.devices
            )
            self.out.append(encode(ev))
            self.out.append(encode(PodIdentity(*self.stamp(), ts, self.identity(p))))

    def rows(self, cid: int, s: int) -> list[UsageRow]:
        return [
            UsageRow(q, 20_000 + q, d, (256 + (s + q + cid) % 7) * MIB, MIB, 0, 0, MIB, s % 100)
            for q in range(self.procs)
            for d in range(len(self.devices))
        ]

    def second(self, s: int, ts: int, churn: int) -> None:
        if s == 0:
            gpus = [GpuInfo(d.index, d.uuid, "H100", 80 * 1024 * MIB, False) for d in self.devices]
            self.out.append(encode(DeviceInventory(*self.stamp(), ts, gpus)))
        if s and s % 60 == 0:
            for cid in list(self.live)[:churn]:
                del self.live[cid]
                self.out.append(encode(ContainerGone(*self.stamp(), ts, cid)))
                self.appear(ts)
        for cid in self.live:
            self.out.append(encode(UsageSample(*self.stamp(), ts, cid, self.rows(cid, s))))
        if s % HEARTBEAT_S == 0:
            states = [
                ContainerState(cid, self.pod(p), "main", "v1.2", self.devices, self.rows(cid, s))
                for cid, p in self.live.items()
            ]
            pods = [self.identity(p) for p in self.live.values()]
            self.out.append(
                encode(Heartbeat(*self.stamp(), ts, HEARTBEAT_S * 1000, 0, 1, states, pods=pods))
            )

    def drain(self, agg: Aggregator, stats: InputStats, ts: int) -> None:
        key = self.name.encode()
        for value in self.out:
            add_record(
                agg, stats, key, value, source=self.source, offset=self.offset, record_ts_ms=ts
            )
            self.offset += 1
        self.out.clear()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0, help="wall-clock length of the run")
    ap.add_argument("--containers", type=int, default=1000, help="live containers (all nodes)")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--speed", type=float, default=10.0, help="event seconds per wall second")
    ap.add_argument("--churn", type=float, default=0.02, help="containers replaced per minute")
    ap.add_argument("--warmup", type=float, default=0.3, help="fraction of the run skipped")
    ap.add_argument("--sample-s", type=float, default=2.0, help="RSS sampling period")
    args = ap.parse_args(argv)
    if args.minutes <= 0 or args.containers < NODES or not 0 <= args.warmup < 1:
        print("bench_rss: --minutes > 0, --containers >= 4, 0 <= --warmup < 1", file=sys.stderr)
        return 2

    per_node = args.containers // NODES
    keys = per_node * NODES * args.devices
    churn = max(1, round(per_node * args.churn)) if args.churn > 0 else 0
    base = rss_bytes()
    nodes = [Node(n, per_node, args.devices, args.procs) for n in range(NODES)]
    agg = Aggregator(WindowSettings())
    stats = InputStats()
    t0 = 1_790_000_000_000
    for node in nodes:  # the initial containers appear before the clock starts
        for cid, p in node.live.items():
            pod = node.pod(p)
            ev = ContainerAppeared(
                *node.stamp(), t0, cid, pod, "main", f"/c/{pod}", "v1.2", node.devices
            )
            node.out.append(encode(ev))
            node.out.append(encode(PodIdentity(*node.stamp(), t0, node.identity(p))))
    print(
        f"bench_rss: {NODES} nodes x {per_node} containers x {args.devices} devices x "
        f"{args.procs} procs = {keys:,} live container x device keys "
        f"({keys * args.procs:,} usage keys), {churn} containers per node replaced every "
        f"event minute, event time at {args.speed:g}x wall time, {args.minutes:g} min; "
        f"RSS before the aggregator {base / MIB:.1f} MiB; load {load()}"
    )
    began = time.monotonic()
    end = began + args.minutes * 60
    samples: list[tuple[float, int]] = []
    next_sample = began
    next_line = began + 60
    records = 0
    s = 0
    while True:
        now = time.monotonic()
        if now >= next_sample:
            samples.append((now - began, rss_bytes()))
            next_sample += args.sample_s
        if now >= next_line:
            print(
                f"  {round((now - began) / 60):>3} min: RSS {rss_bytes() / MIB:7.1f} MiB, "
                f"{s / 60:6.1f} event minutes, {records:,} records; load {load()}",
                flush=True,
            )
            next_line += 60
        if now >= end:
            break
        if args.speed > 0 and s > (now - began) * args.speed:
            time.sleep(min(next_sample, began + s / args.speed) - now)
            continue
        ts = t0 + s * 1000
        for node in nodes:
            node.second(s, ts, churn)
            node.drain(agg, stats, ts)
        records += len(agg.advance())
        s += 1
    assert not (stats.undecodable or stats.unknown_schema), stats
    warm = [(t / 60, r / MIB) for t, r in samples if t >= args.warmup * args.minutes * 60]
    steady = statistics.median(r for _, r in warm)
    per_min = slope(warm)
    span = warm[-1][0] - warm[0][0]
    print(
        f"  {s / 60:.1f} event minutes, {records:,} records, {agg.stats.records:,} closed; "
        f"RSS min/median/max after warm-up {min(r for _, r in warm):.1f} / {steady:.1f} / "
        f"{max(r for _, r in warm):.1f} MiB"
    )
    print(
        f"  RSS per 1000 live container x device keys: "
        f"{(steady - base / MIB) / keys * 1000:.2f} MiB ((median - before) / {keys:,} x 1000)"
    )
    growth = per_min * span
    flat = abs(growth) < 0.01 * steady
    print(
        f"  slope after warm-up ({len(warm)} samples over {span:.1f} min): {per_min:+.3f} MiB/min "
        f"({per_min * 60 / args.speed if args.speed > 0 else 0:+.3f} MiB per event hour); the "
        f"fit over {span:.1f} min: {growth:+.2f} MiB ({growth / steady:+.2%}): "
        f"{'flat' if flat else 'GROWS'} (goal: within 1 %)"
    )
    print(f"  python {sys.version.split()[0]}, load average at the end {load()}")
    return 0


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    raise SystemExit(main())
