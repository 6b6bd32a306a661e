"""Pod identities in the aggregation core (collector/aggregate/windows/identity.py): which
window gets which name, decided by event times alone; unnamed records counted; restatements in
heartbeats; restart offsets; and the same records however the input is batched.

Default settings: 60 s windows, 10 s lateness, 90 s max gap.
"""

from __future__ import annotations

import random

import msgspec
from test_windows import Collector, S, row, run, state

from collector.aggregate.records import BillingRecord
from collector.aggregate.windows import Aggregator
from collector.events import Event, Heartbeat, Identity, PodIdentity

TEAM_A = Identity("pod-a", "ml", "trainer-x", "Deployment", "trainer", {"team": "vision"})
TEAM_B = Identity("pod-a", "ml", "trainer-x", "Deployment", "trainer", {"team": "speech"})


def ident(c: Collector, ts: int, who: Identity) -> PodIdentity:
    return PodIdentity(1, c.inc, c._n(), ts, who)


def names(records: list[BillingRecord]) -> list[tuple[int, str, str, str, str, dict[str, str]]]:
    return [
        (r.window_start_ms // 1000, r.namespace, r.pod, r.workload_kind, r.workload, r.labels)
        for r in records
        if r.pod_uid
    ]


def restate(c: Collector, ts: int, total: int, *pods: Identity) -> Heartbeat:
    """A heartbeat as the collector writes it: the container, and its pod's identity."""
    return Heartbeat(1, c.inc, c._n(), ts, 30_000, 0, 1, [state(1, row(1, total))], pods=list(pods))


def steady(c: Collector, until_s: int, every_s: int = 10) -> list[Event]:
    """A container sampled every `every_s` seconds from 0 to `until_s`."""
    events: list[Event] = [c.appeared(0), c.started(0, 1)]
    events += [c.sample(t * 1000, row(1, 100 + t)) for t in range(0, until_s + 1, every_s)]
    return events


def _speech_read_after_130_s() -> tuple[list[Event], int]:
    """Vision from 0 s, speech from 125 s, read after the sample of 130 s (which lets [60, 120)
    close); and the index of that PodIdentity."""
    c = Collector()
    events = steady(c, 120)
    events.insert(3, ident(c, 0, TEAM_A))
    events.append(ident(c, 125_000, TEAM_B))
    events += [c.sample(t * 1000, row(1, 100 + t)) for t in range(130, 201, 10)]
    at = next(i for i, e in enumerate(events) if e.ts == 130_000)
    events[at - 1], events[at] = events[at], events[at - 1]
    assert isinstance(events[at], PodIdentity)
    return events, at


def test_unknown_identity_is_billed_with_an_empty_namespace_and_counted() -> None:
    c = Collector()
    records, agg = run(steady(c, 150))
    assert [r.window_start_ms for r in records] == [0, 60_000, 120_000, 180_000]
    assert all(r.memory_byte_seconds > 0 for r in records[:3])
    assert {(r.namespace, r.pod, r.workload_kind, r.workload) for r in records} == {
        ("", "", "", "")
    }
    assert all(r.labels == {} for r in records)
    assert agg.stats.unnamed_records == 4


def test_identity_within_the_lateness_applies_to_that_window_and_later_ones_not() -> None:
    ns = ("ml", "trainer-x", "Deployment", "trainer", {"team": "vision"})
    for at_s, first_named in [(0, 0), (69, 0), (70, 60), (129, 60), (131, 120)]:
        c = Collector()
        events = steady(c, 200)
        # The identity arrives at `at_s`: it names every window whose end + 10 s lies after it.
        events.insert(
            next(i for i, e in enumerate(events) if e.ts > at_s * 1000),
            ident(c, at_s * 1000, TEAM_A),
        )
        records, agg = run(events)
        got = names(records)
        assert got == [
            (ws, *(ns if ws >= first_named else ("", "", "", "", {})))
            for ws in (0, 60, 120, 180, 240)
        ], at_s
        assert agg.stats.unnamed_records == first_named // 60


def test_a_changed_identity_names_the_windows_after_the_change() -> None:
    c = Collector()
    events = steady(c, 200)
    events.insert(3, ident(c, 0, TEAM_A))
    # team changes at 100 s: window [60, 120) closes at 130 s and takes the newer one.
    events.insert(
        next(i for i, e in enumerate(events) if e.ts > 100_000), ident(c, 100_000, TEAM_B)
    )
    records, _ = run(events)
    assert [r.labels["team"] for r in records] == ["vision", "speech", "speech", "speech", "speech"]


def test_heartbeat_restatement_names_a_consumer_that_starts_mid_stream() -> None:
    c = Collector()
    events = steady(c, 300)
    events.insert(3, ident(c, 0, TEAM_A))
    hb_at = next(i for i, e in enumerate(events) if e.ts >= 150_000)
    events.insert(hb_at, restate(c, 150_000, 250, TEAM_A))
    full, _ = run(events)
    # From the heartbeat on (the PodIdentity at 0 s not seen): the same names from 180 s on.
    tail, _ = run([e for e in events[hb_at:] if not isinstance(e, PodIdentity)])
    named_tail = [r for r in tail if r.window_start_ms >= 180_000]
    assert names(named_tail) == names([r for r in full if r.window_start_ms >= 180_000])
    assert named_tail and all(r.namespace == "ml" for r in named_tail)


def test_batching_and_advance_timing_do_not_change_the_names() -> None:
    c = Collector()
    events = steady(c, 400, every_s=7)
    rng = random.Random(5)
    for ts, who in [(5_000, TEAM_A), (95_000, TEAM_B), (250_000, TEAM_A)]:
        at = next(i for i, e in enumerate(events) if e.ts > ts)
        events.insert(at, ident(c, ts, who))
    expected, _ = run(events, kinds=("container", "node", "gpu", "idle"))
    for _ in range(5):
        agg = Aggregator(S)
        out: list[BillingRecord] = []
        for i, e in enumerate(events):
            agg.add("n1", e, offset=i)
            if rng.random() < 0.2:
                out += agg.advance()
        out += agg.flush()
        assert msgspec.json.encode(out) == msgspec.json.encode(expected)


def test_restart_from_the_needed_offsets_gives_the_same_named_records() -> None:
    c = Collector()
    events = steady(c, 400)
    events.insert(3, ident(c, 0, TEAM_A))
    # Restated by heartbeats every 30 s, as the collector does.
    for t in range(30, 400, 30):
        at = next(i for i, e in enumerate(events) if e.ts >= t * 1000)
        events.insert(at, restate(c, t * 1000, 100 + t, TEAM_A))
    live = Aggregator(S)
    emitted: list[BillingRecord] = []
    cut = 0
    for i, e in enumerate(events):
        live.add("n1", e, offset=i)
        emitted += live.advance()
        if e.ts >= 250_000 and not cut:
            cut = i
            break
    need = live.needed_offsets()[0]
    assert need > 3, "the identity of 0 s is not needed: a heartbeat restated it since"
    restarted = Aggregator(S, emitted_until_ms=live.emitted_until_ms)
    again: list[BillingRecord] = []
    for i in range(need, len(events)):
        restarted.add("n1", events[i], offset=i)
        again += restarted.advance()
    again += restarted.flush()
    full, _ = run(events)
    assert names(emitted + again) == names(full)
    assert all(r.namespace == "ml" for r in full)


def test_an_identity_read_after_its_window_could_close_names_only_later_ones() -> None:
    # The identity of 125 s lies within the lateness of [60, 120) (cut-off 130 s), but it is read
    # after the sample of 130 s, which let that window close (input reordered within the
    # lateness): it names the windows from 120 s on, whether advance() ran in between or not.
    events, at = _speech_read_after_130_s()
    a = ("ml", "trainer-x", "Deployment", "trainer", {"team": "vision"})
    b = ("ml", "trainer-x", "Deployment", "trainer", {"team": "speech"})
    want = [(0, *a), (60, *a), (120, *b), (180, *b), (240, *b)]
    for advance_at in (None, set(), {at - 1}, {at}, {at - 1, at + 3}):
        agg = Aggregator(S)
        out: list[BillingRecord] = []
        for i, e in enumerate(events):
            agg.add("n1", e, offset=i)
            if advance_at is None or i in advance_at:
                out += agg.advance()
        out += agg.flush()
        assert names([r for r in out if r.kind == "container"]) == want, advance_at


def test_a_change_after_a_window_ends_never_renames_that_window() -> None:
    # The team label changes 1-9 s after [60, 120) ended, within the lateness: the window was
    # vision's all along. Only a pod with no identity before a window's end takes one from its
    # lateness (test_identity_within_the_lateness_...).
    a = ("ml", "trainer-x", "Deployment", "trainer", {"team": "vision"})
    b = ("ml", "trainer-x", "Deployment", "trainer", {"team": "speech"})
    for change_s in (121, 125, 129):
        c = Collector()
        events = steady(c, 200)
        events.insert(3, ident(c, 0, TEAM_A))
        at = next(i for i, e in enumerate(events) if e.ts > change_s * 1000)
        events.insert(at, ident(c, change_s * 1000, TEAM_B))
        records, _ = run(events)
        assert names(records) == [(0, *a), (60, *a), (120, *b), (180, *b), (240, *b)], change_s


def test_a_close_split_where_an_earlier_assignment_stopped_names_as_that_assignment() -> None:
    # A partition assigned back (closed_before_ms) closes again, uncounted, up to where its
    # earlier owner stopped, then on: what the first half forgets must not be what the
    # second half's windows take.
    events, _ = _speech_read_after_130_s()

    def named(closed_before: int | None) -> tuple[list[tuple[int, str | None]], int]:
        agg = Aggregator(S, closed_before_ms=closed_before)
        for i, e in enumerate(events):
            agg.add("n1", e, offset=i)
        out = agg.advance() + agg.flush()
        got = [(r.window_start_ms // 1000, r.labels.get("team")) for r in out if r.pod_uid]
        return got, agg.stats.unnamed_records

    first = named(None)
    assert first == ([(0, "vision"), (60, "vision"), (120, "speech"), (180, "speech"),
                      (240, "speech")], 0)  # fmt: skip
    for closed_before in (60_000, 120_000):
        assert named(closed_before) == first, closed_before


def test_an_identity_past_its_retention_names_alike_however_the_input_is_advanced() -> None:
    # Named once at 0 s (retention 250 s), renamed at 365 s, read after the sample of 360 s,
    # within the lateness of [300, 360): advanced after each event (live prune had dropped the
    # expired entry) the window took the rename; advanced at the end, it was unnamed.
    c = Collector()
    events = steady(c, 480)
    events.insert(3, ident(c, 0, TEAM_A))
    at = next(i for i, e in enumerate(events) if e.ts > 365_000)
    events.insert(at, ident(c, 365_000, TEAM_B))
    got = []
    for advance_each in (True, False):
        agg = Aggregator(S)
        out: list[BillingRecord] = []
        for i, e in enumerate(events):
            agg.add("n1", e, offset=i)
            if advance_each:
                out += agg.advance()
        out += agg.flush()
        teams = [(r.window_start_ms // 1000, r.labels.get("team")) for r in out if r.pod_uid]
        got.append((teams, agg.stats.unnamed_records))
    assert got[0] == got[1]
    assert dict(got[0][0])[300] == "speech"
