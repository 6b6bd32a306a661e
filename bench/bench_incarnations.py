"""How the aggregator's cost grows with the incarnations of one node: N collector
incarnations, one heartbeat each (one container), all within one minute of event time, fed
through the intake as from Kafka, then every window closed.

    python bench/bench_incarnations.py [--sizes 1000,4000,16000]

Prints, per N, the seconds to add the events and to close the windows, and both per
incarnation: flat per incarnation is linear growth.
"""

from __future__ import annotations

import argparse
import time

from collector.aggregate.intake import InputStats, add_record
from collector.aggregate.windows import Aggregator, WindowSettings
from collector.events import ContainerState, DeviceLimit, Heartbeat, UsageRow, encode

T0 = 1_800_000_000_000


def _heartbeats(n: int) -> list[tuple[int, bytes]]:
    device = [DeviceLimit(0, "GPU-0", 1 << 30, 50)]
    rows = [UsageRow(1, 1001, 0, 100, 0, 0, 100, 0, 0)]
    out = []
    for i in range(n):
        ts = T0 + (i * 60_000) // n
        state = ContainerState(1, "pod-a", "main", "v1.2", device, rows)
        out.append((ts, encode(Heartbeat(1, 1000 + i, 0, ts, 30_000, 0, 1, [state]))))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,4000,16000")
    args = parser.parse_args()
    print(
        f"{'incarnations':>12} {'add s':>7} {'close s':>8} {'add us/inc':>11} {'close us/inc':>13}"
    )
    for n in (int(s) for s in args.sizes.split(",")):
        events = _heartbeats(n)
        agg, stats = Aggregator(WindowSettings()), InputStats()
        started = time.perf_counter()
        for offset, (ts, value) in enumerate(events):
            add_record(agg, stats, b"n1", value, source=0, offset=offset, record_ts_ms=ts)
        added = time.perf_counter()
        records = agg.advance() + agg.flush()
        closed = time.perf_counter()
        assert records, "no record"
        add_s, close_s = added - started, closed - added
        print(f"{n:>12} {add_s:>7.2f} {close_s:>8.2f} {add_s / n * 1e6:>11.1f} "
              f"{close_s / n * 1e6:>13.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
