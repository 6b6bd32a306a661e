"""Replay's look-back comes from the settings that keep names: a collector that stalls for
longer than the old look-back (max_gap + lateness + 60 s) but less than the time a name is kept
(2 x max_gap) is attributed in the replay exactly as it was live."""

from __future__ import annotations

from pathlib import Path

from streams import csv_lines, read_csv
from test_windows import Collector, row, state

from collector.aggregate.records import BillingRecord
from collector.aggregate.service import Checkpoint, Outputs
from collector.aggregate.windows import Aggregator, WindowSettings
from collector.events import Event, encode
from collector.replay import Raw, Replay, ReplayRange, replay_start_ms

S = WindowSettings()
T0 = 1_800_000_000_000


def stalled() -> list[Event]:
    c = Collector()
    events: list[Event] = [c.appeared(T0)]
    events += [c.hb(T0 + s * 1000, row(1, 1000)) for s in (0, 30, 60)]
    events.append(c.sample(T0 + 70_000, row(1, 1500)))  # then 170 s of nothing
    events += [c.sample(T0 + s * 1000, row(1, 2000 + s)) for s in range(240, 300, 5)]
    events += [c.heartbeat(T0 + s * 1000, state(1, row(1, 3000))) for s in range(300, 480, 30)]
    return events


def test_replay_after_a_170_s_stall_is_the_live_run(tmp_path: Path) -> None:
    events = stalled()
    agg = Aggregator(S)
    live: list[BillingRecord] = []
    for i, e in enumerate(events):
        agg.add("n1", e, offset=i, record_ts_ms=e.ts)
        live += agg.advance()
    live += agg.flush()
    rng = ReplayRange(T0 + 240_000, T0 + 360_000)
    start = replay_start_ms(S, rng)
    assert start <= T0 + 70_000 - S.max_skew_ms  # the last event before the stall is read
    raws = [Raw(0, i, e.ts, b"n1", encode(e)) for i, e in enumerate(events) if e.ts >= start]
    replay = Replay(len(raws), S, rng)
    replay.feed(raws)
    out = tmp_path / "replay.csv"
    outputs = Outputs.open(str(out), None, None, Checkpoint())
    try:
        replay.finish(outputs)
    finally:
        outputs.close()
    want = [r for r in live if rng.from_ms <= r.window_start_ms and r.window_end_ms <= rng.to_ms]

    assert [r.samples for r in want if r.kind == "container"] == [
        12,
        2,
    ]  # the stalled node's rows are attributed
    assert read_csv(out) == csv_lines(want)
