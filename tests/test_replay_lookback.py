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


def live_and_replay(
    msgs: list[tuple[str, Event, int]], settings_: WindowSettings, rng: ReplayRange, tmp: Path
) -> tuple[list[BillingRecord], list[str]]:
    """The live run's records inside `rng` (everything read, `advance()` after each record),
    and the CSV lines `replay` writes for `rng` from the same records (node, event, record
    time), read from where it starts."""
    agg = Aggregator(settings_)
    live: list[BillingRecord] = []
    for i, (node, e, rts) in enumerate(msgs):
        agg.add(node, e, offset=i, record_ts_ms=rts)
        live += agg.advance()
    live += agg.flush()
    start = replay_start_ms(settings_, rng)
    raws = [
        Raw(0, i, rts, node.encode(), encode(e))
        for i, (node, e, rts) in enumerate(msgs)
        if rts >= start
    ]
    replay = Replay(len(raws), settings_, rng)
    replay.feed(raws)
    out = tmp / "replay.csv"
    outputs = Outputs.open(str(out), None, None, Checkpoint())
    try:
        replay.finish(outputs)
    finally:
        outputs.close()
    want = [r for r in live if rng.from_ms <= r.window_start_ms and r.window_end_ms <= rng.to_ms]
    return want, read_csv(out)


def test_replay_after_a_170_s_stall_is_the_live_run(tmp_path: Path) -> None:
    rng = ReplayRange(T0 + 240_000, T0 + 360_000)
    # the last event before the stall is read
    assert replay_start_ms(S, rng) <= T0 + 70_000 - S.max_skew_ms
    want, got = live_and_replay([("n1", e, e.ts) for e in stalled()], S, rng, tmp_path)
    # the stalled node's rows are attributed
    assert [r.samples for r in want if r.kind == "container"] == [12, 2]
    assert got == csv_lines(want)


def sending(c: Collector, node: str, seconds: range) -> list[tuple[str, Event, int]]:
    """A sample every 5 s (a heartbeat every 30 s), each recorded when it was made."""
    out: list[tuple[str, Event, int]] = [(node, c.appeared(T0), T0)]
    for s in seconds:
        ts = T0 + s * 1000
        e = c.hb(ts, row(1, 1000 + s)) if s % 30 == 0 else c.sample(ts, row(1, 1000 + s))
        out.append((node, e, ts))
    return out


def test_replay_reads_what_a_spool_sent_after_a_long_outage(tmp_path: Path) -> None:
    """The only node's broker link is down 30 minutes; its spool sends the events of that time
    afterwards (record time = when sent). Nothing else arrives meanwhile, so the live run keeps
    the windows open and bills them in time; so must a replay of a range inside the outage,
    although those records come 23 minutes after its end (reading once stopped 18.3 minutes
    after it in record time)."""
    down, up = T0 + 5 * 60_000, T0 + 35 * 60_000
    msgs = [
        (node, e, up + (rts - down) // 100 if down <= rts < up else rts)
        for node, e, rts in sending(Collector(), "n1", range(0, 45 * 60, 5))
    ]
    rng = ReplayRange(T0 + 10 * 60_000, T0 + 12 * 60_000)
    want, got = live_and_replay(msgs, S, rng, tmp_path)
    assert [r.samples for r in want if r.kind == "container"] == [12, 12]
    assert got == csv_lines(want)


def test_replay_sees_a_node_silent_for_less_than_idle_before_the_range(tmp_path: Path) -> None:
    """With `idle` raised to an hour, node a's link is down 20 minutes (under `idle`: it still
    holds the partition's windows open live) while node b sends; a's spool then drains in
    12 s, before a's new events (sent 15 s after they are made). A
    replay of a range inside the outage must know a before it, or b's progress would close
    the windows and a's rows would come late."""
    slow = WindowSettings(idle_ms=3_600_000)
    down, up = T0 + 5 * 60_000, T0 + 25 * 60_000
    a = [
        (node, e, up + (rts - down) // 100 if down <= rts < up else rts + 15_000)
        for node, e, rts in sending(Collector(inc=1), "a", range(0, 40 * 60, 5))
    ]
    b = sending(Collector(inc=2), "b", range(0, 40 * 60, 5))
    msgs = sorted(a + b, key=lambda m: m[2])
    rng = ReplayRange(T0 + 16 * 60_000, T0 + 18 * 60_000)
    want, got = live_and_replay(msgs, slow, rng, tmp_path)
    assert [r.samples for r in want if r.kind == "container"] == [12, 12, 12, 12]
    assert got == csv_lines(want)
