"""How a partition's cost grows with the node names written to it: N nodes, one empty
heartbeat each, spread over `--span-s` of event time, fed through the intake as from Kafka
(one partition, record time = event time), windows advanced every 100 records as a live
service does each batch, then every window closed.

    python bench/bench_node_names.py [--sizes 1000,4000,16000] [--span-s 3600]

With a span longer than the idle time (`idle_ms`, 600 s by default) most of the nodes are idle
by the time the last ones come, as they are when a producer writes under made-up names. Prints,
per N, the seconds to add the events (with the advances) and to close the windows, and both
per node: flat per node is linear growth.
"""

from __future__ import annotations

import argparse
import time

from collector.aggregate.intake import InputStats, add_record
from collector.aggregate.windows import Aggregator, WindowSettings
from collector.events import Heartbeat, encode

T0 = 1_800_000_000_000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,4000,16000")
    parser.add_argument("--span-s", type=int, default=3600)
    args = parser.parse_args()
    span_ms = args.span_s * 1000
    print(f"{'nodes':>6} {'add s':>7} {'close s':>8} {'add us/node':>12} {'close us/node':>14}")
    for n in (int(s) for s in args.sizes.split(",")):
        events = []
        for i in range(n):
            ts = T0 + (i * span_ms) // n
            events.append(
                (f"node-{i}".encode(), ts, encode(Heartbeat(1, 1, 0, ts, 30_000, 0, 1, [])))
            )
        agg, stats = Aggregator(WindowSettings()), InputStats()
        started = time.perf_counter()
        for offset, (key, ts, value) in enumerate(events):
            add_record(agg, stats, key, value, source=0, offset=offset, record_ts_ms=ts)
            if offset % 100 == 99:
                agg.advance()
        added = time.perf_counter()
        agg.advance()
        agg.flush()
        closed = time.perf_counter()
        add_s, close_s = added - started, closed - added
        print(f"{n:>6} {add_s:>7.2f} {close_s:>8.2f} {add_s / n * 1e6:>12.1f} "
              f"{close_s / n * 1e6:>14.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
