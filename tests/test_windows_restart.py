"""Restart equals an uninterrupted run for every input the transport can deliver: events
reordered within the lateness and redelivered duplicates, cut at every point (the service
commits after `advance()`; a restart reads again from `needed_offsets()` and suppresses the
windows up to `emitted_until_ms`)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_windows import Collector, row, state

from collector.aggregate.records import BillingRecord, record_order
from collector.aggregate.windows import Aggregator, WindowSettings
from collector.events import Event

S = WindowSettings(window_ms=10_000, lateness_ms=3_000, max_gap_ms=9_000, max_skew_ms=0)


@st.composite
def streams(draw: st.DrawFn) -> list[Event]:
    """One node: two containers whose processes start, sample, exit; heartbeats; a gone."""
    c = Collector()
    events: list[Event] = [c.appeared(0, cid=1), c.appeared(0, cid=2, pod="pod-b")]
    live: dict[int, set[int]] = {1: set(), 2: set()}
    gone: set[int] = set()
    t = 0
    for _ in range(draw(st.integers(5, 40))):
        t += draw(st.integers(0, 2_500))
        cid = draw(st.sampled_from([1, 2]))
        if cid in gone:
            continue
        kind = draw(st.integers(0, 9))
        pid = draw(st.integers(1, 3))
        if kind <= 4:
            live[cid].add(pid)
            events.append(c.sample(t, row(pid, draw(st.integers(1, 5)) * 100), cid=cid))
        elif kind <= 6 and live[cid]:
            p = draw(st.sampled_from(sorted(live[cid])))
            live[cid].discard(p)
            events.append(c.exited(t, p, cid=cid))
        elif kind <= 8:
            rows = [row(p, 100) for p in sorted(live[cid])]
            events.append(c.heartbeat(t, state(cid, *rows, pod="pod-a" if cid == 1 else "pod-b")))
        elif cid == 2:
            gone.add(cid)
            events.append(c.gone(t, cid=cid))
    events.append(c.sample(t + 40_000, row(9, 1), cid=1))  # moves the watermark past the end
    return events


@st.composite
def deliveries(draw: st.DrawFn) -> list[Event]:
    """The stream as a transport may deliver it: neighbours swapped when within the lateness,
    and some events delivered again later."""
    events = list(draw(streams()))
    for i in range(len(events) - 2, 0, -1):
        a, b = events[i], events[i + 1]
        if abs(a.ts - b.ts) < S.lateness_ms and draw(st.integers(0, 3)) == 0:
            events[i], events[i + 1] = b, a
    for _ in range(draw(st.integers(0, 4))):
        src = draw(st.integers(1, len(events) - 2))
        dst = draw(st.integers(src + 1, len(events) - 1))
        events.insert(dst, events[src])
    return events


def feed(agg: Aggregator, msgs: list[Event], first: int) -> list[BillingRecord]:
    out: list[BillingRecord] = []
    for offset in range(first, len(msgs)):
        agg.add("n1", msgs[offset], offset=offset)
        out += agg.advance()
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(msgs=deliveries())
def test_a_restart_at_every_cut_point_gives_the_uninterrupted_records(msgs: list[Event]) -> None:
    whole = Aggregator(S)
    expected = feed(whole, msgs, 0) + whole.flush()
    for cut in range(1, len(msgs)):
        before = Aggregator(S)
        got = feed(before, msgs[:cut], 0)
        resume = before.needed_offsets().get(0, cut)
        after = Aggregator(S, emitted_until_ms=before.emitted_until_ms)
        got += feed(after, msgs, resume) + after.flush()
        assert sorted(got, key=record_order) == sorted(expected, key=record_order), cut
