"""The garbage collector's settings of the `collect` service.

A scan keeps large long-lived state (per-file memos and snapshots, kept descriptors' records)
and replaces part of it every second. Under Python's default settings (the youngest
generation collected every 700 net allocations) a 5000-container node's collector spent 140 ms
of its 510 ms scan CPU in the cyclic garbage collector, and one scan in a few took twice the
median (bench/bench_gc.py); with a threshold of 50 000 it spends 2 ms and the scan 360 ms, at
the same RSS. What the collector keeps holds no reference cycles that matter for memory:
refcounting frees its garbage, and cycles are only collected later.

The aggregator keeps Python's defaults: the same settings made its consumption path slower
(0.94x) in that bench.
"""

from __future__ import annotations

import gc

__all__ = ["YOUNG_THRESHOLD", "tune_gc"]

# Net allocations between collections of the youngest generation (Python's default is 700).
# The older generations keep Python's ratios.
YOUNG_THRESHOLD = 50_000

_tuned = False


def tune_gc() -> None:
    """Once per process, when start-up is over: collect its garbage, freeze what is left
    (modules, classes, the client libraries' generated models: never garbage, so never walked
    again) and collect the youngest generation less often."""
    global _tuned
    if _tuned:
        return
    _tuned = True
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, *gc.get_threshold()[1:])
