"""A name or a running gate that a silence ends ends whether or not a window closed in it.

`Aggregator._prune` drops what a silence of `retain` (2 × max_gap) ended when a window closes;
an event after the silence used to find it still there when none closed (a drain, a replay
that closes every 256 records), so the records depended on how often `advance()` ran. Each case
is played closing after every event and closing once at the end; both give the records a
reading of the README expects.
"""

from __future__ import annotations

import pytest
from test_fair_share import run

from collector.aggregate.records import BillingRecord, to_json
from collector.aggregate.windows import Aggregator, WindowSettings
from collector.events import (
    CollectorStarted,
    ContainerAppeared,
    ContainerRun,
    DeviceLimit,
    DeviceUsageRow,
    Event,
    NodeDeviceSample,
    UsageRow,
    UsageSample,
)

GiB = 1 << 30
DEVS = [DeviceLimit(0, "GPU-A", 8 * GiB, 50)]


def appeared(seq: int, ts: int, cid: int) -> Event:
    return ContainerAppeared(1, 1, seq, ts, cid, f"pod-{cid}", "main", f"/c/{cid}", "v1.2", DEVS)


def sample(seq: int, ts: int, cid: int, pid: int = 7) -> Event:
    return UsageSample(1, 1, seq, ts, cid, [UsageRow(pid, pid, 0, GiB, 0, 0, GiB, 0, 10)])


def stopped(seq: int, ts: int, cid: int, at: int) -> Event:
    return ContainerRun(1, 1, seq, ts, cid, False, at, "finished")


def drained(events: list[Event]) -> list[BillingRecord]:
    """The records of closing once, at the end (`run` closes after every event)."""
    agg = Aggregator(WindowSettings(allocation_policy="cores"))
    for i, e in enumerate(events):
        agg.add("n1", e, offset=i)
    return agg.flush()


CASES = {
    # A gate read before the container's name (not running from 0) lapses 180 s on: the
    # container announced at 300 s is billed from then. Kept in a drain, it gated it for good.
    "unnamed gate, announcement in time": (
        [stopped(0, 0, 1, 0), appeared(1, 0, 2), sample(2, 290_000, 2), appeared(3, 300_000, 1),
         sample(4, 310_000, 2)],
        [(300_000, "60.000"), (360_000, "30.000")],
    ),
    # ... and an announcement that comes late (taken at 360 s, the end the input let close)
    "unnamed gate, announcement late": (
        [stopped(0, 0, 1, 0), appeared(1, 0, 2), sample(2, 400_000, 2), appeared(3, 300_000, 1)],
        [(360_000, "30.000")],
    ),
    # A name silent for 900 s has lapsed: a late gate (taken at 900 s) is the new run's, and
    # the announcement at 1072.5 s is gated by it. In a drain the lapse came only at the
    # announcement, and took the newer gate with the old name: 90 s billed.
    "late gate after a lapsed name": (
        [appeared(0, 0, 1), appeared(1, 0, 2), sample(2, 960_000, 2),
         stopped(3, 898_501, 1, 897_931), appeared(4, 1_072_501, 1), sample(5, 1_080_000, 2)],
        [(0, "60.000"), (60_000, "30.000")],
    ),
    # A late sample 700 s after the container's last event finds no name: unattributed. In a
    # drain it found the lapsed name and billed 84.7 s more.
    "late sample after a lapsed name": (
        [appeared(0, 74_678, 1), appeared(1, 0, 2), sample(2, 840_000, 2),
         sample(3, 774_678, 1, pid=9)],
        [(60_000, "45.322"), (120_000, "44.678")],
    ),
    # A sample read before the container's name (388 s), then its late announcement (taken at
    # 480 s), then a sample at 489 s: the name lasts from the track's last event (388 s). A
    # close had dropped the unnamed track after 90 s, the announcement's own time (16 s) was
    # taken for its last event, and the sample at 489 s forgot the name: nothing billed.
    "unnamed track named late": (
        [appeared(0, 0, 2), sample(1, 388_001, 1, pid=9), sample(2, 540_000, 2),
         appeared(3, 16_000, 1), sample(4, 489_001, 1, pid=9)],
        [(480_000, "50.999"), (540_000, "39.001")],
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_what_a_silence_ends_does_not_depend_on_when_windows_close(name: str) -> None:
    events, want = CASES[name]
    every, once = run(events, "cores")[0], drained(events)
    assert sorted(map(to_json, every)) == sorted(map(to_json, once))
    pod1 = sorted(
        (r.window_start_ms, str(r.observed_seconds))
        for r in every
        if r.kind == "container" and r.pod_uid == "pod-1"
    )
    assert pod1 == want


def by_node(events: list[tuple[str, Event]], every: bool) -> list[BillingRecord]:
    agg = Aggregator(WindowSettings(allocation_policy="cores"))
    out: list[BillingRecord] = []
    for i, (node, e) in enumerate(events):
        agg.add(node, e, offset=i)
        if every:
            out += agg.advance()
    return out + agg.flush()


def restarted(inc: int, ts: int) -> Event:
    return CollectorStarted(1, inc, 0, ts, "h", inc, "/log")


def gpu(inc: int, seq: int, ts: int) -> Event:
    return NodeDeviceSample(1, inc, seq, ts, [DeviceUsageRow("GPU-A", GiB, 30, 0)])


RESTARTS = {
    # n1's new collector says it started at 30 s; its first event comes when n2 has let the
    # windows to 690 s close: its start takes effect there (the container ran to its cap, 95 s).
    # Taken from the windows closed when the supersession was put in (none in a drain), it
    # cut the container at 30 s.
    "first event late": (
        [("n1", restarted(1, 0)), ("n1", appeared(1, 0, 1)), ("n1", sample(2, 5_000, 1)),
         ("n2", NodeDeviceSample(1, 9, 0, 700_000, [DeviceUsageRow("GPU-B", GiB, 0, 0)])),
         ("n1", restarted(2, 30_000))],
        "container", [(0, "60.000"), (60_000, "35.000")],
    ),
    # The new collector's event at 320 s, then its start (8 s) late: the node's rows of the old
    # one run to their cap (90 s), as when the windows to 300 s had closed in between.
    "earlier event late": (
        [("n1", gpu(1, 0, 0)), ("n1", gpu(2, 1, 320_000)), ("n1", restarted(2, 8_000))],
        "node", [(0, "60.000"), (60_000, "30.000"), (300_000, "40.000"), (360_000, "50.000")],
    ),
    # The new collector's event at 30 s cuts the old one there in time; its start (20 s) comes
    # after n2 let the windows to 690 s close. Only in a drain were both read before the cut was
    # put in: it took effect where the late start did, the old rows ran to their cap beside the
    # new ones (90 s observed in each window).
    "a start read in time, an earlier one late": (
        [("n1", gpu(1, 0, 0)), ("n1", gpu(2, 1, 30_000)),
         ("n2", NodeDeviceSample(1, 9, 0, 700_000, [DeviceUsageRow("GPU-B", GiB, 0, 0)])),
         ("n1", restarted(2, 20_000))],
        "node", [(0, "60.000"), (60_000, "60.000")],
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(RESTARTS))
def test_a_restart_read_late_takes_effect_whatever_the_closes(name: str) -> None:
    events, kind, want = RESTARTS[name]
    every, once = by_node(events, True), by_node(events, False)
    assert sorted(map(to_json, every)) == sorted(map(to_json, once))
    got = sorted(
        (r.window_start_ms, str(r.observed_seconds))
        for r in every
        if r.kind == kind and r.node == "n1"
    )
    assert got == want
