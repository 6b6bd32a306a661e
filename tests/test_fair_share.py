"""Fair shares of the physical GPU (`collector.aggregate.windows.allocate`): per GPU and window,
the containers' allocated time plus the idle time is the GPU's observed time, to the
millisecond, under every policy; the HAMi #3073 case by hand; overcommit; the inventory."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from decimal import Decimal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collector.aggregate.records import BillingRecord
from collector.aggregate.windows import Aggregator, WindowSettings
from collector.aggregate.windows.allocate import POLICIES, Policy, fit, observed_ms
from collector.events import (
    MAX_BYTES,
    ContainerAppeared,
    ContainerGone,
    ContainerRun,
    ContainerState,
    DeviceInventory,
    DeviceLimit,
    DeviceUsageRow,
    Event,
    GpuInfo,
    Heartbeat,
    LimitsChanged,
    NodeDeviceSample,
    UsageRow,
    UsageSample,
)

GiB = 1 << 30
HOUR = 3_600_000


def ms(seconds: Decimal) -> int:
    """Record seconds are exactly n / 1000 for an integer n."""
    n = int(seconds * 1000)
    assert n == seconds * 1000
    return n


class Node:
    """One collector incarnation's events, with consecutive sequence numbers."""

    def __init__(self, inc: int = 1) -> None:
        self.inc = inc
        self.seq = 0

    def _n(self) -> int:
        self.seq += 1
        return self.seq - 1

    def appeared(self, ts: int, cid: int, devices: Sequence[DeviceLimit]) -> ContainerAppeared:
        pod = f"pod-{cid}"
        return ContainerAppeared(
            1, self.inc, self._n(), ts, cid, pod, "main", f"/c/{pod}", "v1.2", list(devices)
        )

    def sample(self, ts: int, cid: int, *rows: UsageRow) -> UsageSample:
        return UsageSample(1, self.inc, self._n(), ts, cid, list(rows))

    def limits(self, ts: int, cid: int, devices: Sequence[DeviceLimit]) -> LimitsChanged:
        return LimitsChanged(1, self.inc, self._n(), ts, cid, list(devices))

    def gone(self, ts: int, cid: int) -> ContainerGone:
        return ContainerGone(1, self.inc, self._n(), ts, cid)

    def heartbeat(self, ts: int, states: Sequence[ContainerState]) -> Heartbeat:
        return Heartbeat(1, self.inc, self._n(), ts, 30_000, 0, 1, list(states))

    def inventory(self, ts: int, gpus: Sequence[tuple[str, int]]) -> DeviceInventory:
        devices = [
            GpuInfo(i, u, "NVIDIA H100 80GB HBM3", m, False) for i, (u, m) in enumerate(gpus)
        ]
        return DeviceInventory(1, self.inc, self._n(), ts, devices)

    def node(self, ts: int, *uuids: str) -> NodeDeviceSample:
        rows = [DeviceUsageRow(u, GiB, 10, 0) for u in uuids]
        return NodeDeviceSample(1, self.inc, self._n(), ts, rows)


def run(events: Iterable[Event], policy: Policy = "max") -> tuple[list[BillingRecord], Aggregator]:
    agg = Aggregator(WindowSettings(allocation_policy=policy))
    out: list[BillingRecord] = []
    for i, e in enumerate(events):
        agg.add("n1", e, offset=i)
        out += agg.advance()
    out += agg.flush()
    return out, agg


def hour_of(
    n: Node,
    containers: dict[int, list[DeviceLimit]],
    sm: int = 0,
    inventory: Callable[[int], list[tuple[str, int]]] | None = None,
) -> list[Event]:
    """Each container appears at 0 and is restated every 30 s for an hour, then goes; with
    `inventory`, the GPUs it gives for each 30 s step are stated first."""
    events: list[Event] = []
    for t in range(0, HOUR, 30_000):
        gpus = inventory(t) if inventory is not None else []
        if gpus:
            events.append(n.inventory(t, gpus))
        rows = {cid: [UsageRow(1, 2, 0, GiB, 0, 0, GiB, 0, sm)] for cid in containers}
        if t:
            states = [
                ContainerState(cid, f"pod-{cid}", "main", "v1.2", devs, rows[cid])
                for cid, devs in containers.items()
            ]
            events.append(n.heartbeat(t, states))
        else:
            events += [n.appeared(0, cid, devs) for cid, devs in containers.items()]
            events += [n.sample(0, cid, *rows[cid]) for cid in containers]
    events += [n.gone(HOUR, cid) for cid in containers]
    return events


def totals(records: list[BillingRecord]) -> dict[tuple[str, str, str], tuple[int, int]]:
    """(kind, device, pod) -> (allocated ms, observed ms) over every window."""
    out: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0])
    for r in records:
        t = out[(r.kind, r.device_uuid, r.pod_uid)]
        t[0] += ms(r.allocated_gpu_seconds)
        t[1] += ms(r.observed_seconds)
    return {k: (a, o) for k, (a, o) in out.items()}


# --- the HAMi #3073 case -------------------------------------------------------------------


def case_3073(inventory: Callable[[int], list[tuple[str, int]]] | None = None) -> list[Event]:
    n = Node()
    quarter = 8 * GiB
    containers = {
        **{c: [DeviceLimit(0, "GPU-A", quarter, 25)] for c in (1, 2, 3, 4)},
        5: [DeviceLimit(0, "GPU-B", 80 * GiB, 0)],  # the whole GPU: no SM limit
        **{c: [DeviceLimit(0, "GPU-C", quarter, 25)] for c in (6, 7)},
    }
    return hour_of(n, containers, inventory=inventory)


@pytest.mark.parametrize("policy", ["cores", "max"])
def test_hami_3073_four_quarters_make_one_gpu_hour(policy: Policy) -> None:
    records, agg = run(case_3073(), policy)
    t = totals(records)
    for c in (1, 2, 3, 4):
        assert t[("container", "GPU-A", f"pod-{c}")] == (HOUR // 4, HOUR)
    assert t[("idle", "GPU-A", "")][0] == 0
    assert t[("gpu", "GPU-A", "")] == (HOUR, HOUR)  # allocated = the sum, observed
    assert t[("container", "GPU-B", "pod-5")] == (HOUR, HOUR)
    assert t[("idle", "GPU-B", "")][0] == 0
    for c in (6, 7):
        assert t[("container", "GPU-C", f"pod-{c}")] == (HOUR // 4, HOUR)
    assert t[("idle", "GPU-C", "")][0] == HOUR // 2
    assert t[("gpu", "GPU-C", "")] == (HOUR // 2, HOUR)
    assert not any(r.overcommitted for r in records)
    assert agg.stats.overcommitted == 0
    # no inventory: max falls back to cores, once per GPU and window
    assert agg.stats.allocation_fallbacks == (60 * 3 if policy == "max" else 0)
    assert {r.kind for r in records} == {"container", "gpu", "idle"}


def test_memory_policy_uses_the_inventory() -> None:
    # an 80 GiB GPU, so an 8 GiB limit is a tenth of it; GPU-B and GPU-C are stated once at 0
    # and the statement holds for max_gap only
    every = [("GPU-A", 80 * GiB)]
    events = case_3073(lambda t: every if t else [*every, ("GPU-B", 80 * GiB), ("GPU-C", GiB)])
    for policy, quarter in (("memory", HOUR // 10), ("max", HOUR // 4)):
        records, agg = run(events, policy)  # type: ignore[arg-type]
        t = totals(records)
        assert t[("container", "GPU-A", "pod-1")] == (quarter, HOUR)
        assert t[("idle", "GPU-A", "")][0] == HOUR - 4 * quarter
        a = [r for r in records if r.device_uuid == "GPU-A"]
        assert {(r.gpu_model, r.gpu_memory_bytes) for r in a} == {
            ("NVIDIA H100 80GB HBM3", 80 * GiB)
        }
        b = [r for r in records if r.device_uuid == "GPU-B" and r.window_start_ms >= 180_000]
        assert {(r.gpu_model, r.gpu_memory_bytes) for r in b} == {("", 0)}
        assert agg.stats.allocation_fallbacks == 2 * 58  # GPU-B and C from the third window on


def test_oversubscribed_gpu_is_scaled_down_and_flagged() -> None:
    n = Node()
    events = hour_of(n, {c: [DeviceLimit(0, "GPU-A", GiB, 40)] for c in (1, 2, 3)})  # 120 %
    records, agg = run(events, "cores")
    t = totals(records)
    assert [t[("container", "GPU-A", f"pod-{c}")][0] for c in (1, 2, 3)] == [HOUR // 3] * 3
    assert t[("idle", "GPU-A", "")][0] == 0
    assert all(r.overcommitted for r in records if r.kind != "idle" or r.allocated_gpu_seconds == 0)
    assert agg.stats.overcommitted == 60


def test_usage_policy_bills_measured_sm_time() -> None:
    n = Node()
    events = hour_of(n, {c: [DeviceLimit(0, "GPU-A", GiB, 50)] for c in (1, 2)}, sm=20)
    records, _ = run(events, "usage")
    t = totals(records)
    assert t[("container", "GPU-A", "pod-1")] == (HOUR // 5, HOUR)
    assert t[("idle", "GPU-A", "")][0] == HOUR - 2 * HOUR // 5
    cores, _ = run(events, "cores")
    used = {r.pod_uid: ms(r.used_gpu_seconds) for r in cores if r.kind == "container"}
    assert used["pod-1"] == 0 or sum(used.values())  # used is there whatever the policy
    assert sum(ms(r.used_gpu_seconds) for r in cores if r.pod_uid == "pod-1") == HOUR // 5
    assert sum(ms(r.allocated_gpu_seconds) for r in cores if r.pod_uid == "pod-1") == HOUR // 2


def window_0(records: list[BillingRecord]) -> list[tuple[str, str, int, int, int, int, bool]]:
    """(kind, pod, observed, allocated, used, reserved-idle ms, overcommitted) of [0, 60 s)."""
    return [
        (
            r.kind,
            r.pod_uid,
            ms(r.observed_seconds),
            ms(r.allocated_gpu_seconds),
            ms(r.used_gpu_seconds),
            ms(r.reserved_idle_gpu_seconds),
            r.overcommitted,
        )
        for r in records
        if r.window_start_ms == 0
    ]


def test_usage_policy_flags_uses_scaled_down_to_the_observed_time() -> None:
    # two containers each holding 60 GiB of an 80 GiB GPU for the whole window, SM idle: each
    # used 60 x 60 / 80 = 45 s, 90 s in all of a GPU observed 60 s, so both are scaled to 30 s
    n = Node()
    events: list[Event] = [n.appeared(0, c, [DeviceLimit(0, "GPU-A", 80 * GiB, 0)]) for c in (1, 2)]
    for t in range(0, 60_000, 10_000):
        events.append(n.inventory(t, [("GPU-A", 80 * GiB)]))
        events += [n.sample(t, c, UsageRow(c, c, 0, 60 * GiB, 0, 0, 0, 0, 0)) for c in (1, 2)]
    events += [n.gone(60_000, c) for c in (1, 2)]
    records, agg = run(events, "usage")
    assert window_0(records) == [
        ("gpu", "", 60_000, 60_000, 60_000, 60_000, True),
        ("idle", "", 0, 0, 0, 0, True),
        ("container", "pod-1", 60_000, 30_000, 30_000, 30_000, True),
        ("container", "pod-2", 60_000, 30_000, 30_000, 30_000, True),
    ]
    assert agg.stats.overcommitted == 1


def until_gone(
    n: Node, events: list[Event], policy: Policy
) -> tuple[list[BillingRecord], Aggregator]:
    """`events`, then container 1 gone at 60 s, windowed under `policy`."""
    return run([*events, n.gone(60_000, 1)], policy)


@pytest.mark.parametrize("memory_total", [-1, MAX_BYTES + 1, 1 << 62])
def test_an_inventory_memory_no_device_has_is_refused(memory_total: int) -> None:
    # The GPU is then without inventory: `max` falls back to `cores` (SM limit 50: 30 s), and
    # the used time is the SM time alone (10 % for 60 s: 6 s).
    n = Node()
    events: list[Event] = [
        n.inventory(0, [("GPU-A", memory_total)]),
        n.appeared(0, 1, [DeviceLimit(0, "GPU-A", 8 * GiB, 50)]),
    ]
    events += [
        n.sample(t, 1, UsageRow(1, 1, 0, GiB, 0, 0, 0, 0, 10)) for t in range(0, 60_000, 10_000)
    ]
    records, agg = until_gone(n, events, "max")
    assert window_0(records) == [
        ("gpu", "", 60_000, 30_000, 6_000, 0, False),
        ("idle", "", 0, 30_000, 54_000, 0, False),
        ("container", "pod-1", 60_000, 30_000, 6_000, 0, False),
    ]
    assert {(r.gpu_model, r.gpu_memory_bytes) for r in records} == {("", 0)}
    assert (agg.stats.refused_values, agg.stats.refused_records) == (1, 0)
    assert agg.stats.allocation_fallbacks == 1


def test_one_gpu_listed_twice_by_a_container_is_observed_once() -> None:
    # Two slices of GPU-A (8 GiB, 30 % each), each with a process at 1 GiB and 10 % SM: the
    # slices add up (limit 16 GiB, 60 % = 36 s, SM 20 % = 12 s used), the presence does not.
    n = Node()
    slices = [DeviceLimit(0, "GPU-A", 8 * GiB, 30), DeviceLimit(1, "GPU-A", 8 * GiB, 30)]
    events: list[Event] = [n.inventory(0, [("GPU-A", 80 * GiB)]), n.appeared(0, 1, slices)]
    for t in range(0, 60_000, 10_000):
        rows = [UsageRow(1, 1, d, GiB, 0, 0, 0, 0, 10) for d in (0, 1)]
        events.append(n.sample(t, 1, *rows))
    records, _ = until_gone(n, events, "cores")
    assert window_0(records) == [
        ("gpu", "", 60_000, 36_000, 12_000, 0, False),
        ("idle", "", 0, 24_000, 48_000, 0, False),
        ("container", "pod-1", 60_000, 36_000, 12_000, 0, False),
    ]
    (c,) = [r for r in records if r.kind == "container"]
    assert c.memory_limit_byte_seconds == 16 * GiB * 60
    assert c.memory_byte_seconds == 2 * GiB * 60
    assert c.sm_limit_percent_seconds == 60 * 60


def test_the_peak_of_a_gpu_listed_twice_is_of_the_slices_summed_use() -> None:
    """The record adds the slices' use up: its peak is the largest sum in effect, not the
    largest slice's (1 GiB on each slice all window long peaked at 1 GiB, below the 2 GiB
    average), nor the sum of each slice's own peak."""
    n = Node()
    slices = [DeviceLimit(0, "GPU-A", 8 * GiB, 30), DeviceLimit(1, "GPU-A", 8 * GiB, 30)]
    events: list[Event] = [n.inventory(0, [("GPU-A", 80 * GiB)]), n.appeared(0, 1, slices)]
    for t, (a, b) in [(0, (GiB, 2 * GiB)), (30_000, (3 * GiB, GiB // 2))]:
        rows = [UsageRow(1, 1, d, m, 0, 0, m, 0, 10) for d, m in ((0, a), (1, b))]
        events.append(n.sample(t, 1, *rows))
    events.append(n.sample(50_000, 1, *rows))  # (restated within max_gap)
    records, _ = until_gone(n, events, "cores")
    (c,) = [r for r in records if r.kind == "container"]
    assert c.peak_memory_bytes == 3 * GiB + GiB // 2  # (one slice's peak 3, the two's 5 GiB)
    assert c.memory_byte_seconds == (3 * GiB * 30 + (3 * GiB + GiB // 2) * 30)


def test_the_gauges_add_up_a_gpu_listed_twice_as_its_record_does() -> None:
    n = Node()
    slices = [DeviceLimit(0, "GPU-A", 8 * GiB, 30), DeviceLimit(1, "GPU-A", 24 * GiB, 30)]
    agg = Aggregator(WindowSettings())
    agg.add("n1", n.appeared(0, 1, slices))
    rows = [UsageRow(1, 1, 0, GiB, 0, 0, 0, 0, 10), UsageRow(1, 1, 1, 2 * GiB, 0, 0, 0, 0, 20)]
    agg.add("n1", n.sample(1_000, 1, *rows))
    assert [
        (g.device_uuid, g.memory_used_bytes, g.memory_limit_bytes, g.sm_percent)
        for g in agg.gauges()
    ] == [("GPU-A", 3 * GiB, 32 * GiB, 30)]


def test_fit_and_observed() -> None:
    assert fit([1, 2, 3], 10) == ([1, 2, 3], False)
    assert fit([5, 5, 5], 10) == ([4, 3, 3], True)  # largest remainder, ties to the first
    assert fit([0, 7], 5) == ([0, 5], True)
    assert observed_ms([[0, 10], [5, 20], [30, 40], [40, 41]]) == 31
    assert observed_ms([]) == 0


# --- property: allocated + idle = observed, exactly ------------------------------------------

UUIDS = ("GPU-0", "GPU-1")
SM = st.sampled_from([0, 5, 25, 33, 50, 100, 150])
LIMIT = st.sampled_from([0, GiB, 10 * GiB, 40 * GiB, 80 * GiB, 200 * GiB])


@st.composite
def tables(draw: st.DrawFn) -> list[DeviceLimit]:
    uuids = draw(st.lists(st.sampled_from(UUIDS), min_size=1, max_size=2, unique=True))
    return [DeviceLimit(i, u, draw(LIMIT), draw(SM)) for i, u in enumerate(uuids)]


@st.composite
def schedules(draw: st.DrawFn) -> list[Event]:
    """Containers that appear, sample, change limits and go; heartbeats; a collector restart;
    NVML node samples and inventories, all at random times over a few windows."""
    nodes = [Node(1)]
    if draw(st.booleans()):
        nodes.append(Node(2))
    events: list[Event] = []
    for cid in range(draw(st.integers(1, 6))):
        n = draw(st.sampled_from(nodes))
        t = draw(st.integers(0, 200_000))
        devs = draw(tables())
        events.append(n.appeared(t, cid, devs))
        for _ in range(draw(st.integers(0, 6))):
            t += draw(st.integers(1, 100_000))
            op = draw(st.sampled_from(["sample", "sample", "limits", "heartbeat"]))
            if op == "limits":
                devs = draw(tables())
                events.append(n.limits(t, cid, devs))
            else:
                rows = [UsageRow(1, 2, d.index, draw(LIMIT), 0, 0, 0, 0, draw(SM)) for d in devs]
                if op == "sample":
                    events.append(n.sample(t, cid, *rows))
                else:
                    st_ = ContainerState(cid, f"pod-{cid}", "main", "v1.2", devs, rows)
                    events.append(n.heartbeat(t, [st_]))
        if draw(st.booleans()):
            events.append(n.gone(t + draw(st.integers(1, 50_000)), cid))
    for _ in range(draw(st.integers(0, 4))):
        n = draw(st.sampled_from(nodes))
        t = draw(st.integers(0, 400_000))
        if draw(st.booleans()):
            events.append(
                n.node(t, *draw(st.lists(st.sampled_from(UUIDS), min_size=1, unique=True)))
            )
        else:
            events.append(n.inventory(t, [(u, 80 * GiB) for u in UUIDS]))
    # the restart: the second incarnation's events come after the first one's start
    return sorted(events, key=lambda e: (e.ts, e.inc, e.seq))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedules())
def test_allocated_plus_idle_is_observed_for_every_policy(events: list[Event]) -> None:
    for policy in POLICIES:
        records, _ = run(events, policy)
        groups: dict[tuple[int, str], list[BillingRecord]] = defaultdict(list)
        for r in records:
            groups[(r.window_start_ms, r.device_uuid)].append(r)
        for key, rs in groups.items():
            kinds = [r.kind for r in rs]
            assert kinds.count("gpu") == 1 and kinds.count("idle") == 1, (policy, key, kinds)
            gpu = next(r for r in rs if r.kind == "gpu")
            idle = next(r for r in rs if r.kind == "idle")
            observed = ms(gpu.observed_seconds)
            ctrs = [r for r in rs if r.kind == "container"]
            alloc = sum(ms(r.allocated_gpu_seconds) for r in ctrs)
            used = sum(ms(r.used_gpu_seconds) for r in ctrs)
            assert alloc + ms(idle.allocated_gpu_seconds) == observed, (policy, key)
            assert used + ms(idle.used_gpu_seconds) == observed, (policy, key)
            assert ms(idle.allocated_gpu_seconds) >= 0 and ms(idle.used_gpu_seconds) >= 0
            assert ms(gpu.allocated_gpu_seconds) == alloc
            for r in ctrs:
                assert r.overcommitted == gpu.overcommitted
                if policy != "usage":  # a share is at most the whole GPU while present
                    assert ms(r.allocated_gpu_seconds) <= ms(r.observed_seconds)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_replay_from_the_middle_gives_the_same_allocation(policy: Policy) -> None:
    """What `replay` reads (everything from `from - max_gap - lateness - 60 s` on) gives the
    live run's allocation records for the windows from `from` on (byte-identical CSV is
    checked through the commands in test_replay.py)."""
    every = [("GPU-A", 80 * GiB), ("GPU-B", 80 * GiB), ("GPU-C", 40 * GiB)]
    events = case_3073(lambda t: every)
    live, _ = run(events, policy)
    s = WindowSettings()
    for start in (600_000, 1_830_000):
        seek = start - s.max_gap_ms - s.lateness_ms - 60_000
        again, _ = run([e for e in events if e.ts >= seek], policy)
        assert [r for r in again if r.window_start_ms >= start] == [
            r for r in live if r.window_start_ms >= start
        ]
        assert any(r.kind == "idle" and r.allocated_gpu_seconds for r in live)


def test_of_two_inventories_in_one_millisecond_the_later_stated_is_used() -> None:
    """The window uses the latest statement of a GPU before its end: of two in the same
    millisecond, the one stated later (it used to be the larger memory, 160 GiB, not 80)."""
    agg = Aggregator(WindowSettings(allocation_policy="memory"))
    limit = [DeviceLimit(0, "GPU-0", 40 * GiB, 100)]
    agg.add("n1", ContainerAppeared(1, 7, 0, 0, 1, "pod-a", "main", "/p", "v1.2", limit), offset=0)
    for seq, memory in ((1, 160 * GiB), (2, 80 * GiB)):
        gpu = GpuInfo(0, "GPU-0", "NVIDIA H100", memory, False)
        agg.add("n1", DeviceInventory(1, 7, seq, 1000, [gpu]), offset=seq)
    (rec,) = [r for r in agg.flush() if r.kind == "container" and r.window_start_ms == 0]
    assert rec.gpu_memory_bytes == 80 * GiB
    assert rec.allocated_gpu_seconds == Decimal("30.000")  # 40 of 80 GiB for the minute


def test_a_late_inventory_takes_effect_from_the_closed_end_however_the_input_is_batched() -> None:
    """A statement made at 50 s that comes once [0, 60) may close is late: from the closed end
    on, as a late sample. It reached [0, 60) when `advance` had not run since the window could
    close (a replay advances every 256 records, the live service once a batch): 160 GiB and
    15 s batched against 80 GiB and 30 s advanced after every event (a fuzz: 64 of 300 random
    streams with late inventories differed)."""
    limit = [DeviceLimit(0, "GPU-0", 40 * GiB, 100)]

    def inventory(seq: int, ts: int, memory: int) -> DeviceInventory:
        return DeviceInventory(1, 7, seq, ts, [GpuInfo(0, "GPU-0", "NVIDIA H100", memory, False)])

    events: list[Event] = [
        ContainerAppeared(1, 7, 0, 0, 1, "pod-a", "main", "/p", "v1.2", limit),
        inventory(1, 0, 80 * GiB),
    ]
    for seq, t in enumerate(range(0, 80_001, 10_000), start=2):  # the watermark reaches 70 s
        events.append(UsageSample(1, 7, seq, t, 1, [UsageRow(1, 1, 0, GiB, 0, 0, 0, 0, 10)]))
    events.append(inventory(len(events), 50_000, 160 * GiB))

    def windows(advance_every_event: bool) -> list[tuple[int, int, Decimal]]:
        agg = Aggregator(WindowSettings(allocation_policy="memory"))
        out: list[BillingRecord] = []
        for i, e in enumerate(events):
            agg.add("n1", e, offset=i)
            if advance_every_event:
                out += agg.advance()
        out += agg.advance() + agg.flush()
        assert agg.stats.late_events == 1
        return [
            (r.window_start_ms, r.gpu_memory_bytes, r.allocated_gpu_seconds)
            for r in out
            if r.kind == "container"
        ]

    live = windows(True)
    assert live[:2] == [(0, 80 * GiB, Decimal("30.000")), (60_000, 160 * GiB, Decimal("15.000"))]
    assert windows(False) == live


def test_usage_policy_allocates_only_the_time_kubernetes_says_a_container_runs() -> None:
    """README: a share "at each instant it is present", and with the pod watch present means
    running. Under `usage` the allocation was the used time of the whole window: a finished
    container still holding 40 GiB of an 80 GiB GPU was allocated 30 s and reserved-idle 30 s
    with 0 s observed, and alone on its GPU it made the GPU-window `overcommitted`."""
    limit = [DeviceLimit(0, "GPU-0", 40 * GiB, 50)]
    seq = iter(range(1000))
    events: list[Event] = [
        DeviceInventory(1, 7, next(seq), 0, [GpuInfo(0, "GPU-0", "H100", 80 * GiB, False)]),
        ContainerAppeared(1, 7, next(seq), 0, 1, "pod-a", "main", "/a", "v1.2", limit),
        ContainerAppeared(1, 7, next(seq), 0, 2, "pod-b", "main", "/b", "v1.2", limit),
        ContainerRun(1, 7, next(seq), 0, 2, False, 0, "finished"),
    ]
    for t in range(0, 60_000, 10_000):
        events.append(UsageSample(1, 7, next(seq), t, 1, [UsageRow(1, 1, 0, 0, 0, 0, 0, 0, 10)]))
        events.append(
            UsageSample(1, 7, next(seq), t, 2, [UsageRow(2, 2, 0, 40 * GiB, 0, 0, 0, 0, 0)])
        )
    events += [ContainerGone(1, 7, next(seq), 60_000, 1), ContainerGone(1, 7, next(seq), 60_000, 2)]

    def window_0(evs: list[Event]) -> tuple[dict[str, tuple[str, str, str]], int]:
        records, agg = run(evs, "usage")
        got = {
            r.kind + r.pod_uid: (
                str(r.observed_seconds),
                str(r.allocated_gpu_seconds),
                str(r.reserved_idle_gpu_seconds),
            )
            for r in records
            if r.window_start_ms == 0
        }
        return got, agg.stats.overcommitted

    got, overcommitted = window_0(events)
    assert got["containerpod-b"] == ("0.000", "0.000", "0.000")
    assert got["containerpod-a"] == ("60.000", "6.000", "0.000")  # 10 % SM for 60 s
    assert got["idle"] == ("0.000", "54.000", "0.000")
    assert overcommitted == 0
    alone, overcommitted = window_0([e for e in events if getattr(e, "cid", 2) == 2])
    assert alone["containerpod-b"] == ("0.000", "0.000", "0.000")
    assert alone["gpu"] == ("0.000", "0.000", "0.000")
    assert overcommitted == 0
