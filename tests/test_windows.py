"""The aggregation core: exact, hand-computed window values, and properties against a simple
reference (per-key step functions with the max_gap cap, no windows).

Default settings throughout: 60 s windows, 10 s lateness, 90 s max gap. Device 0 of container
"pod-a/main" has limit 1000 bytes and SM limit 50 %, so limit integrals are easy to check. Node
rows (NodeDeviceSample) are the records with an empty pod_uid.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from decimal import Decimal
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collector.aggregate.records import BillingRecord, make_record_id
from collector.aggregate.windows import Aggregator, WindowSettings
from collector.aggregate.windows.incarnations import DEDUP_WINDOW, Incarnations
from collector.aggregate.windows.settings import NEVER
from collector.events import (
    ContainerAppeared,
    ContainerGone,
    ContainerState,
    DeviceLimit,
    DeviceUsageRow,
    Event,
    Heartbeat,
    LayoutAnomaly,
    LimitsChanged,
    NodeDeviceSample,
    ProcessExited,
    ProcessStarted,
    UsageRow,
    UsageSample,
)

S = WindowSettings()  # 60 s windows, 10 s lateness, 90 s max gap


def dev(index: int = 0, limit: int = 1000, sm: int = 50) -> DeviceLimit:
    return DeviceLimit(index, f"GPU-{index}", limit, sm)


def row(pid: int, total: int, device: int = 0, monitor: int = 0, sm: int = 0) -> UsageRow:
    return UsageRow(pid, pid + 1000, device, total, 0, 0, total, monitor, sm)


def nrow(uuid: str = "GPU-0", unaccounted: int = 0, used: int = 0, util: int = 0) -> DeviceUsageRow:
    return DeviceUsageRow(uuid, used, util, unaccounted)


class Collector:
    """Builds one incarnation's events with consecutive sequence numbers."""

    def __init__(self, inc: int = 7) -> None:
        self.inc = inc
        self.seq = 0

    def _n(self) -> int:
        self.seq += 1
        return self.seq - 1

    def appeared(
        self,
        ts: int,
        cid: int = 1,
        pod: str = "pod-a",
        ctr: str = "main",
        devices: Sequence[DeviceLimit] = (dev(),),
    ) -> ContainerAppeared:
        return ContainerAppeared(
            1, self.inc, self._n(), ts, cid, pod, ctr, f"/c/{pod}_{ctr}", "v1.2", list(devices)
        )

    def sample(self, ts: int, *rows: UsageRow, cid: int = 1) -> UsageSample:
        return UsageSample(1, self.inc, self._n(), ts, cid, list(rows))

    def started(self, ts: int, pid: int, cid: int = 1) -> ProcessStarted:
        return ProcessStarted(1, self.inc, self._n(), ts, cid, pid, pid + 1000)

    def exited(self, ts: int, pid: int, cid: int = 1) -> ProcessExited:
        return ProcessExited(1, self.inc, self._n(), ts, cid, pid, pid + 1000)

    def gone(self, ts: int, cid: int = 1) -> ContainerGone:
        return ContainerGone(1, self.inc, self._n(), ts, cid)

    def limits(self, ts: int, devices: Sequence[DeviceLimit], cid: int = 1) -> LimitsChanged:
        return LimitsChanged(1, self.inc, self._n(), ts, cid, list(devices))

    def heartbeat(self, ts: int, *states: ContainerState) -> Heartbeat:
        return Heartbeat(1, self.inc, self._n(), ts, 30_000, 0, 1, list(states))

    def hb(self, ts: int, *rows: UsageRow, cid: int = 1) -> Heartbeat:
        return self.heartbeat(ts, state(cid, *rows))

    def anomaly(self, ts: int) -> LayoutAnomaly:
        return LayoutAnomaly(1, self.inc, self._n(), ts, -1, "/c/x", "unreadable", "")

    def node(self, ts: int, *rows: DeviceUsageRow) -> NodeDeviceSample:
        return NodeDeviceSample(1, self.inc, self._n(), ts, list(rows))


def state(
    cid: int,
    *rows: UsageRow,
    pod: str = "pod-a",
    ctr: str = "main",
    devices: Sequence[DeviceLimit] = (dev(),),
) -> ContainerState:
    return ContainerState(cid, pod, ctr, "v1.2", list(devices), list(rows))


def run(
    events: Iterable[Event],
    settings_: WindowSettings = S,
    *,
    node: str = "n1",
    agg: Aggregator | None = None,
    flush: bool = True,
    kinds: tuple[str, ...] = ("container", "node"),
) -> tuple[list[BillingRecord], Aggregator]:
    """Feed events one by one (advance after each), then flush; the records of `kinds` (the
    per-GPU allocation records are tested in test_fair_share.py)."""
    agg = agg or Aggregator(settings_)
    out: list[BillingRecord] = []
    for i, e in enumerate(events):
        agg.add(node, e, offset=i)
        out += agg.advance()
    if flush:
        out += agg.flush()
    return [r for r in out if r.kind in kinds], agg


def usage(records: list[BillingRecord]) -> list[BillingRecord]:
    """The container and node records (without the per-GPU allocation records)."""
    return [r for r in records if r.kind in ("container", "node")]


def one(records: list[BillingRecord], window_start_ms: int, device: str = "GPU-0") -> BillingRecord:
    found = [r for r in records if r.window_start_ms == window_start_ms and r.device_uuid == device]
    assert len(found) == 1, found
    return found[0]


def windows(records: list[BillingRecord]) -> list[int]:
    return [r.window_start_ms for r in records]


def node_one(
    records: list[BillingRecord], window_start_ms: int, device: str = "GPU-0"
) -> BillingRecord:
    return one([r for r in records if r.pod_uid == ""], window_start_ms, device)


# --- exact values ------------------------------------------------------------------------


def test_constant_value_over_a_whole_window() -> None:
    c = Collector()
    r1 = row(1, 100, monitor=120, sm=30)
    events = [c.appeared(0), c.sample(0, r1), c.hb(30_000, r1), c.hb(60_000, r1), c.hb(90_000, r1)]
    records, agg = run(events, flush=False)
    assert windows(records) == [0]  # watermark 80 s: only [0, 60) is closed
    r = records[0]
    assert (r.window_start_ms, r.window_end_ms) == (0, 60_000)
    assert (r.node, r.pod_uid, r.container, r.device_uuid) == ("n1", "pod-a", "main", "GPU-0")
    assert r.memory_byte_seconds == 6000.0
    assert r.nvml_memory_byte_seconds == 7200.0
    assert r.sm_percent_seconds == 1800.0
    assert r.memory_limit_byte_seconds == 60_000.0
    assert r.sm_limit_percent_seconds == 3000.0
    assert r.peak_memory_bytes == 100
    assert r.observed_seconds == 60.0
    assert r.samples == 2  # rows at 0 s and 30 s
    assert r.revision == 0
    assert agg.emitted_until_ms == 60_000
    assert agg.stats.records == 3  # the container row, its GPU and its idle time


def test_step_inside_a_window() -> None:
    c = Collector()
    events = [c.appeared(0), c.sample(0, row(1, 100)), c.sample(20_000, row(1, 300))]
    events.append(c.sample(70_000, row(1, 300)))
    records, _ = run(events, flush=False)
    r = one(records, 0)
    assert r.memory_byte_seconds == 100 * 20 + 300 * 40
    assert r.peak_memory_bytes == 300
    assert r.samples == 2


def test_gap_beyond_max_gap_is_unobserved_and_counted() -> None:
    c = Collector()
    events = [c.appeared(0), c.sample(0, row(1, 100)), c.sample(120_000, row(1, 100))]
    records, agg = run(events)
    assert windows(records) == [0, 60_000, 120_000, 180_000]
    assert one(records, 0).memory_byte_seconds == 6000.0
    w60 = one(records, 60_000)
    assert w60.memory_byte_seconds == 3000.0  # held until 90 s, the cap
    assert w60.observed_seconds == 30.0  # presence has the same cap
    assert w60.memory_limit_byte_seconds == 30_000.0
    assert one(records, 120_000).memory_byte_seconds == 6000.0
    assert one(records, 180_000).memory_byte_seconds == 3000.0  # 120 s + 90 s cap (flush)
    # 90 s -> 120 s; the final cap is not counted, nothing restated the key after it
    assert agg.stats.unobserved_ms == 30_000


def test_process_exit_mid_window() -> None:
    c = Collector()
    events = [
        c.appeared(0),
        c.sample(0, row(1, 100)),
        c.exited(15_000, 1),
        c.hb(30_000),
        c.hb(70_000),
    ]
    records, _ = run(events, flush=False)
    r = one(records, 0)
    assert r.memory_byte_seconds == 1500.0
    assert r.peak_memory_bytes == 100
    assert r.observed_seconds == 60.0
    assert r.memory_limit_byte_seconds == 60_000.0


def test_container_gone_ends_usage_and_presence() -> None:
    c = Collector()
    events = [c.appeared(0), c.sample(0, row(1, 100)), c.gone(40_000)]
    records, agg = run(events)
    assert windows(records) == [0]
    r = records[0]
    assert r.memory_byte_seconds == 4000.0
    assert r.observed_seconds == 40.0
    assert r.memory_limit_byte_seconds == 40_000.0
    assert r.sm_limit_percent_seconds == 2000.0
    # nothing left open, but the node is still active (not `idle`): a restart reads its last
    # event again, so that it knows the node if a spool of it comes later (progress.held_back)
    assert agg.needed_offsets() == {0: 2}


def test_interval_split_exactly_at_window_edges() -> None:
    c = Collector()
    events = [
        c.appeared(59_500),
        c.sample(59_500, row(1, 3)),
        c.sample(75_000, row(1, 200)),
        c.gone(100_001),
    ]
    records, _ = run(events)
    w0, w1 = one(records, 0), one(records, 60_000)
    assert w0.memory_byte_seconds == 1.5  # 3 B x 0.5 s
    assert w0.observed_seconds == 0.5
    assert w0.samples == 1
    assert w1.memory_byte_seconds == 3 * 15 + 200 * Decimal("25.001")  # exact, not a float
    assert w1.observed_seconds == Decimal("40.001")
    assert w1.peak_memory_bytes == 200
    assert w1.samples == 1


def test_two_processes_are_summed_and_peak_is_max_of_the_sum() -> None:
    c = Collector()
    events = [
        c.appeared(0, devices=[dev(0), dev(1, limit=2000, sm=100)]),
        c.sample(0, row(1, 100), row(1, 7, device=1)),
        c.sample(10_000, row(2, 200)),
        c.sample(20_000, row(1, 150)),
        c.exited(40_000, 2),
        c.gone(60_000),
    ]
    records, _ = run(events)
    r0 = one(records, 0, "GPU-0")
    assert r0.memory_byte_seconds == 100 * 10 + 300 * 10 + 350 * 20 + 150 * 20
    assert r0.peak_memory_bytes == 350
    assert r0.samples == 3
    r1 = one(records, 0, "GPU-1")
    assert r1.memory_byte_seconds == 7 * 60
    assert r1.memory_limit_byte_seconds == 2000 * 60
    assert r1.sm_limit_percent_seconds == 100 * 60
    assert r1.peak_memory_bytes == 7
    assert r1.samples == 1
    assert len(records) == 2


def test_heartbeat_that_omits_a_key_ends_it() -> None:
    c = Collector()
    events = [
        c.appeared(0),
        c.sample(0, row(1, 100), row(2, 50)),
        c.hb(30_000, row(1, 100)),
        c.hb(70_000, row(1, 100)),
    ]
    records, _ = run(events, flush=False)
    assert one(records, 0).memory_byte_seconds == 100 * 60 + 50 * 30


def test_heartbeat_after_a_gap_counts_unobserved_until_it() -> None:
    c = Collector()
    events = [c.appeared(0), c.sample(0, row(1, 100), row(2, 10)), c.hb(150_000, row(1, 100))]
    _, agg = run(events)
    # pid 1 restated at 150 s, pid 2 ended by omission at 150 s: 60 s beyond the cap each
    assert agg.stats.unobserved_ms == 2 * 60_000


def test_limits_changed_mid_window() -> None:
    c = Collector()
    events = [
        c.appeared(0),
        c.limits(30_000, [dev(0, limit=4000, sm=100)]),
        c.gone(60_000),
    ]
    records, _ = run(events)
    r = one(records, 0)
    assert r.memory_limit_byte_seconds == 1000 * 30 + 4000 * 30
    assert r.sm_limit_percent_seconds == 50 * 30 + 100 * 30
    assert r.memory_byte_seconds == 0.0
    assert r.observed_seconds == 60.0


@pytest.mark.parametrize("joins", [True, False])
def test_a_device_joining_or_leaving_mid_window_is_observed_only_while_listed(
    joins: bool,
) -> None:
    """GPU 1 is in the table only for [30 s, 60 s) (a device HAMi-core registers late), or
    only for [0, 30 s): its records are observed 30 s, and its idle is the rest of those 30 s
    (`cores`: a 50 % SM limit takes half)."""
    c = Collector()
    one_dev, two = [dev(0)], [dev(0), dev(1)]
    before, after = (one_dev, two) if joins else (two, one_dev)
    events = [
        c.appeared(0, devices=before),
        c.heartbeat(20_000, state(1, devices=before)),
        c.limits(30_000, after),
        c.heartbeat(40_000, state(1, devices=after)),
        c.heartbeat(59_000, state(1, devices=after)),
        c.gone(60_000),
    ]
    records, _ = run(
        events, WindowSettings(allocation_policy="cores"), kinds=("container", "gpu", "idle")
    )
    gpu1 = {r.kind: r for r in records if r.device_uuid == dev(1).uuid}
    assert {k: (r.observed_seconds, r.allocated_gpu_seconds) for k, r in gpu1.items()} == {
        "container": (Decimal("30.000"), Decimal("15.000")),
        "gpu": (Decimal("30.000"), Decimal("15.000")),
        "idle": (Decimal("0.000"), Decimal("15.000")),
    }
    assert gpu1["container"].memory_limit_byte_seconds == 1000 * 30


def test_presence_capped_at_max_gap_after_last_event() -> None:
    c = Collector()
    records, _ = run([c.appeared(0), c.started(10_000, 1)])
    assert windows(records) == [0, 60_000]
    assert one(records, 0).observed_seconds == 60.0
    assert one(records, 60_000).observed_seconds == 40.0  # until 10 s + 90 s
    assert one(records, 60_000).memory_byte_seconds == 0.0


def test_out_of_order_within_lateness_gives_the_same_records() -> None:
    c = Collector()
    events = [
        c.appeared(0),
        c.sample(1_000, row(1, 100)),
        c.sample(5_000, row(2, 40)),
        c.sample(58_000, row(1, 300)),
        c.sample(61_000, row(1, 10)),
        c.exited(65_000, 2),
        c.sample(66_000, row(1, 20)),
        c.hb(90_000, row(1, 20)),
        c.gone(130_000),
    ]
    in_order, a = run(events)
    # each event at most 9 s behind the newest one delivered before it
    shuffled = [events[i] for i in (0, 2, 1, 4, 6, 5, 3, 7, 8)]
    reordered, b = run(shuffled)
    assert reordered == in_order
    assert a.stats.late_events == b.stats.late_events == 0
    assert one(in_order, 0).memory_byte_seconds == 100 * 57 + 40 * 55 + 300 * 2


def test_late_event_is_counted_and_takes_effect_from_the_closed_end() -> None:
    c = Collector()
    late = c.sample(50_000, row(2, 200))  # emitted at 50 s, delivered after window 0 closed
    events = [
        c.appeared(0),
        c.sample(0, row(1, 100)),
        c.hb(30_000, row(1, 100)),
        c.sample(75_000, row(1, 100)),  # watermark 65 s: [0, 60) closes
        late,
        c.sample(100_000, row(1, 100)),
        c.sample(130_000, row(1, 100)),  # watermark 120 s: [60, 120) closes
    ]
    records, agg = run(events, flush=False)
    assert one(records, 0).memory_byte_seconds == 6000.0  # not revised
    w1 = one(records, 60_000)
    assert w1.memory_byte_seconds == 100 * 60 + 200 * 60  # pid 2 from 60 s on (cap at 140 s)
    assert w1.peak_memory_bytes == 300
    assert w1.samples == 2  # 75 s and 100 s; the late row is not counted again
    assert agg.stats.late_events == 1
    assert agg.stats.late_ms_dropped == 10_000  # 50 s -> 60 s
    assert all(r.revision == 0 for r in records)


def test_late_sample_older_than_the_current_value_is_ignored() -> None:
    c = Collector()
    stale = c.sample(40_000, row(1, 999))
    events = [
        c.appeared(0),
        c.sample(0, row(1, 100)),
        c.sample(50_000, row(1, 100)),
        c.sample(75_000, row(1, 100)),
        stale,  # older than the 50 s sample already in effect
        c.sample(130_000, row(1, 100)),
    ]
    records, agg = run(events, flush=False)
    assert one(records, 60_000).memory_byte_seconds == 6000.0
    assert agg.stats.late_events == 1
    # 40 s -> 50 s: from 50 s on the key had its next sample, so the late value held 10 s
    assert agg.stats.late_ms_dropped == 10_000


def test_late_sample_beyond_its_cap_has_no_effect() -> None:
    c = Collector()
    stale = c.sample(1_000, row(2, 999))
    events = [
        c.appeared(0),
        c.sample(0, row(1, 100)),
        c.sample(60_000, row(1, 100)),
        c.sample(150_000, row(1, 100)),  # closes [0, 60) and [60, 120)
        stale,  # capped at 91 s, before the closed end
        c.sample(200_000, row(1, 100)),
    ]
    records, agg = run(events, flush=False)
    assert one(records, 120_000).memory_byte_seconds == 100 * 60
    assert agg.stats.late_ms_dropped == 90_000


def test_duplicates_are_dropped_and_counted() -> None:
    c = Collector()
    events = [
        c.appeared(0),
        c.sample(0, row(1, 100)),
        c.sample(20_000, row(1, 300)),
        c.gone(50_000),
    ]
    clean, _ = run(events)
    dup, agg = run([events[0], events[1], events[1], events[2], events[0], events[2], events[3]])
    assert dup == clean
    assert agg.stats.duplicates == 3
    assert agg.stats.events == 7


def test_duplicate_far_behind_the_newest_sequence_is_dropped() -> None:
    c = Collector()
    agg = Aggregator(S)
    agg.add("n1", c.appeared(0))
    # (after a drop of 19 998 events: two in a row, so the window moves to them)
    agg.add("n1", UsageSample(1, c.inc, 19_999, 1_000, 1, [row(1, 5)]))
    agg.add("n1", UsageSample(1, c.inc, 20_000, 1_000, 1, [row(1, 5)]))
    agg.add("n1", UsageSample(1, c.inc, 5_000, 1_000, 1, [row(1, 5)]))  # never seen, but old
    assert agg.stats.duplicates == 1


def test_a_seq_exactly_the_window_behind_and_never_seen_is_admitted() -> None:
    """More than DEDUP_WINDOW behind is a redelivery; exactly DEDUP_WINDOW behind is not."""
    incs = Incarnations()
    assert incs.admit("n1", 1, 19_999, 0)
    assert incs.admit("n1", 1, 20_000, 0)  # (the first seq is the newest once its next is seen)
    assert incs.admit("n1", 1, 20_000 - DEDUP_WINDOW, 0)
    assert not incs.admit("n1", 1, 20_000 - DEDUP_WINDOW, 0)  # now seen
    assert not incs.admit("n1", 1, 20_000 - DEDUP_WINDOW - 1, 0)


def test_a_lone_seq_far_ahead_moves_no_window() -> None:
    """One event whose seq is 10 000 000 (a corrupt or hostile producer) made every later
    event of its incarnation "more than DEDUP_WINDOW behind", each dropped as a duplicate. It is
    admitted, and kept so that its redelivery is one, but only a seq whose predecessor was seen
    too (a collector that dropped that many events goes on from there) moves the window."""
    incs = Incarnations()
    for seq in range(100):
        assert incs.admit("n1", 1, seq, 0)
    assert incs.admit("n1", 1, 10_000_000, 0)
    assert not incs.admit("n1", 1, 10_000_000, 0)  # its redelivery
    for seq in range(100, 200):
        assert incs.admit("n1", 1, seq, 0)
    assert not incs.admit("n1", 1, 150, 0)
    far = 200 + DEDUP_WINDOW + 1  # after a drop of more than DEDUP_WINDOW events
    assert incs.admit("n1", 1, far, 0)
    assert incs.admit("n1", 1, far + 1, 0)  # the window moves
    assert not incs.admit("n1", 1, far - DEDUP_WINDOW - 1, 0)  # far behind it now
    # The first seq seen of an incarnation (a new one, or one a restart reads again) too: it
    # took the window with it, and every later event was a duplicate.
    assert incs.admit("n1", 2, 10_000_000, 0)
    for seq in range(100):
        assert incs.admit("n1", 2, seq, 0)
    assert not incs.admit("n1", 2, 10_000_000, 0)
    assert not incs.admit("n1", 2, 50, 0)


_INC_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.sampled_from("ab"), st.integers(0, 6),
                  st.integers(-3, 30), st.integers(-5, 50)),
        st.tuples(st.just("prune"), st.integers(-5, 60)),
    ),
    max_size=60,
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(_INC_OPS)
def test_an_incarnations_successor_is_the_earliest_newer_one(ops: list[tuple[Any, ...]]) -> None:
    """The successor was found by scanning every incarnation of the node for every event
    (16 000 incarnations: 7.7 s to add their events, 34 s to close); it is now the next in an
    ordered list, kept as incarnations come, move earlier, are forgotten, retired and restored.
    It must stay the definition: the smallest (first_ts, inc) above the incarnation's own."""
    incs = Incarnations()
    for op in ops:
        if op[0] == "admit":
            incs.admit(*op[1:])
        else:
            incs.prune(set(), op[1])
        for (node, inc), me in incs._incs.items():
            newer = [(o.first_ts, i) for (n, i), o in incs._incs.items()
                     if n == node and (o.first_ts, i) > (me.first_ts, inc)]  # fmt: skip
            expected = min(newer) if newer else (NEVER, None)
            assert incs.successor(node, inc) == expected


def test_devices_that_leave_the_table_with_nothing_to_bill_are_not_kept() -> None:
    """Every table of new indices added its devices for the container's life (2 000 tables of
    16: 32 001 devices, walked by every later event). One that leaves with nothing left goes;
    one that still has a live key stays (its usage is still the container's) until a table
    comes when it holds nothing."""
    c = Collector()
    agg = Aggregator(S)
    agg.add("n1", c.appeared(0, devices=[dev(0)]))
    agg.add("n1", c.sample(0, row(1, 100)))  # a live key on device 0
    for k in range(50):
        table = [dev(1 + 16 * k + i) for i in range(16)]
        agg.add("n1", c.limits(1_000 + k, table))
    # (events are applied as the windows they fall in close)
    agg.add("n1", c.heartbeat(400_000, state(1, row(1, 100), devices=table)))
    agg.advance()
    devs = agg._tracks[("n1", c.inc, 1)].devs
    assert sorted(devs) == [0, *range(1 + 16 * 49, 1 + 16 * 50)]
    assert devs[0].uuid is None  # (its key was live when the last table came)


def test_future_events_are_dropped_and_counted() -> None:
    c = Collector()
    agg = Aggregator(S)
    agg.add("n1", c.appeared(0), record_ts_ms=0)
    agg.add("n1", c.sample(0, row(1, 100)), record_ts_ms=0)
    agg.add("n1", c.sample(300_001, row(1, 999)), record_ts_ms=0)  # > 300 s ahead
    agg.add("n1", c.sample(300_000, row(1, 100)), record_ts_ms=0)  # exactly max_skew: kept
    assert agg.stats.future_events == 1
    records = usage(agg.flush())
    assert max(r.peak_memory_bytes for r in records) == 100


def test_unknown_cid_is_unattributed_until_a_heartbeat_names_it() -> None:
    c = Collector()
    events = [
        c.appeared(0, cid=1),
        c.sample(0, row(1, 5), cid=1),
        c.sample(1_000, row(1, 100), row(2, 100), cid=9),  # cid 9: identity unknown
        c.hb(70_000, row(1, 5)),  # closes [0, 60): cid 9 still unknown
        c.heartbeat(80_000, state(9, row(1, 100), pod="pod-b")),
        c.gone(120_000, cid=9),
    ]
    records, agg = run(events)
    assert agg.stats.unattributed_rows == 2
    assert [r.pod_uid for r in records if r.window_start_ms == 0] == ["pod-a"]
    b = [r for r in records if r.pod_uid == "pod-b"]
    assert [(r.window_start_ms, r.memory_byte_seconds) for r in b] == [(60_000, 100 * 40)]


def test_unknown_device_index_is_unattributed() -> None:
    c = Collector()
    records, agg = run([c.appeared(0), c.sample(0, row(1, 100), row(1, 50, device=3)), c.gone(1)])
    assert agg.stats.unattributed_rows == 1
    assert [r.device_uuid for r in records] == ["GPU-0"]


def test_rows_before_the_identity_in_event_time_are_unattributed() -> None:
    # A consumer that starts mid-stream: the first heartbeat names the container at 30 s. That
    # it arrives before the window closes changes nothing (records never depend on batching).
    c = Collector()
    events = [c.sample(1_000, row(1, 100)), c.hb(30_000, row(1, 100)), c.gone(60_000)]
    records, agg = run(events)
    assert agg.stats.unattributed_rows == 1
    r = one(records, 0)
    assert r.memory_byte_seconds == 100 * 30
    assert r.memory_limit_byte_seconds == 1000 * 30
    assert r.observed_seconds == 30.0
    assert r.samples == 1


def test_identity_is_forgotten_after_a_long_silence() -> None:
    c = Collector()
    events = [
        c.appeared(0),
        c.sample(0, row(1, 100)),
        c.sample(180_000, row(1, 100)),  # 2 x max_gap later: the identity is gone
        c.hb(200_000, row(1, 100)),
        c.gone(240_000),
    ]
    records, agg = run(events)
    assert agg.stats.unattributed_rows == 1
    assert [(r.window_start_ms, r.memory_byte_seconds) for r in records] == [
        (0, 6000.0),
        (60_000, 3000.0),
        (180_000, 4000.0),
    ]


def test_multiple_nodes_and_sources_use_the_minimum_watermark() -> None:
    a, b = Collector(inc=1), Collector(inc=2)
    agg = Aggregator(S)
    agg.add("na", a.appeared(0), source=0, offset=0)
    agg.add("na", a.sample(0, row(1, 100)), source=0, offset=1)
    agg.add("nb", b.appeared(0, pod="pod-b"), source=1, offset=0)
    agg.add("nb", b.sample(0, row(1, 7)), source=1, offset=1)
    agg.add("na", a.sample(200_000, row(1, 100)), source=0, offset=2)
    agg.add("nb", b.sample(65_000, row(1, 7)), source=1, offset=2)
    assert usage(agg.advance()) == []  # watermark min(190, 55) s
    agg.add("nb", b.sample(75_000, row(1, 7)), source=1, offset=3)
    records = usage(agg.advance())  # watermark min(190, 65) s
    assert [(r.node, r.window_start_ms, r.memory_byte_seconds) for r in records] == [
        ("na", 0, 6000.0),
        ("nb", 0, 420.0),
    ]
    assert agg.needed_offsets() == {0: 0, 1: 0}  # the identities (no heartbeat yet)


def test_records_are_sorted_by_window_and_row() -> None:
    c = Collector()
    events = [
        c.appeared(0, cid=2, pod="pod-b", devices=[dev(1), dev(0)]),
        c.appeared(0, cid=1, pod="pod-a"),
        c.sample(0, row(1, 1), cid=2),
        c.sample(0, row(1, 1), cid=1),
        c.gone(70_000, cid=1),
        c.gone(70_000, cid=2),
    ]
    records, _ = run(events)
    keys = [(r.window_start_ms, r.pod_uid, r.device_uuid) for r in records]
    assert keys == sorted(keys)
    assert len(keys) == 6


def test_newer_incarnation_ends_the_older_one() -> None:
    old, new = Collector(inc=111), Collector(inc=5)
    events = [
        old.appeared(0),
        old.sample(0, row(1, 100)),
        new.appeared(20_000, cid=4),  # collector restarted: same container, new cid
        new.sample(20_000, row(1, 100), cid=4),
    ]
    records, _ = run(events)
    w0 = one(records, 0)
    assert w0.memory_byte_seconds == 100 * 60  # 20 s of the old + 40 s of the new, not more
    assert w0.observed_seconds == 60.0
    assert w0.peak_memory_bytes == 100
    assert one(records, 60_000).memory_byte_seconds == 100 * 50  # new one capped at 110 s


def test_emitted_until_suppresses_old_windows() -> None:
    c = Collector()
    events = [c.appeared(0), c.sample(0, row(1, 100)), c.sample(100_000, row(1, 100))]
    full, _ = run(events)
    agg = Aggregator(S, emitted_until_ms=60_000)
    assert agg.emitted_until_ms == 60_000
    part, agg = run(events, agg=agg)
    assert part == [r for r in full if r.window_end_ms > 60_000]
    assert windows(part) == [60_000, 120_000, 180_000]
    assert agg.emitted_until_ms == 240_000


def test_flush_closes_everything() -> None:
    c = Collector()
    records, agg = run([c.appeared(0), c.sample(0, row(1, 100)), c.sample(100_000, row(1, 50))])
    assert windows(records) == [0, 60_000, 120_000, 180_000]
    assert one(records, 180_000).memory_byte_seconds == 50 * 10  # capped at 190 s
    assert agg.emitted_until_ms == 240_000  # ceil(190 s) to the window
    assert usage(agg.flush()) == []
    # nothing open, but the identity (offset 0) is kept 2 x max_gap after the last event
    assert agg.needed_offsets() == {0: 0}


def test_needed_offsets_exact() -> None:
    c = Collector()
    agg = Aggregator(S)
    stream = [
        c.appeared(0),  # 0
        c.sample(1_000, row(1, 100)),  # 1
        c.sample(2_000, row(2, 50)),  # 2
        c.exited(3_000, 2),  # 3
        c.hb(30_000, row(1, 100)),  # 4: restates identity, limits and pid 1
        c.sample(65_000, row(1, 120)),  # 5
        c.sample(71_000, row(1, 130)),  # 6
        c.hb(90_000, row(1, 130)),  # 7
        c.sample(125_000, row(1, 140)),  # 8
        c.sample(131_000, row(1, 150)),  # 9
    ]

    def feed(lo: int, hi: int) -> None:
        for off in range(lo, hi):
            agg.add("n1", stream[off], offset=off)

    assert agg.needed_offsets() == {}
    feed(0, 6)
    assert usage(agg.advance()) == []  # watermark 55 s
    assert agg.needed_offsets() == {0: 0}  # nothing closed: everything is pending
    feed(6, 7)
    assert windows(usage(agg.advance())) == [0]  # watermark 61 s
    # pid 2's exit (3): ends of the last max_gap are kept for late and redelivered events
    assert agg.needed_offsets() == {0: 3}
    agg.add("n2", Collector(inc=9).anomaly(200_000), source=1, offset=41)
    assert agg.needed_offsets() == {0: 3, 1: 41}  # n2's last event: n2 is active
    feed(7, 10)
    assert windows(usage(agg.advance())) == [60_000]  # watermark 121 s
    assert agg.needed_offsets() == {0: 7, 1: 41}  # the 90 s hb; 8 and 9 are pending


def test_restart_from_needed_offsets_gives_the_same_records() -> None:
    c = Collector()
    devices = [dev(0), dev(1)]
    stream: list[Event] = [c.appeared(0, devices=devices)]
    for k in range(1, 40):
        ts = k * 7_000
        rows = (row(1, 100 + k), row(2, 3 * k, device=1))
        stream.append(c.sample(ts, *rows))
        if k % 5 == 0:
            stream.append(c.heartbeat(ts + 1, state(1, *rows, devices=devices)))
        if k == 17:
            stream.append(c.exited(ts + 2, 2))
    stream.append(c.gone(300_000))
    full, _ = run(stream, kinds=("container", "node", "gpu", "idle"))
    for cut in (3, 12, 20, 33, len(stream) - 1):
        first = Aggregator(S)
        for off in range(cut):
            first.add("n1", stream[off], offset=off)
            first.advance()
        start = first.needed_offsets()[0]
        emitted = first.emitted_until_ms
        second = Aggregator(S, emitted_until_ms=emitted)
        out: list[BillingRecord] = []
        for off in range(start, len(stream)):
            second.add("n1", stream[off], offset=off)
            out += second.advance()
        out += second.flush()
        assert out == [r for r in full if r.window_end_ms > emitted], cut


def test_gauges_report_current_values() -> None:
    c = Collector()
    agg = Aggregator(S)
    for e in [
        c.appeared(0, devices=[dev(0), dev(1, limit=2000)]),
        c.sample(0, row(1, 100, monitor=110, sm=20), row(2, 50, monitor=60, sm=5)),
        c.sample(5_000, row(2, 70, monitor=80, sm=6)),
    ]:
        agg.add("n1", e)
    gauges = agg.gauges()
    assert [(g.device_uuid, g.memory_used_bytes, g.memory_limit_bytes) for g in gauges] == [
        ("GPU-0", 170, 1000),
        ("GPU-1", 0, 2000),
    ]
    assert (gauges[0].sm_percent, gauges[0].nvml_memory_bytes) == (26, 190)
    agg.add("n1", c.exited(6_000, 2))
    agg.add("n1", c.sample(80_000, row(1, 10)))
    agg.advance()  # closes [0, 60): the anchor plus pending events give the same answer
    assert [g.memory_used_bytes for g in agg.gauges()] == [10, 0]
    agg.add("n1", c.gone(81_000))
    assert agg.gauges() == []


def test_layout_anomaly_only_counts() -> None:
    c = Collector()
    records, agg = run([c.anomaly(0), c.anomaly(100_000)])
    assert records == []
    assert agg.stats.events == 2


def test_settings_are_validated() -> None:
    with pytest.raises(ValueError):
        WindowSettings(window_ms=0)
    with pytest.raises(ValueError):
        WindowSettings(max_gap_ms=0)


# --- node rows (NodeDeviceSample) ----------------------------------------------------------


def test_node_sample_constant_over_a_whole_window() -> None:
    c = Collector()
    n = nrow(unaccounted=100, used=500, util=40)
    events = [c.node(0, n), c.node(30_000, n), c.node(60_000, n), c.node(90_000, n)]
    records, agg = run(events, flush=False)
    assert windows(records) == [0]  # watermark 80 s
    r = records[0]
    assert (r.window_start_ms, r.window_end_ms) == (0, 60_000)
    assert (r.node, r.pod_uid, r.container, r.device_uuid) == ("n1", "", "", "GPU-0")
    assert r.memory_byte_seconds == 100 * 60  # unaccounted bytes
    assert r.nvml_memory_byte_seconds == 500 * 60  # the whole device
    assert r.sm_percent_seconds == 40 * 60
    assert r.memory_limit_byte_seconds == 0.0
    assert r.sm_limit_percent_seconds == 0.0
    assert r.peak_memory_bytes == 100
    assert r.observed_seconds == 60.0
    assert r.samples == 2  # rows at 0 s and 30 s
    assert r.record_id == make_record_id(0, "n1", "", "", "GPU-0", 0)
    assert r.revision == 0
    five, _ = run(events, WindowSettings(window_ms=300_000), kinds=("node", "gpu", "idle"))
    assert {(x.kind, x.record_id) for x in five} == {
        (k, make_record_id(0, "n1", "", "", "GPU-0", 0, k, window_ms=300_000))
        for k in ("node", "gpu", "idle")
    }
    assert agg.stats.unattributed_rows == 0
    assert agg.gauges() == []  # node rows have no gauges


def test_node_sample_step_inside_a_window() -> None:
    c = Collector()
    events = [
        c.node(0, nrow(unaccounted=100, used=1000, util=10), nrow("GPU-1", used=7)),
        c.node(20_000, nrow(unaccounted=300, used=1200, util=50)),
        c.node(25_000, nrow(unaccounted=999, used=1)),  # replaced at once: in effect for 0 s
        c.node(25_000, nrow(unaccounted=200, used=1200, util=50)),
        c.node(70_000, nrow(unaccounted=200, used=1200, util=50), nrow("GPU-1", used=7)),
    ]
    records, _ = run(events, flush=False)
    assert [(r.window_start_ms, r.device_uuid) for r in records] == [(0, "GPU-0"), (0, "GPU-1")]
    g0 = node_one(records, 0)
    assert g0.memory_byte_seconds == 100 * 20 + 300 * 5 + 200 * 35
    assert g0.nvml_memory_byte_seconds == 1000 * 20 + 1200 * 40
    assert g0.sm_percent_seconds == 10 * 20 + 50 * 40
    assert g0.peak_memory_bytes == 300  # not 999
    assert g0.observed_seconds == 60.0
    assert g0.samples == 4
    g1 = node_one(records, 0, "GPU-1")
    assert (g1.memory_byte_seconds, g1.nvml_memory_byte_seconds) == (0.0, 7 * 60)
    assert (g1.peak_memory_bytes, g1.observed_seconds, g1.samples) == (0, 60.0, 1)


def test_node_gap_beyond_max_gap_is_unobserved_per_device() -> None:
    c = Collector()
    events = [
        c.node(0, nrow(unaccounted=100, used=400), nrow("GPU-1", unaccounted=10)),
        c.node(60_000, nrow("GPU-1", unaccounted=10)),  # GPU-0 not read this interval
        c.node(120_000, nrow(unaccounted=100, used=400), nrow("GPU-1", unaccounted=10)),
    ]
    records, agg = run(events)
    got = [
        (r.window_start_ms, r.device_uuid, r.memory_byte_seconds, r.observed_seconds, r.samples)
        for r in records
    ]
    assert got == [
        (0, "GPU-0", 6000.0, 60.0, 1),
        (0, "GPU-1", 600.0, 60.0, 1),
        (60_000, "GPU-0", 3000.0, 30.0, 0),  # held until 90 s, the cap
        (60_000, "GPU-1", 600.0, 60.0, 1),
        (120_000, "GPU-0", 6000.0, 60.0, 1),
        (120_000, "GPU-1", 600.0, 60.0, 1),
        (180_000, "GPU-0", 3000.0, 30.0, 0),  # 120 s + 90 s cap (flush)
        (180_000, "GPU-1", 300.0, 30.0, 0),
    ]
    assert node_one(records, 60_000).nvml_memory_byte_seconds == 400 * 30
    assert agg.stats.unobserved_ms == 30_000  # GPU-0, 90 s -> 120 s


def test_newer_incarnation_ends_the_older_nodes_keys() -> None:
    old, new = Collector(inc=111), Collector(inc=5)
    events = [
        old.node(0, nrow(unaccounted=100, used=1000)),
        new.node(20_000, nrow(unaccounted=40, used=900)),  # collector restarted
        old.node(30_000, nrow(unaccounted=999, used=999)),  # the old one after the cut: not billed
    ]
    records, agg = run(events)
    assert windows(records) == [0, 60_000]
    w0 = records[0]
    assert w0.memory_byte_seconds == 100 * 20 + 40 * 40
    assert w0.nvml_memory_byte_seconds == 1000 * 20 + 900 * 40
    assert w0.observed_seconds == 60.0
    assert w0.peak_memory_bytes == 100
    assert w0.samples == 2
    w1 = records[1]
    assert w1.memory_byte_seconds == 40 * 50  # new one capped at 110 s
    assert w1.observed_seconds == 50.0
    # The old one still sending after the new one started: two collectors, one node name.
    assert (agg.stats.overlapping_events, agg.stats.node_conflicts) == (1, 1)
    assert agg.stats.unattributed_rows == 0


def test_node_out_of_order_within_lateness_gives_the_same_records() -> None:
    c = Collector()
    events: list[Event] = [
        c.appeared(0),
        c.node(1_000, nrow(unaccounted=100, used=500, util=5)),
        c.sample(2_000, row(1, 70)),
        c.node(5_000, nrow("GPU-1", unaccounted=8)),
        c.node(58_000, nrow(unaccounted=300, used=600, util=9)),
        c.node(61_000, nrow(unaccounted=10, used=700)),
        c.node(66_000, nrow(unaccounted=20, used=700), nrow("GPU-1", unaccounted=9)),
        c.node(90_000, nrow(unaccounted=20, used=700)),
        c.gone(130_000),  # the container's end, not the node's
    ]
    in_order, a = run(events)
    # each event at most 8 s behind the newest one delivered before it
    shuffled = [events[i] for i in (0, 3, 1, 2, 5, 6, 4, 7, 8)]
    reordered, b = run(shuffled)
    assert reordered == in_order
    assert a.stats.late_events == b.stats.late_events == 0
    w0 = node_one(in_order, 0)
    assert w0.memory_byte_seconds == 100 * 57 + 300 * 2
    assert w0.nvml_memory_byte_seconds == 500 * 57 + 600 * 2
    assert w0.sm_percent_seconds == 5 * 57 + 9 * 2
    assert w0.observed_seconds == 59.0
    assert node_one(in_order, 0, "GPU-1").memory_byte_seconds == 8 * 55
    assert node_one(in_order, 120_000).memory_byte_seconds == 20 * 60  # held to 180 s
    assert one([r for r in in_order if r.pod_uid], 0).memory_byte_seconds == 70 * 58


def test_late_node_sample_is_counted_and_takes_effect_from_the_closed_end() -> None:
    c = Collector()
    late = c.node(50_000, nrow("GPU-1", unaccounted=200))
    events = [
        c.node(0, nrow(unaccounted=100)),
        c.node(30_000, nrow(unaccounted=100)),
        c.node(75_000, nrow(unaccounted=100)),  # watermark 65 s: [0, 60) closes
        late,
        c.node(100_000, nrow(unaccounted=100)),
        c.node(130_000, nrow(unaccounted=100)),  # watermark 120 s: [60, 120) closes
    ]
    records, agg = run(events, flush=False)
    assert [(r.window_start_ms, r.device_uuid) for r in records] == [
        (0, "GPU-0"),
        (60_000, "GPU-0"),
        (60_000, "GPU-1"),
    ]
    w1 = node_one(records, 60_000, "GPU-1")
    assert w1.memory_byte_seconds == 200 * 60  # from 60 s on (cap at 140 s)
    assert w1.observed_seconds == 60.0
    assert w1.samples == 0  # the late row is not counted again
    assert agg.stats.late_events == 1
    assert agg.stats.late_ms_dropped == 10_000  # 50 s -> 60 s


def test_node_duplicates_are_dropped_and_counted() -> None:
    c = Collector()
    events = [
        c.node(0, nrow(unaccounted=100)),
        c.node(20_000, nrow(unaccounted=300)),
        c.node(50_000, nrow(unaccounted=5)),
    ]
    clean, _ = run(events)
    dup, agg = run([events[0], events[0], events[1], events[0], events[2], events[1], events[2]])
    assert dup == clean
    assert agg.stats.duplicates == 4
    w0 = node_one(clean, 0)
    assert w0.memory_byte_seconds == 100 * 20 + 300 * 30 + 5 * 10
    assert w0.samples == 3


def test_node_rows_coexist_with_container_records() -> None:
    c = Collector()
    events: list[Event] = [
        c.appeared(0),
        c.sample(0, row(1, 100, monitor=120, sm=30)),
        c.node(0, nrow(unaccounted=50, used=400, util=60)),
        c.sample(20_000, row(1, 300, monitor=320, sm=30)),
        c.node(30_000, nrow(unaccounted=50, used=600, util=60)),
        c.gone(50_000),  # ends the container, not the node's keys
        c.node(55_000, nrow()),
    ]
    records, _ = run(events)
    alone, _ = run([e for e in events if not isinstance(e, NodeDeviceSample)])
    assert [r for r in records if r.pod_uid] == alone  # container records unchanged
    assert one(alone, 0).memory_byte_seconds == 100 * 20 + 300 * 30
    assert [(r.window_start_ms, r.pod_uid) for r in records] == [
        (0, ""),  # the node's row sorts first
        (0, "pod-a"),
        (60_000, ""),
        (120_000, ""),
    ]
    n0 = node_one(records, 0)
    assert n0.memory_byte_seconds == 50 * 55
    assert n0.nvml_memory_byte_seconds == 400 * 30 + 600 * 25
    assert n0.sm_percent_seconds == 60 * 55
    assert (n0.peak_memory_bytes, n0.observed_seconds, n0.samples) == (50, 60.0, 3)
    n1 = node_one(records, 60_000)  # zeros, but observed: a record
    assert (n1.memory_byte_seconds, n1.nvml_memory_byte_seconds, n1.observed_seconds) == (
        0.0,
        0.0,
        60.0,
    )
    assert node_one(records, 120_000).observed_seconds == 25.0  # 55 s + 90 s cap


def test_node_needed_offsets_exact_and_restart() -> None:
    c = Collector()
    stream: list[Event] = [
        c.node(1_000, nrow(unaccounted=1), nrow("GPU-1", unaccounted=2)),  # 0
        c.node(31_000, nrow(unaccounted=1)),  # 1
        c.node(61_000, nrow(unaccounted=1)),  # 2
        c.node(75_000, nrow(unaccounted=3)),  # 3
        c.node(125_000, nrow(unaccounted=1)),  # 4
        c.node(131_000, nrow(unaccounted=1)),  # 5
    ]
    full, _ = run(stream)
    agg = Aggregator(S)
    for off in range(4):
        agg.add("n1", stream[off], offset=off)
    first = usage(agg.advance())  # watermark 65 s
    assert [(r.window_start_ms, r.device_uuid) for r in first] == [(0, "GPU-0"), (0, "GPU-1")]
    assert agg.needed_offsets() == {0: 0}  # GPU-1 (sampled at offset 0) is live until 91 s
    agg.add("n1", stream[4], offset=4)
    agg.add("n1", stream[5], offset=5)
    assert windows(usage(agg.advance())) == [60_000, 60_000]  # watermark 121 s
    assert node_one(full, 60_000, "GPU-1").memory_byte_seconds == 2 * 31
    assert agg.needed_offsets() == {0: 3}  # GPU-0's 75 s sample; GPU-1 expired at 91 s
    second = Aggregator(S, emitted_until_ms=120_000)
    out, _ = run(stream[3:], agg=second)
    assert out == [r for r in full if r.window_end_ms > 120_000]
    assert node_one(out, 120_000).memory_byte_seconds == 3 * 5 + 1 * 55


# --- properties --------------------------------------------------------------------------

GAP = S.max_gap_ms


@st.composite
def scenarios(draw: st.DrawFn) -> list[Event]:
    """In-order events of one node: 1-3 containers, 1-2 devices, pids 1-3, samples, exits,
    heartbeats (restating a random subset), limit changes, gone, node samples (a random subset
    of GPU-0 and GPU-1), and collector restarts (a new incarnation re-announces every container);
    steps sometimes beyond max_gap."""
    c = Collector(inc=1)
    ncont = draw(st.integers(1, 3))
    ndev = {cid: draw(st.integers(1, 2)) for cid in range(1, ncont + 1)}
    ts = draw(st.integers(0, 120_000))

    def devices(cid: int) -> list[DeviceLimit]:
        return [
            dev(d, draw(st.integers(0, 5000)), draw(st.integers(0, 100))) for d in range(ndev[cid])
        ]

    def appear_all() -> list[Event]:
        return [c.appeared(ts, cid, pod=f"pod-{cid}", devices=devices(cid)) for cid in ndev]

    def rows(cid: int) -> list[UsageRow]:
        keys = draw(
            st.lists(
                st.tuples(st.integers(1, 3), st.integers(0, ndev[cid] - 1)),
                unique=True,
                max_size=4,
            )
        )
        return [
            row(
                p,
                draw(st.integers(0, 10**6)),
                d,
                draw(st.integers(0, 10**6)),
                draw(st.integers(0, 100)),
            )
            for p, d in keys
        ]

    def node_rows() -> list[DeviceUsageRow]:
        uuids = draw(st.lists(st.sampled_from(["GPU-0", "GPU-1"]), min_size=1, unique=True))
        return [
            nrow(
                u,
                draw(st.integers(0, 10**6)),
                draw(st.integers(0, 10**6)),
                draw(st.integers(0, 100)),
            )
            for u in uuids
        ]

    events = appear_all()
    kinds = ["sample"] * 6 + ["exit", "exit", "hb", "hb", "gone", "limits", "restart"]
    kinds += ["node"] * 3
    for _ in range(draw(st.integers(1, 30))):
        ts += draw(st.one_of(st.integers(0, 25_000), st.integers(80_000, 200_000)))
        cid = draw(st.integers(1, ncont))
        kind = draw(st.sampled_from(kinds))
        if kind == "sample":
            events.append(c.sample(ts, *rows(cid), cid=cid))
        elif kind == "exit":
            events.append(c.exited(ts, draw(st.integers(1, 3)), cid=cid))
        elif kind == "gone":
            events.append(c.gone(ts, cid=cid))
        elif kind == "limits":
            events.append(c.limits(ts, devices(cid), cid=cid))
        elif kind == "node":
            events.append(c.node(ts, *node_rows()))
        elif kind == "restart":
            ts += 1  # the new incarnation starts strictly after the old one's last event
            c = Collector(inc=c.inc + 1)
            events += appear_all()
        else:
            states = [
                state(k, *rows(k), pod=f"pod-{k}", devices=devices(k))
                for k in range(1, ncont + 1)
                if draw(st.booleans())
            ]
            events.append(c.heartbeat(ts, *states))
    return events


NODE = -1  # the reference's cid for node keys; the device is the uuid's number


def reference_integrals(events: list[Event]) -> tuple[int, int, int]:
    """(Σ total dt, Σ monitor dt, Σ node key live time) in milli-units over every key: a step
    function per key, capped at max_gap, no windows. Container rows count only while their
    container is named (appeared/heartbeat, until gone, until 2 x max_gap without any event, or
    until a newer incarnation's first event). A node sample's row is the key (inc, NODE, 0, 0,
    device) with total = unaccounted bytes and monitor = NVML memory used; only a newer
    incarnation ends it."""
    Key = tuple[int, int, int, int, int]  # (inc, cid, pid, hostpid, device)
    live: dict[Key, tuple[int, int, int]] = {}  # key -> (total, monitor, sample ts)
    named: dict[tuple[int, int], int] = {}  # (inc, cid) -> ts of its last event, while named
    incs: set[int] = set()
    acc = [0, 0, 0]

    def end(key: Key, t: int) -> None:
        total, monitor, s = live.pop(key)
        dt = min(t, s + GAP) - s
        acc[0] += total * dt
        acc[1] += monitor * dt
        if key[1] == NODE:
            acc[2] += dt

    def end_all(t: int, keys: list[Key]) -> None:
        for key in keys:
            end(key, t)

    def touch(inc: int, cid: int, t: int, names: bool = False) -> None:
        c = (inc, cid)
        if c in named and t >= named[c] + 2 * GAP:
            del named[c]
        if names or c in named:
            named[c] = t

    def put(key: Key, total: int, monitor: int, t: int) -> None:
        if key in live:
            end(key, t)
        live[key] = (total, monitor, t)

    def put_rows(inc: int, cid: int, rows: list[UsageRow], t: int) -> None:
        if (inc, cid) in named:
            for r in rows:
                put((inc, cid, r.pid, r.hostpid, r.device), r.total, r.monitor, t)

    for e in events:
        inc, t = e.inc, e.ts
        if inc not in incs:  # a restart: the older incarnations are over
            incs.add(inc)
            end_all(t, [k for k in live if k[0] != inc])
            named = {c: last for c, last in named.items() if c[0] == inc}
        if isinstance(e, ContainerAppeared):
            touch(inc, e.cid, t, names=True)
        elif isinstance(e, UsageSample):
            touch(inc, e.cid, t)
            put_rows(inc, e.cid, e.rows, t)
        elif isinstance(e, ProcessExited):
            touch(inc, e.cid, t)
            proc = (inc, e.cid, e.pid, e.hostpid)
            end_all(t, [k for k in live if k[:4] == proc])
        elif isinstance(e, LimitsChanged):
            touch(inc, e.cid, t)
        elif isinstance(e, ContainerGone):
            named.pop((inc, e.cid), None)
            ctr = (inc, e.cid)
            end_all(t, [k for k in live if k[:2] == ctr])
        elif isinstance(e, Heartbeat):
            for s in e.containers:
                touch(inc, s.cid, t, names=True)
                ctr = (inc, s.cid)
                stated = {(*ctr, r.pid, r.hostpid, r.device) for r in s.rows}
                end_all(t, [k for k in live if k[:2] == ctr and k not in stated])
                put_rows(inc, s.cid, s.rows, t)
        elif isinstance(e, NodeDeviceSample):
            for n in e.rows:
                device = int(n.uuid.removeprefix("GPU-"))
                put((inc, NODE, 0, 0, device), n.unaccounted_bytes, n.memory_used, t)
    end_all(1 << 62, list(live))
    return acc[0], acc[1], acc[2]


def feed_all(events: Sequence[Event], advance_at: set[int] | None = None) -> list[BillingRecord]:
    agg = Aggregator(S)
    out: list[BillingRecord] = []
    for i, e in enumerate(events):
        agg.add("n1", e, offset=i)
        if advance_at is None or i in advance_at:
            out += usage(agg.advance())
    out += usage(agg.flush())
    # A duplicate redelivered long after its incarnation was forgotten counts as late instead.
    assert advance_at is not None or agg.stats.late_events == 0
    return sorted(out, key=lambda r: (r.window_start_ms, r.pod_uid, r.device_uuid))


def split_samples(events: list[Event], rng: random.Random) -> list[Event]:
    """Split some multi-row (usage or node) samples into two events at the same ts; renumber
    seqs."""
    out: list[Event] = []
    for e in events:
        if isinstance(e, UsageSample | NodeDeviceSample) and len(e.rows) > 1 and rng.random() < 0.5:
            k = rng.randrange(1, len(e.rows))
            out += [
                msgspec.structs.replace(e, rows=e.rows[:k]),
                msgspec.structs.replace(e, rows=e.rows[k:]),
            ]
        else:
            out.append(e)
    return [msgspec.structs.replace(e, seq=i) for i, e in enumerate(out)]


def jitter(events: list[Event], rng: random.Random) -> list[Event]:
    """Reorder so that no event arrives `lateness` or more behind one delivered before it."""
    keyed = [(e.ts + rng.randrange(S.lateness_ms), i, e) for i, e in enumerate(events)]
    return [e for _, _, e in sorted(keyed, key=lambda x: (x[0], x[1]))]


def duplicate(events: list[Event], rng: random.Random) -> list[Event]:
    out = list(events)
    for _ in range(rng.randrange(0, 6)):
        e = rng.choice(events)
        out.insert(rng.randrange(out.index(e), len(out) + 1), e)
    return out


PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(scenarios(), st.randoms(use_true_random=False))
def test_reordering_splitting_and_duplicates_never_change_the_records(
    events: list[Event], rng: random.Random
) -> None:
    expected = feed_all(events)
    variant = duplicate(jitter(split_samples(events, rng), rng), rng)
    cadence = {i for i in range(len(variant)) if rng.random() < 0.3}
    assert feed_all(variant, cadence) == expected


@PROPERTY
@given(scenarios())
def test_totals_match_the_reference_integrals(events: list[Event]) -> None:
    records = feed_all(events)
    memory, nvml, node_observed = reference_integrals(events)
    assert sum(round(r.memory_byte_seconds * 1000) for r in records) == memory
    assert sum(round(r.nvml_memory_byte_seconds * 1000) for r in records) == nvml
    node = [r for r in records if r.pod_uid == ""]
    assert sum(round(r.observed_seconds * 1000) for r in node) == node_observed


@PROPERTY
@given(scenarios(), st.data())
def test_restart_anywhere_gives_the_same_records(events: list[Event], data: st.DataObject) -> None:
    full = feed_all(events)
    cut = data.draw(st.integers(0, len(events)))
    first = Aggregator(S)
    for off in range(cut):
        first.add("n1", events[off], offset=off)
        first.advance()
    start = first.needed_offsets().get(0, 0)
    emitted = first.emitted_until_ms
    second = Aggregator(S, emitted_until_ms=emitted)
    out: list[BillingRecord] = []
    for off in range(start, len(events)):
        second.add("n1", events[off], offset=off)
        out += usage(second.advance())
    out += usage(second.flush())
    out.sort(key=lambda r: (r.window_start_ms, r.pod_uid, r.device_uuid))
    assert out == [r for r in full if r.window_end_ms > emitted]


@PROPERTY
@given(scenarios(), st.randoms(use_true_random=False))
def test_any_arrival_order_is_safe(events: list[Event], rng: random.Random) -> None:
    """Arbitrary reordering (late events included): no error, each window x row emitted once,
    no negative value, and late events are counted."""
    shuffled = duplicate(list(events), rng)
    rng.shuffle(shuffled)
    agg = Aggregator(S)
    out: list[BillingRecord] = []
    for i, e in enumerate(shuffled):
        agg.add("n1", e, offset=i)
        if rng.random() < 0.5:
            batch = usage(agg.advance())
            assert batch == sorted(batch, key=lambda r: (r.window_start_ms, r.pod_uid))
            out += batch
        if rng.random() < 0.1:
            assert all(g.memory_used_bytes >= 0 for g in agg.gauges())
    out += usage(agg.flush())
    ids = [r.record_id for r in out]
    assert len(ids) == len(set(ids))
    for r in out:
        values = (r.memory_byte_seconds, r.memory_limit_byte_seconds, r.sm_percent_seconds)
        assert min(values) >= 0 and r.peak_memory_bytes >= 0 and r.observed_seconds >= 0
    # (a redelivery after its incarnation was forgotten is counted as late, not as a duplicate)
    assert agg.stats.duplicates <= len(shuffled) - len(events)


def test_two_collectors_under_one_node_name_bill_only_the_newest() -> None:
    old, new = Collector(inc=111), Collector(inc=5)
    events: list[Event] = [
        old.appeared(0),
        old.sample(1_000, row(1, 100)),
        # The older collector's sample at 12 s arrives before the newer one's first event (10 s):
        # it lies after the newer one's start, so it is taken off the older one's timeline.
        old.sample(12_000, row(1, 700)),
        new.appeared(10_000),
        new.sample(10_000, row(1, 100)),
        old.sample(20_000, row(1, 900)),  # still sending: not billed
        new.sample(30_000, row(1, 100)),
        new.gone(50_000),
    ]
    records, agg = run(events)
    (w0,) = [r for r in records if r.window_start_ms == 0]
    assert w0.memory_byte_seconds == 100 * 9 + 100 * 40  # old from 1 s, the new one from 10 s
    assert (agg.stats.node_conflicts, agg.stats.overlapping_events) == (1, 2)
    (conflict,) = agg.conflicts()
    assert (conflict.node, conflict.older, conflict.newer, conflict.since_ms) == (
        "n1",
        111,
        5,
        10_000,
    )
    assert "billing only the newest, 5" in conflict.line()
    assert agg.conflicts() == []  # each pair once


@pytest.mark.parametrize("before", [True, False], ids=["before-the-newer", "after-the-newer"])
def test_an_overlapping_heartbeat_of_three_containers_is_one_event(before: bool) -> None:
    """Whether it arrives before or after the newer collector's first event, the older one's
    heartbeat at 12 s is one event left out, not one per container it states."""
    old, new = Collector(inc=111), Collector(inc=5)
    pods = [(1, "pod-a"), (2, "pod-b"), (3, "pod-c")]
    events: list[Event] = [old.appeared(0, cid=c, pod=p) for c, p in pods]
    events.append(old.heartbeat(1_000, *(state(c, row(c, 100), pod=p) for c, p in pods)))
    hb = old.heartbeat(12_000, *(state(c, row(c, 700), pod=p) for c, p in pods))
    first = [new.appeared(10_000, cid=9, pod="pod-z"), new.sample(10_000, row(1, 5), cid=9)]
    events += [hb, *first] if before else [*first, hb]
    events += [new.sample(30_000, row(1, 5), cid=9), new.gone(50_000, cid=9)]
    records, agg = run(events)
    assert (agg.stats.overlapping_events, agg.stats.node_conflicts) == (1, 1)
    assert sum(r.memory_byte_seconds for r in records) == 3 * 100 * 9 + 5 * 40


def test_two_collectors_starting_in_the_same_millisecond_bill_one() -> None:
    """Neither first event is later: the larger inc is taken for the newer, and the pair is
    flagged (both were billed in full, unflagged)."""
    a, b = Collector(inc=111), Collector(inc=222)
    events: list[Event] = []
    for t in range(0, 300_000, 30_000):
        events.append(a.heartbeat(t, state(1, row(1, 100), pod="pod-a")))
        events.append(b.heartbeat(t, state(1, row(1, 900), pod="pod-b")))
    records, agg = run(events)
    assert {r.pod_uid for r in records if r.memory_byte_seconds} == {"pod-b"}
    assert agg.stats.node_conflicts == 1


def test_a_forgotten_older_collector_redelivered_never_takes_the_node_over() -> None:
    """A overlaps B for one heartbeat (110 s, after B's start at 100 s), stops, and is
    forgotten; that heartbeat is redelivered at 610 s (a spool sent again). B, still running,
    stays billed to the end; A's event is left out as overlap."""
    a, b = Collector(inc=111), Collector(inc=222)
    events: list[Event] = [
        a.heartbeat(t, state(1, row(1, 100), pod="pod-a")) for t in range(0, 100_000, 30_000)
    ]
    events.append(b.heartbeat(100_000, state(1, row(1, 900), pod="pod-b")))
    overlap = a.heartbeat(110_000, state(1, row(1, 100), pod="pod-a"))
    events.append(overlap)
    reference = list(events)
    for t in range(130_000, 1_200_000, 30_000):
        events.append(b.heartbeat(t, state(1, row(1, 900), pod="pod-b")))
        reference.append(events[-1])
        if t == 610_000:
            events.append(overlap)
    want, _ = run(reference)
    got, agg = run(events)
    assert got == want
    assert (agg.stats.overlapping_events, agg.stats.node_conflicts) == (2, 1)
