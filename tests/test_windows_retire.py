"""What the aggregator forgets of nodes that left and GPUs that went away, and that forgetting
it changes nothing it bills.

A churning cluster: a steady node whose collector restarts every period and whose MIG uuid
changes every period, and one node per period that joins, runs a container for half the period
and leaves. The state kept is bounded by what is live; the records, and every counter, are
those of an aggregator that keeps everything (`keep_everything`: the incarnation pruning of
before, no device retirement), whatever the close cadence. Two things differ, by design: a
redelivery of a retired node's events is late instead of a duplicate (and bills nothing), and a
GPU uuid that comes back after it was retired does not count the time it was away as
unobserved.
"""

from __future__ import annotations

import hashlib

import msgspec
import pytest
from test_windows import Collector, nrow, row, state

from collector.aggregate.damage import DamageReport
from collector.aggregate.records import BillingRecord
from collector.aggregate.windows import Aggregator, WindowSettings, aggregator
from collector.aggregate.windows.incarnations import Incarnations
from collector.aggregate.windows.nodeguard import NodeGuard
from collector.aggregate.windows.state import NODE_CID
from collector.events import CollectorStarted, Event

S = WindowSettings()  # 60 s windows, 10 s lateness, 90 s max gap
T0 = 1_800_000_000_000
PERIOD = 1_200_000  # 20 minutes
STEP = 30_000

Stream = list[tuple[str, Event]]


def churn(periods: int) -> tuple[Stream, Stream]:
    """The cluster's events in read order, and node-0's events (to redeliver later)."""
    out: Stream = []
    first: Stream = []
    cid = 0
    for p in range(periods):
        t = T0 + p * PERIOD
        steady = Collector(inc=100 + p)
        visitor = Collector(inc=1000 + p)
        name = f"node-{p}"
        out.append(("steady", CollectorStarted(1, steady.inc, steady._n(), t, "h", 1, "/log")))
        out.append((name, CollectorStarted(1, visitor.inc, visitor._n(), t, "v", 2, "/log")))
        for ts in range(t, t + PERIOD, STEP):
            if (ts - t) % 300_000 == 0:
                cid += 1
            out.append(("steady", steady.heartbeat(ts, state(cid, row(1, 1000), pod=f"p{cid}"))))
            out.append(("steady", steady.node(ts, nrow(f"MIG-{p}", 5, 10, 1))))
            if ts < t + PERIOD // 2:  # the visitor leaves half way
                out.append((name, visitor.heartbeat(ts, state(1, row(2, 500 + p), pod=f"v{p}"))))
                out.append((name, visitor.node(ts, nrow(f"GPU-{p}", 1, 2, 3))))
        if p == 0:
            first = [x for x in out if x[0] == name]
    return out, first


def feed(agg: Aggregator, stream: Stream, every: int) -> list[BillingRecord]:
    """Add the stream (record time = event time), closing after every `every` events."""
    records: list[BillingRecord] = []
    for i, (node, e) in enumerate(stream):
        agg.add(node, e, offset=i, record_ts_ms=e.ts)
        if i % every == 0:
            records += agg.advance()
    return records + agg.advance()


@pytest.fixture
def keep_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    """The aggregator as it was: a node's last incarnation, its node's GPUs and every
    announcement are kept."""
    monkeypatch.setattr(Incarnations, "_retire", lambda self, node, inc: None)
    monkeypatch.setattr(NodeGuard, "forget", lambda self, gone: None)
    monkeypatch.setattr(aggregator, "retire_devices", lambda tr, horizon: None)


def run_all(stream: Stream, every: int, redeliver: Stream = ()) -> tuple[bytes, dict[str, int]]:
    """The records (as bytes) and the counters; `redeliver` is added after the stream, at the
    record time of its last event."""
    agg = Aggregator(S)
    records = feed(agg, stream, every)
    base = len(stream)
    for i, (node, e) in enumerate(redeliver):
        agg.add(node, e, offset=base + i, record_ts_ms=stream[-1][1].ts)
    records += agg.advance() + agg.flush()
    return msgspec.json.encode(records), msgspec.structs.asdict(agg.stats)


def comebacks(periods: int) -> Stream:
    """After `churn(periods)`: node-1's collector sends again (same incarnation, after a
    silence), node-2 gets a new collector, and node-3 one whose first event lies before its
    retired collector's first (an older one: from that first event on it is not billed)."""
    t = T0 + periods * PERIOD
    same = Collector(inc=1001)
    same.seq = 100
    new = Collector(inc=5)
    older = Collector(inc=9)
    out: Stream = [("node-3", older.hb(T0 + 3 * PERIOD - 60_000, row(4, 700)))]
    for ts in range(t, t + 600_000, STEP):
        out.append(("node-1", same.heartbeat(ts, state(2, row(5, 800), pod="back"))))
        out.append(("node-2", new.heartbeat(ts, state(1, row(6, 900), pod="new"))))
        out.append(("node-3", older.heartbeat(ts, state(1, row(4, 700), pod="older"))))
    return out


def test_state_is_bounded_by_what_is_live() -> None:
    stream, _ = churn(8)
    agg = Aggregator(S)
    dmg = DamageReport()
    for node, e in stream:
        dmg.see(node, e)
    feed(agg, stream, 1)
    incs = agg._incs
    # live: the steady node's current incarnation only (the last visitor left 10 minutes ago)
    assert sorted(incs._incs) == [("steady", 107)]
    assert sorted(incs._by_node) == ["steady"]
    assert sorted(incs._retired) == [f"node-{p}" for p in range(8)]
    assert sum(len(i.seqs) for i in incs._incs.values()) == 81
    assert list(incs._forgotten["steady"]) == [100, 101, 102, 103, 104, 105, 106]
    assert sorted(agg._guard._who) == [("steady", 107)]
    assert not agg._guard._counted
    node = agg._tracks[("steady", 107, NODE_CID)]
    assert (node.uuids, sorted(node.devs), node.expired) == ({"MIG-7": 0}, [0], {})
    assert sorted(k[0] for k in agg._tracks) == ["steady", "steady", "steady"]
    # the damage figures are those of the whole stream
    assert dmg.counts() == (0, 0, 0, 0, 0, 0)
    assert dmg.dropped_by_collectors == 0


def test_a_node_uuid_retires_within_one_incarnation() -> None:
    c = Collector(inc=5)
    agg = Aggregator(S)
    events = [
        c.node(T0 + h * 600_000 + s, nrow(f"MIG-{h}-a", 5, 10, 1), nrow(f"MIG-{h}-b", 5, 10, 1))
        for h in range(6)
        for s in range(0, 600_000, STEP)
    ]
    for i, e in enumerate(events):
        agg.add("n1", e, offset=i, record_ts_ms=e.ts)
        agg.advance()
    tr = agg._tracks[("n1", 5, NODE_CID)]
    assert tr.uuids == {"MIG-5-a": 10, "MIG-5-b": 11}
    assert sorted(tr.devs) == [10, 11]
    assert tr.expired == {}
    assert sorted(tr.keys) == [(0, 0, 10), (0, 0, 11)]


# What the aggregator that kept everything gave for churn(6): the records' JSON and counters.
RECORDS_SHA256 = "7a9d067e1700124b259738ff5cc4fa56a8fe46ffc7f7e28954b5c4c248702fb3"
BEFORE = {
    "events": 732,
    "duplicates": 0,
    "late_events": 0,
    "records": 1118,
    "unnamed_records": 205,
    "allocation_fallbacks": 363,
}


@pytest.mark.parametrize("every", [1, 7, 250])
def test_records_and_counters_are_those_of_keeping_everything(
    every: int, request: pytest.FixtureRequest
) -> None:
    stream, _ = churn(6)
    pruned = run_all(stream, every)
    request.getfixturevalue("keep_everything")
    kept = run_all(stream, every)
    assert pruned[0] == kept[0]
    assert pruned[1] == kept[1]
    assert hashlib.sha256(pruned[0]).hexdigest() == RECORDS_SHA256
    assert {k: pruned[1][k] for k in BEFORE} == BEFORE


@pytest.mark.parametrize("every", [1, 7, 250])
def test_nodes_that_come_back_are_billed_as_before(
    every: int, request: pytest.FixtureRequest
) -> None:
    stream, _ = churn(6)
    stream += comebacks(6)
    pruned = run_all(stream, every)
    request.getfixturevalue("keep_everything")
    kept = run_all(stream, every)
    assert pruned[0] == kept[0]
    assert pruned[1] == kept[1]
    assert {k: pruned[1][k] for k in ("late_events", "overlapping_events", "node_conflicts")} == {
        "late_events": 1,
        "overlapping_events": 20,
        "node_conflicts": 1,
    }


def test_a_redelivered_retired_node_is_late_and_bills_nothing(
    request: pytest.FixtureRequest,
) -> None:
    stream, node0 = churn(6)
    pruned_records, pruned = run_all(stream, 1, node0)
    request.getfixturevalue("keep_everything")
    kept_records, kept = run_all(stream, 1, node0)
    assert pruned_records == kept_records
    assert hashlib.sha256(pruned_records).hexdigest() == RECORDS_SHA256
    # node-0's 41 events, forgotten: late, where the aggregator that kept them found duplicates;
    # what late rows would have held in closed windows is counted for them then
    assert (kept["duplicates"], kept["late_events"], kept["late_ms_dropped"]) == (41, 0, 0)
    assert (pruned["duplicates"], pruned["late_events"]) == (0, 41)
    assert pruned["late_ms_dropped"] == 1_320_000
    differ = {k for k in kept if kept[k] != pruned[k]}
    assert differ == {"duplicates", "late_events", "late_ms_dropped"}


def mig(back: bool) -> Stream:
    """One incarnation whose two MIG uuids change every 10 minutes; with `back`, the first
    pair comes back for the last 10 minutes."""
    c = Collector(inc=5)
    out: Stream = []
    for h in range(7):
        name = 0 if back and h == 6 else h
        for s in range(0, 600_000, STEP):
            ts = T0 + h * 600_000 + s
            out.append(("n1", c.node(ts, nrow(f"MIG-{name}-a", 5, 10, 1), nrow(f"MIG-{name}-b"))))
    return out


@pytest.mark.parametrize("every", [1, 13])
def test_a_retired_uuid_that_comes_back_is_billed_as_before(
    every: int, request: pytest.FixtureRequest
) -> None:
    pruned = {back: run_all(mig(back), every) for back in (False, True)}
    request.getfixturevalue("keep_everything")
    kept = {back: run_all(mig(back), every) for back in (False, True)}
    assert pruned[False] == kept[False]
    assert pruned[True][0] == kept[True][0]
    # the time it was away was unobserved to the aggregator that kept it (two keys, from their
    # cap at 570 s + 90 s to their return at 3600 s); a retired uuid starts afresh
    assert (kept[True][1]["unobserved_ms"], pruned[True][1]["unobserved_ms"]) == (5_880_000, 0)
    assert {k for k, v in kept[True][1].items() if v != pruned[True][1][k]} == {"unobserved_ms"}


def test_a_redelivered_forgotten_incarnation_wakes_no_idle_node() -> None:
    """n1's first collector sends at 0 s and goes quiet; n0 moves the partition to 650 s (n1 is
    idle: 600 s); n1's first event is sent again (a restart resending its spool's tail), then
    its new collector starts at 700 s. An aggregator that closed after every record had
    forgotten n1's first incarnation: the redelivery was late, woke n1 with its old time and
    held the partition there, so the new collector's events were in time; one that closed at
    the end only took it for a duplicate, and they were late. The records depended on how
    often `advance()` ran; the old event stays out of the progress now."""
    from collector.events import (
        ContainerAppeared,
        DeviceLimit,
        Heartbeat,
        ProcessStarted,
        UsageRow,
        UsageSample,
    )

    settings = WindowSettings(2_000, 30_000, 8_000, 30_000, "max", 600_000)
    s = 1000
    limits = [DeviceLimit(0, "GPU-x", 8 << 30, 100)]
    usage = UsageRow(1, 1001, 0, 1 << 30, 0, 0, 1 << 30, 1 << 30, 50)
    stream: list[tuple[str, Event, int]] = [
        ("n1", Heartbeat(1, 1, 0, 0, 1000, 0, 1, []), 0),
        ("n0", Heartbeat(1, 9, 0, 650 * s, 1000, 0, 1, []), 650 * s),
        ("n1", Heartbeat(1, 1, 0, 0, 1000, 0, 1, []), 660 * s),  # sent again
        ("n0", Heartbeat(1, 9, 1, 800 * s, 1000, 0, 1, []), 800 * s),
        ("n1", ContainerAppeared(1, 2, 0, 700 * s, 1, "pod-a", "main", "/p", "v1.2", limits),
         800 * s),
        ("n1", ProcessStarted(1, 2, 1, 700 * s, 1, 1, 1001), 800 * s),
        ("n1", UsageSample(1, 2, 2, 700 * s, 1, [usage]), 800 * s),
        ("n0", Heartbeat(1, 9, 2, 900 * s, 1000, 0, 1, []), 900 * s),
    ]  # fmt: skip

    def run(every_record: bool) -> tuple[list[BillingRecord], int]:
        agg = Aggregator(settings)
        out: list[BillingRecord] = []
        for offset, (node, event, record_ts) in enumerate(stream):
            agg.add(node, event, offset=offset, record_ts_ms=record_ts)
            if every_record:
                out += agg.advance()
        return out + agg.advance() + agg.flush(), agg.stats.late_events

    assert run(True)[0] == run(False)[0]
    assert [r for r in run(True)[0] if r.node == "n1"] == []  # late, as with no close before
