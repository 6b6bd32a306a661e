"""A restart gives the records of an uninterrupted run when a node of the source falls silent
and drains its spool later, with its old times, while the other nodes move on (the pattern of
`test_windows_restart.py`: feed to a cut, restart from `needed_offsets()` with
`emitted_until_ms`, compare). The silent node held the uninterrupted run's windows open; the
restart reads again from before its silence, so it holds the restart's open too."""

from __future__ import annotations

import random

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_windows import Collector, row, state

from collector.aggregate.records import BillingRecord, record_order
from collector.aggregate.windows import Aggregator, WindowSettings
from collector.events import ContainerState, Event

S = WindowSettings(
    window_ms=10_000, lateness_ms=3_000, max_gap_ms=9_000, max_skew_ms=5_000, idle_ms=30_000
)
T0 = 1_800_000_000_000  # a window edge

# (record time, node, event) in the order the source holds them
Feed = list[tuple[int, str, Event]]


def feed(
    agg: Aggregator, msgs: Feed, first: int, last: int | None = None, *, recorded: bool = True
) -> list[BillingRecord]:
    out: list[BillingRecord] = []
    for offset in range(first, len(msgs) if last is None else last):
        rec, node, e = msgs[offset]
        agg.add(node, e, offset=offset, record_ts_ms=rec if recorded else None)
        out += agg.advance()
    return out


def uninterrupted(msgs: Feed, *, recorded: bool = True) -> list[BillingRecord]:
    whole = Aggregator(S)
    return sorted(feed(whole, msgs, 0, recorded=recorded) + whole.flush(), key=record_order)


def restarted(msgs: Feed, cut: int, *, recorded: bool = True) -> tuple[list[BillingRecord], int]:
    """The records of a run stopped after msgs[:cut] and restarted, and where it restarted."""
    before = Aggregator(S)
    got = feed(before, msgs, 0, cut, recorded=recorded)
    resume = before.needed_offsets().get(0, cut)
    after = Aggregator(S, emitted_until_ms=before.emitted_until_ms)
    got += feed(after, msgs, resume, recorded=recorded) + after.flush()
    return sorted(got, key=record_order), resume


def heartbeats(
    node: str, inc: int, seconds: range, totals: dict[int, int], skew_ms: int = 0
) -> Feed:
    """A heartbeat a second of true time, usage `totals[s]` from second s on; record time is
    the true time."""
    c = Collector(inc=inc)
    out: Feed = []
    total = 0
    for s in seconds:
        total = totals.get(s, total)
        true = T0 + s * 1000
        hb = c.heartbeat(true + skew_ms, state(1, row(1, total)))
        out.append((true, node, msgspec.structs.replace(hb, interval_ms=1000)))
    return out


def spooled(msgs: Feed, start_s: int, end_s: int) -> Feed:
    """The node cannot reach the broker from start_s to end_s: those events are sent at end_s,
    in order."""
    return [
        (T0 + end_s * 1000 if start_s * 1000 <= rec - T0 < end_s * 1000 else rec, n, e)
        for rec, n, e in msgs
    ]


def interleave(*feeds: Feed) -> Feed:
    return sorted((x for f in feeds for x in f), key=lambda x: x[0])  # stable: each node in order


def two_nodes() -> Feed:
    """`steady` sends every second for 100 s; `out` loses the broker from 5 s to 30 s."""
    steady = heartbeats("steady", 1, range(0, 100), {0: 200, 50: 300})
    out = heartbeats("out", 2, range(0, 100), {0: 100, 20: 400, 60: 500})
    return interleave(steady, spooled(out, 5, 30))


def resumes(msgs: Feed) -> dict[int, int]:
    """Per cut, where the restart reads again from; every cut's records are the uninterrupted
    run's."""
    expected = uninterrupted(msgs)
    out = {}
    for cut in range(1, len(msgs)):
        got, out[cut] = restarted(msgs, cut)
        assert got == expected, cut
    return out


def test_a_restart_inside_a_silence_or_its_spool_gives_the_uninterrupted_records() -> None:
    """10 of these cuts (45 to 54) billed `out`'s spool as late when the restart read again
    only what the open windows need."""
    msgs = two_nodes()
    last = max(i for i, (rec, n, _) in enumerate(msgs) if n == "out" and rec < T0 + 5_000)
    at = resumes(msgs)
    # From cut 45 on, the open windows need offsets inside `out`'s silence (offset 14 on, the
    # last max_gap of `steady`): the restart reads again from `out`'s last event before it,
    # until what the windows need lies after its spool (cut 97: offset 78).
    assert last == 9
    assert [cut for cut, resume in at.items() if resume == last] == list(range(45, 97))
    assert at[97] == 78


def test_a_node_that_left_holds_the_restart_back_only_while_it_is_active() -> None:
    steady = heartbeats("steady", 1, range(0, 100), {0: 200})
    gone = heartbeats("gone", 2, range(0, 20), {0: 100})  # never heard of again
    msgs = interleave(steady, gone)
    last = max(i for i, (_, n, _) in enumerate(msgs) if n == "gone")
    idle = min(i for i, (rec, _, _) in enumerate(msgs) if rec - T0 >= 19_000 + S.idle_after_ms)
    at = resumes(msgs)
    # From cut 70 the windows need offset 59 on, where `gone` still held them open (it turns
    # idle at offset 69): the restart reads `gone`'s last event again; from cut 79 they need
    # offset 69 on, and `gone` holds nothing back any more.
    assert (last, idle) == (39, 69)
    assert [cut for cut, resume in at.items() if resume == last] == list(range(70, 79))
    assert at[79] == idle


def test_nodes_that_send_every_second_do_not_move_the_restart_back() -> None:
    msgs = interleave(
        *(heartbeats(f"n{k}", k + 1, range(100), {0: 100 * (k + 1)}) for k in range(3))
    )
    whole = Aggregator(S)
    feed(whole, msgs, 0)
    # the last 11 s of heartbeats (the ends a late event is judged by), as before nodes'
    # silences were kept
    assert whole.needed_offsets() == {0: len(msgs) - 33}


@st.composite
def outages(draw: st.DrawFn) -> Feed:
    """2-4 nodes, clocks off by up to 4 s, a heartbeat a second, usage changing; each node
    loses the broker up to four times, for 4 to 80 s (idle is 30 s: some outages outlast it),
    and sends what it spooled when it is back."""
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    feeds = []
    for k in range(draw(st.integers(2, 4))):
        totals = {s: rng.randint(1, 5) * 100 for s in range(0, 120) if s == 0 or rng.random() < 0.2}
        start, end = rng.randint(0, 5), rng.randint(60, 120)
        node = heartbeats(f"n{k}", k + 1, range(start, end), totals, rng.randint(-4_000, 4_000))
        for _ in range(rng.randint(0, 4)):
            a = rng.randint(0, 100)
            node = spooled(node, a, a + rng.randint(4, 80))
        feeds.append(node)
    return interleave(*feeds)


@pytest.mark.parametrize("recorded", [True, False], ids=["record-times", "event-times"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(msgs=outages())
def test_a_restart_at_every_third_cut_of_nodes_with_outages_gives_the_uninterrupted_records(
    recorded: bool, msgs: Feed
) -> None:
    expected = uninterrupted(msgs, recorded=recorded)
    for cut in range(1, len(msgs), 3):
        assert restarted(msgs, cut, recorded=recorded)[0] == expected, cut


def test_silences_are_forgotten_once_no_restart_needs_them() -> None:
    """A collector that loses the broker for 12 s every 20 s, for 400 s: what the aggregator
    keeps of its silences stays bounded (those that ended within max_skew + max_gap + window
    = 24 s of record time before the closed end), and restarts still match. (Outages of up to
    max_skew + lateness = 8 s are no silences at all: a restart's progress, at most max_skew
    behind the newest record time, cannot pass the node by more than the lateness.)"""
    steady = heartbeats("steady", 1, range(400), {0: 200})
    flappy = heartbeats("flappy", 2, range(400), {0: 100, 200: 300})
    for a in range(10, 400, 20):
        flappy = spooled(flappy, a, a + 12)
    msgs = interleave(steady, flappy)
    whole = Aggregator(S)
    feed(whole, msgs, 0)
    kept = whole._progress._src[0].nodes["flappy"].silences  # noqa: SLF001 (its memory)
    assert whole.closed_until_ms == T0 + 390_000
    # of its 20 outages the last two, each one entry however many events its spool drained:
    # (its last event before, its last event of the spool), record times
    assert [(msgs[first][0] - T0, msgs[end][0] - T0) for first, end, _ in kept] == [
        (369_000, 382_000),
        (389_000, 402_000),
    ]
    expected = uninterrupted(msgs)
    for cut in range(1, len(msgs), 7):
        assert restarted(msgs, cut)[0] == expected, cut


def test_a_node_silent_from_just_before_the_cut_holds_the_restart_too() -> None:
    """No node has a container (the open windows need no event of theirs) until `m`, silent
    from 15 s, starts one during its outage; its spool is drained at 40 s. A restart cut
    within the lateness after m's last event once read again from the cut: m unknown, its
    container billed only from the window its spool found open (cuts 30 to 33 differed, 15
    late events each)."""
    a, m = Collector(inc=1), Collector(inc=2)

    def beat(c: Collector, s: int, *states: ContainerState) -> Event:
        return msgspec.structs.replace(c.heartbeat(T0 + s * 1000, *states), interval_ms=1000)

    quiet: Feed = [(T0 + s * 1000, "a", beat(a, s)) for s in range(100)]
    busy: Feed = [
        (T0 + s * 1000, "m", beat(m, s, *([state(1, row(1, 500))] if s >= 16 else [])))
        for s in range(100)
    ]
    msgs = interleave(quiet, spooled(busy, 15, 40))
    last = max(i for i, (rec, n, _) in enumerate(msgs) if n == "m" and rec < T0 + 15_000)
    at = resumes(msgs)
    assert last == 29
    assert all(at[cut] <= last for cut in range(30, 34))


def test_nodes_that_send_a_heartbeat_every_30_s_do_not_move_the_restart_back() -> None:
    """The defaults (lateness 10 s, max_skew 300 s); 10 nodes with a steady container send
    only their heartbeat, every 30 s, at phases 3 s apart, for 30 minutes. Each gap between
    two heartbeats is longer than the lateness, but never lets a progress capped 300 s behind
    the newest record time pass the node: no silence is kept, and the restart reads the last
    30 s before the closed end, as before silences were kept (it read 477 s when every gap
    longer than the lateness counted)."""
    settings = WindowSettings()
    msgs: Feed = []
    for k in range(10):
        c = Collector(inc=k + 1)
        for t in range(3_000 * k, 1_800_000, 30_000):
            hb = c.heartbeat(T0 + t, state(1, row(1, 100 * (k % 5 + 1)), pod=f"pod-{k}"))
            msgs.append((T0 + t, f"n{k}", hb))
    msgs.sort(key=lambda x: x[0])
    agg = Aggregator(settings)
    for offset, (rec, node, e) in enumerate(msgs):
        agg.add(node, e, offset=offset, record_ts_ms=rec)
        agg.advance()
    resume = agg.needed_offsets()[0]
    assert agg.closed_until_ms is not None
    assert agg.closed_until_ms - msgs[resume][0] == 30_000
    assert sum(len(n.silences) for n in agg._progress._src[0].nodes.values()) == 0  # noqa: SLF001


NEVER_S = 10**9


def stamped(
    node: str, inc: int, seconds: range, totals: dict[int, int], clock_ms: int, **shape: int
) -> list[tuple[int, int, str, Event]]:
    """(arrival, record time, node, event): a heartbeat a second of true time, stamped by its
    collector's own clock, `clock_ms` off (the send time, or the event's ts if later: Kafka's
    CreateTime, so record times are not in order in the partition). No container before
    `shape["empty_until"]`; events from `shape["outage"]` s on are sent at `shape["drain_ms"]`."""
    c = Collector(inc=inc)
    out = []
    total = 0
    for s in seconds:
        total = totals.get(s, total)
        true = T0 + s * 1000
        states = [] if s < shape.get("empty_until", 0) else [state(1, row(1, total))]
        hb = msgspec.structs.replace(c.heartbeat(true + clock_ms, *states), interval_ms=1000)
        arrival = true
        if shape.get("outage", NEVER_S) * 1000 <= true - T0 < shape.get("drain_ms", 0):
            arrival = T0 + shape["drain_ms"]
        out.append((arrival, max(arrival + clock_ms, hb.ts), node, hb))
    return out


def test_a_restart_whose_known_nodes_all_turn_idle_waits_for_a_node_silent_for_less() -> None:
    """`x` (clock 1 s ahead) loses the broker at 21 s and drains its spool at 49.3 s; `b` (1 s
    behind) sent its last event at 21 s. x's first drained event turns b idle, not x: this run
    waits for x. A restart that read from after x's last event before the outage knew only b:
    every node it knew was idle, its progress jumped past their newest event, and x's spool
    was late there (cuts 45 to 54 read again from offset 41 and lost x's window at 20 s)."""
    x = stamped(
        "x", 1, range(100), {0: 100, 30: 400}, 1_000, empty_until=21, outage=21, drain_ms=49_300
    )
    b = stamped("b", 2, range(22), {0: 200, 21: 300}, -1_000)
    msgs = [(rec, n, e) for _, rec, n, e in sorted(x + b, key=lambda m: m[0])]
    last = max(i for i, (rec, n, _) in enumerate(msgs) if n == "x" and rec < T0 + 49_300)
    at = resumes(msgs)
    assert last == 40
    # cuts 45 to 64 read again from x's last event before its outage, as the windows need
    assert [cut for cut, resume in at.items() if resume == last] == list(range(45, 65))
