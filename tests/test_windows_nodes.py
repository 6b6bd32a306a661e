"""One node's clock never costs another node its bill: per-node progress inside one source.

The oracle is each node aggregated alone: a node's records in a shared source must be exactly
the records it gets on its own, whatever the other nodes' clocks, outages or silence."""

from __future__ import annotations

from decimal import Decimal

from test_windows import Collector, row, state

from collector.aggregate.records import BillingRecord
from collector.aggregate.windows import Aggregator, WindowSettings
from collector.events import Event

S = WindowSettings()  # 60 s windows, 10 s lateness, 90 s max gap, 300 s skew, 600 s idle
T0 = 1_800_000_000_000  # a window edge

# (record time, node, event)
Feed = list[tuple[int, str, Event]]


def node_feed(node: str, skew_ms: int, start_s: int, end_s: int, total: int) -> Feed:
    """A node whose clock is `skew_ms` off: a heartbeat every 10 s of true time, the usage
    `total` bytes throughout; record time is the true time."""
    c = Collector(inc=hash(node) & 0xFFFF)
    out: Feed = []
    for s in range(start_s, end_s, 10):
        true = T0 + s * 1000
        out.append((true, node, c.heartbeat(true + skew_ms, state(1, row(1, total), pod=node))))
    return out


def interleave(*feeds: Feed) -> Feed:
    return sorted((x for f in feeds for x in f), key=lambda x: (x[0], x[1]))


def aggregate(
    feed: Feed, settings: WindowSettings = S, *, flush: bool = True
) -> list[BillingRecord]:
    agg = Aggregator(settings)
    out: list[BillingRecord] = []
    for i, (rec, node, e) in enumerate(feed):
        agg.add(node, e, offset=i, record_ts_ms=rec)
        out += agg.advance()
    if flush:
        out += agg.flush()
    return out


def of(records: list[BillingRecord], node: str) -> list[BillingRecord]:
    return [r for r in records if r.node == node]


def test_nodes_skewed_300_s_either_way_in_one_source_are_each_billed_exactly() -> None:
    feeds = {
        "ahead": node_feed("ahead", +300_000, 0, 1200, 1000),
        "true": node_feed("true", 0, 0, 1200, 2000),
        "behind": node_feed("behind", -300_000, 0, 1200, 3000),
    }
    shared = aggregate(interleave(*feeds.values()))
    for node, feed in feeds.items():
        alone = aggregate(feed)
        assert of(shared, node) == alone, node
        # and alone is the whole usage: 1190 s of heartbeats held to the 90 s cap at the end
        billed = sum(r.memory_byte_seconds for r in alone)
        total = {"ahead": 1000, "true": 2000, "behind": 3000}[node]
        assert billed == Decimal(total) * (1190 + 90)


def test_one_event_290_s_ahead_erases_nothing_of_its_neighbours() -> None:
    calm = node_feed("calm", 0, 0, 600, 1000)
    jumpy = node_feed("jumpy", 0, 0, 600, 500)
    c = Collector(inc=99)
    # within max_skew of its record time: accepted, and only the jumpy node's own affair
    jumpy.append((T0 + 200_000, "jumpy", c.hb(T0 + 490_000, row(1, 7), cid=2)))
    shared = aggregate(interleave(calm, jumpy))
    assert of(shared, "calm") == aggregate(calm)


def test_a_node_draining_its_spool_after_a_5_minute_outage_is_billed_exactly() -> None:
    steady = node_feed("steady", 0, 0, 1200, 1000)
    out = node_feed("out", 0, 0, 1200, 2000)
    # The node cannot reach the broker from 300 s to 600 s: those events are spooled and
    # sent at 600 s (record time), in order, before the new ones.
    delivered = [
        (max(rec, T0 + 600_000) if 300_000 <= rec - T0 < 600_000 else rec, n, e)
        for rec, n, e in out
    ]
    shared = aggregate(interleave(steady, delivered))
    assert of(shared, "out") == aggregate(out)
    assert of(shared, "steady") == aggregate(steady)


def test_a_silent_node_stops_holding_the_source_back_after_the_idle_time() -> None:
    steady = node_feed("steady", 0, 0, 1800, 1000)
    gone = node_feed("gone", 0, 0, 120, 2000)  # decommissioned at 120 s: never heard again
    agg = Aggregator(S)
    emitted_at: dict[tuple[str, int], int] = {}
    for i, (rec, node, e) in enumerate(interleave(steady, gone)):
        agg.add(node, e, offset=i, record_ts_ms=rec)
        for r in agg.advance():
            emitted_at[(r.node, r.window_start_ms - T0)] = rec - T0
    # Window 0 closes as usual (max_skew + lateness after its end in record time); the next
    # waits while "gone" may still come back (its last record at 110 s, idle from 710 s on);
    # then everything up to the watermark closes at once.
    assert emitted_at[("steady", 0)] == emitted_at[("gone", 0)] == 370_000
    assert emitted_at[("steady", 60_000)] == 710_000
    assert emitted_at[("steady", 300_000)] == 710_000
    assert emitted_at[("gone", 60_000)] == 710_000  # the silent node's last window too
    assert emitted_at[("steady", 1_200_000)] == 1_570_000  # later: the usual delay only
    assert agg.stats.late_events == 0


def test_a_wholly_silent_source_closes_its_last_window_on_other_traffic_time() -> None:
    feed = node_feed("n1", 0, 0, 300, 1000)
    agg = Aggregator(S)
    early: list[BillingRecord] = []
    for i, (rec, node, e) in enumerate(feed):
        agg.add(node, e, offset=i, record_ts_ms=rec)
        early += agg.advance()
    last = feed[-1][0]
    agg.idle(last + S.idle_ms - 1)
    assert agg.advance() == []  # not silent long enough
    agg.idle(last + S.idle_ms)
    closed = agg.advance()
    assert early + closed == aggregate(feed)  # everything, as --drain would close it
    # the last heartbeat at 290 s, held to 380 s
    assert closed and max(r.window_end_ms for r in closed) == T0 + 420_000


def test_idle_time_from_other_traffic_equals_the_source_resuming() -> None:
    """Live, the service may call idle() during a silence; a replay only sees the next record.
    Both give the same records."""
    before = node_feed("n1", 0, 0, 300, 1000)
    c = Collector(inc=5)
    after = [
        (T0 + s * 1000, "n1", c.hb(T0 + s * 1000, row(1, 4000), cid=3))
        for s in range(1300, 1500, 10)
    ]

    def run(call_idle: bool) -> list[BillingRecord]:
        agg = Aggregator(S)
        out: list[BillingRecord] = []
        for i, (rec, node, e) in enumerate(before):
            agg.add(node, e, offset=i, record_ts_ms=rec)
            out += agg.advance()
        if call_idle:
            agg.idle(T0 + 1_000_000)
            out += agg.advance()
        for i, (rec, node, e) in enumerate(after, start=len(before)):
            agg.add(node, e, offset=i, record_ts_ms=rec)
            out += agg.advance()
        return out + agg.flush()

    assert run(True) == run(False)


def test_an_idle_shorter_than_a_cap_and_a_window_cannot_tell_live_from_replay() -> None:
    """`idle` 2 s with 5 s windows, 1 s lateness, 3 s cap: the collector stops at 15 s and a
    new incarnation starts at 18 s. Live, the clock turned the node idle during the silence
    and closed its windows, so the new one's first events came late; a replay turned it idle
    only at its next record, which then rejoined in time: the records differed. The idle rule
    now waits at least a cap, the lateness and a window (9 s here)."""
    small = WindowSettings(window_ms=5_000, lateness_ms=1_000, max_gap_ms=3_000,
                           max_skew_ms=1_000, idle_ms=2_000)  # fmt: skip
    assert small.idle_after_ms == 9_000
    old, new = Collector(inc=1), Collector(inc=2)
    before = [
        (T0 + t, old.heartbeat(T0 + t, state(1, row(1, 100)))) for t in range(0, 15_001, 1000)
    ]
    after = [
        (T0 + t, new.heartbeat(T0 + t, state(1, row(1, 300)))) for t in range(18_000, 40_001, 1000)
    ]

    def run(live: bool) -> list[BillingRecord]:
        agg = Aggregator(small)
        out: list[BillingRecord] = []
        for i, (rec, e) in enumerate(before):
            agg.add("n1", e, offset=i, record_ts_ms=rec)
            out += agg.advance()
        if live:  # the service's clock during the silence
            for t in range(16_000, 18_000, 500):
                agg.idle(T0 + t)
                out += agg.advance()
        for i, (rec, e) in enumerate(after, start=len(before)):
            agg.add("n1", e, offset=i, record_ts_ms=rec)
            out += agg.advance()
        return out + agg.flush()

    live, replay = run(True), run(False)
    assert live == replay
    assert sum(r.memory_byte_seconds for r in live if r.kind == "container") == (
        100 * 15 + 100 * 3 + 300 * 22 + 300 * 3
    )


def test_future_events_are_refused_per_node_and_move_no_other_node() -> None:
    calm = node_feed("calm", 0, 0, 600, 1000)
    c = Collector(inc=3)
    liar = [
        (T0 + s * 1000, "liar", c.hb(T0 + s * 1000 + 400_000, row(1, 9))) for s in range(0, 600, 10)
    ]
    agg = Aggregator(S)
    out: list[BillingRecord] = []
    for i, (rec, node, e) in enumerate(interleave(calm, liar)):
        agg.add(node, e, offset=i, record_ts_ms=rec)
        out += agg.advance()
    out += agg.flush()
    assert agg.stats.future_events == 60
    assert agg.future_by_node == {"liar": 60}
    assert of(out, "liar") == []
    assert out == aggregate(calm)
