"""Reserved but idle (`reserved_idle_gpu_seconds`): the part of a container's allocated GPU time
accrued while its SM utilisation on the device was 0, integrated to the millisecond like the
allocation itself; never more than the allocation, under every policy; the same in a replay."""

from __future__ import annotations

from collections import defaultdict

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from test_fair_share import HOUR, GiB, Node, hour_of, ms, run, schedules

from collector.aggregate.records import (
    BillingRecord,
    csv_row,
    from_json,
    from_msgpack,
    to_json,
    to_msgpack,
)
from collector.aggregate.windows import Aggregator, WindowSettings
from collector.aggregate.windows.allocate import POLICIES, Policy, idle_part
from collector.events import ContainerRun, ContainerState, DeviceLimit, Event, UsageRow


def container(records: list[BillingRecord], pod: str) -> tuple[int, int, int]:
    """(allocated, used, reserved idle) ms of `pod` over every window."""
    rs = [r for r in records if r.pod_uid == pod and r.kind == "container"]
    return (
        sum(ms(r.allocated_gpu_seconds) for r in rs),
        sum(ms(r.used_gpu_seconds) for r in rs),
        sum(ms(r.reserved_idle_gpu_seconds) for r in rs),
    )


def half_gpu_busy_then_idle(inventory: bool) -> list[Event]:
    """Half of an 80 GiB GPU (SM limit 50, 40 GiB) for the window [0, 60 s): one process at
    30 % SM holding 16 GiB for 20 s, then the same process at 0 % for 40 s."""
    n = Node()
    devs = [DeviceLimit(0, "GPU-A", 40 * GiB, 50)]
    events: list[Event] = []
    if inventory:
        events.append(n.inventory(0, [("GPU-A", 80 * GiB)]))
    events += [
        n.appeared(0, 1, devs),
        n.sample(0, 1, UsageRow(1, 2, 0, 16 * GiB, 0, 0, 16 * GiB, 0, 30)),
        n.sample(20_000, 1, UsageRow(1, 2, 0, 16 * GiB, 0, 0, 16 * GiB, 0, 0)),
        n.gone(60_000, 1),
    ]
    return events


@pytest.mark.parametrize("policy", ["cores", "memory", "max"])
def test_slices_of_one_gpu_are_idle_only_while_none_of_them_is_busy(policy: Policy) -> None:
    """Two 30 % slices of GPU-A, one record: its process runs at 50 % SM on slice 0 for 20 s,
    then at 0 %; slice 1 holds a process at 0 % all along. The GPU is busy for 20 s, idle for
    40: slice 1 was counted idle on its own all along (18 s of the 36 s allocated, not 24)."""
    n = Node()
    slices = [DeviceLimit(0, "GPU-A", 8 * GiB, 30), DeviceLimit(1, "GPU-A", 8 * GiB, 30)]
    quiet = UsageRow(2, 3, 1, GiB, 0, 0, GiB, 0, 0)
    events: list[Event] = [
        n.appeared(0, 1, slices),
        n.sample(0, 1, UsageRow(1, 2, 0, GiB, 0, 0, GiB, 0, 50), quiet),
        n.sample(20_000, 1, UsageRow(1, 2, 0, GiB, 0, 0, GiB, 0, 0), quiet),
        n.sample(40_000, 1, UsageRow(1, 2, 0, GiB, 0, 0, GiB, 0, 0), quiet),
        n.gone(60_000, 1),
    ]
    records, _ = run(events, policy)
    alloc, _, idle = container(records, "pod-1")
    assert (alloc, idle) == (36_000, 24_000)  # 60 % x 60 s, 60 % x 40 s


@pytest.mark.parametrize("policy", ["cores", "memory", "max"])
@pytest.mark.parametrize("inventory", [True, False])
def test_half_a_gpu_busy_20_s_idle_40_s(policy: Policy, inventory: bool) -> None:
    records, _ = run(half_gpu_busy_then_idle(inventory), policy)
    alloc, used, idle = container(records, "pod-1")
    assert (alloc, idle) == (30_000, 20_000)  # exactly: 50 % x 60 s, 50 % x 40 s
    assert used == (12_000 if inventory else 6_000)  # max(30 % x 20 s, 16/80 x 60 s)
    gpu = next(r for r in records if r.kind == "gpu")
    assert ms(gpu.reserved_idle_gpu_seconds) == 20_000
    spare = next(r for r in records if r.kind == "idle")
    assert ms(spare.reserved_idle_gpu_seconds) == 0
    assert {r.version for r in records} == {2}


def test_usage_policy_reserved_idle_is_the_memory_share_of_the_idle_time() -> None:
    records, _ = run(half_gpu_busy_then_idle(True), "usage")
    # allocated = used = 12 s; of it, 16 GiB of 80 held for the 40 idle seconds: 8 s
    assert container(records, "pod-1") == (12_000, 12_000, 8_000)
    records, _ = run(half_gpu_busy_then_idle(False), "usage")
    assert container(records, "pod-1") == (6_000, 6_000, 0)  # SM time only: never idle


@pytest.mark.parametrize("policy", ["cores", "memory", "max"])
def test_a_whole_gpu_without_any_process_is_all_reserved_idle(policy: Policy) -> None:
    n = Node()
    events: list[Event] = [
        n.inventory(0, [("GPU-B", 80 * GiB)]),
        n.appeared(0, 5, [DeviceLimit(0, "GPU-B", 80 * GiB, 0)]),
        n.gone(90_000, 5),
    ]
    records, _ = run(events, policy)
    assert container(records, "pod-5") == (90_000, 0, 90_000)
    per_window = [
        (ms(r.allocated_gpu_seconds), ms(r.reserved_idle_gpu_seconds))
        for r in records
        if r.kind == "container"
    ]
    assert per_window == [(60_000, 60_000), (30_000, 30_000)]


def test_busy_all_the_time_is_never_reserved_idle() -> None:
    n = Node()
    records, _ = run(hour_of(n, {1: [DeviceLimit(0, "GPU-A", GiB, 25)]}, sm=1), "cores")
    assert container(records, "pod-1") == (HOUR // 4, HOUR // 100, 0)


def test_overcommitted_reserved_idle_is_scaled_with_the_allocation() -> None:
    # three containers at 40 % of one GPU, no process: each allocated a third, all of it idle
    n = Node()
    events = hour_of(n, {c: [DeviceLimit(0, "GPU-A", GiB, 40)] for c in (1, 2, 3)})
    records, _ = run(events, "cores")
    for c in (1, 2, 3):
        alloc, _, idle = container(records, f"pod-{c}")
        assert alloc == idle == HOUR // 3  # 24 000 x 60 000 / 72 000 ms per window
    # the same fraction of the scaled allocation, rounded down; exact when nothing was scaled
    assert idle_part([20_000, 20_000, 20_000], [24_000, 12_000, 0], [24_000] * 3) == [
        20_000, 10_000, 0
    ]  # fmt: skip
    assert idle_part([3, 4], [1, 4], [9, 4]) == [0, 4]
    assert idle_part([5, 7, 0], [2, 7, 0], [5, 7, 0]) == [2, 7, 0]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedules())
def test_reserved_idle_never_exceeds_allocated(events: list[Event]) -> None:
    for policy in POLICIES:
        records, _ = run(events, policy)
        per: dict[tuple[int, str], int] = defaultdict(int)
        for r in records:
            idle, alloc = ms(r.reserved_idle_gpu_seconds), ms(r.allocated_gpu_seconds)
            assert 0 <= idle <= alloc or r.kind == "idle", (policy, r)
            if r.kind == "container":
                per[(r.window_start_ms, r.device_uuid)] += idle
            elif r.kind in ("node", "idle"):
                assert idle == 0, (policy, r)
        for r in records:
            if r.kind == "gpu":
                assert ms(r.reserved_idle_gpu_seconds) == per[(r.window_start_ms, r.device_uuid)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedules())
def test_without_sm_activity_everything_allocated_is_reserved_idle(events: list[Event]) -> None:
    quiet: list[Event] = []
    for e in events:
        if hasattr(e, "rows") and e.rows and isinstance(e.rows[0], UsageRow):
            e = msgspec.structs.replace(
                e, rows=[msgspec.structs.replace(r, sm_util=0) for r in e.rows]
            )
        if hasattr(e, "containers"):
            e = msgspec.structs.replace(
                e,
                containers=[
                    msgspec.structs.replace(
                        c, rows=[msgspec.structs.replace(r, sm_util=0) for r in c.rows]
                    )
                    for c in e.containers
                ],
            )
        quiet.append(e)
    for policy in ("cores", "memory", "max"):
        records, _ = run(quiet, policy)  # type: ignore[arg-type]
        for r in records:
            if r.kind in ("container", "gpu"):
                assert r.reserved_idle_gpu_seconds == r.allocated_gpu_seconds, (policy, r)


def busy_and_idle_hour() -> list[Event]:
    """Three containers on two GPUs for an hour, restated every 30 s; pod-1 samples SM activity
    in every other 7-minute stretch, between the restatements."""
    n = Node()
    containers = {
        1: [DeviceLimit(0, "GPU-A", 8 * GiB, 25)],
        2: [DeviceLimit(0, "GPU-A", 8 * GiB, 50)],
        3: [DeviceLimit(0, "GPU-B", 80 * GiB, 0)],
    }
    events: list[Event] = [n.inventory(0, [("GPU-A", 80 * GiB), ("GPU-B", 80 * GiB)])]
    events += [n.appeared(0, cid, devs) for cid, devs in containers.items()]
    quiet = {
        1: [UsageRow(1, 2, 0, GiB, 0, 0, GiB, 0, 0)],
        2: [UsageRow(3, 4, 0, 2 * GiB, 0, 0, 2 * GiB, 0, 10)],
        3: [],
    }
    events += [n.sample(0, cid, *rows) for cid, rows in quiet.items() if rows]
    for t in range(15_000, HOUR, 15_000):
        if t % 30_000:  # pod-1 busy or not until the next restatement
            sm = 40 if t // 420_000 % 2 else 0
            events.append(n.sample(t, 1, UsageRow(1, 2, 0, GiB, 0, 0, GiB, 0, sm)))
        else:
            events.append(n.inventory(t, [("GPU-A", 80 * GiB), ("GPU-B", 80 * GiB)]))
            states = [
                ContainerState(cid, f"pod-{cid}", "main", "v1.2", containers[cid], quiet[cid])
                for cid in containers
            ]
            events.append(n.heartbeat(t, states))
    events += [n.gone(HOUR, cid) for cid in containers]
    return events


@pytest.mark.parametrize("policy", POLICIES)
def test_a_replay_from_the_middle_gives_the_same_reserved_idle(policy: Policy) -> None:
    events = busy_and_idle_hour()
    live, _ = run(events, policy)
    alloc, _, idle = container(live, "pod-1")
    if policy != "usage":
        assert 0 < idle < alloc
    s = WindowSettings()
    for start in (600_000, 1_830_000):
        seek = start - s.max_gap_ms - s.lateness_ms - 60_000
        again, _ = run([e for e in events if e.ts >= seek], policy)
        want = [csv_row(r) for r in live if r.window_start_ms >= start]
        assert [csv_row(r) for r in again if r.window_start_ms >= start] == want


def test_the_billing_schema_requires_the_field_from_version_2_on() -> None:
    import json
    from pathlib import Path

    import jsonschema

    schema = json.loads(
        (Path(__file__).resolve().parent.parent / "schemas" / "billing.schema.json").read_text()
    )
    records, _ = run(half_gpu_busy_then_idle(False), "cores")
    v2 = msgspec.json.decode(to_json(records[0]))  # the billing topic's JSON
    jsonschema.validate(v2, schema)
    v1 = {k: v for k, v in v2.items() if k != "reserved_idle_gpu_seconds"}
    jsonschema.validate({**v1, "version": 1}, schema)  # what the topic holds from before
    for bad in (v1, {**v2, "version": 3}, {**v2, "version": 0}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_the_schema_and_every_reader_take_and_refuse_the_same_records() -> None:
    """A record from before versions (no `version`, no field of a later one) is version 1 to
    every reader: the schema refused it (its version-2 clause held when `version` was absent).
    An empty record_id and a number past what the writer can send were valid to the schema
    and decoded by `decode` (only `report` refused them); a window that ends where it starts,
    which no schema can say, was decoded too."""
    import json
    from pathlib import Path

    import jsonschema

    schema = json.loads(
        (Path(__file__).resolve().parent.parent / "schemas" / "billing.schema.json").read_text()
    )
    records, _ = run(half_gpu_busy_then_idle(False), "cores")
    v2 = msgspec.json.decode(to_json(records[0]))
    old = {k: v for k, v in v2.items() if k not in ("version", "reserved_idle_gpu_seconds")}
    jsonschema.validate(old, schema)
    assert from_json(json.dumps(old).encode()).version == 1
    for bad in ({**v2, "record_id": ""}, {**v2, "memory_byte_seconds": 1e20}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    packed = msgspec.msgpack.decode(to_msgpack(records[0]))  # (decimals as strings)
    changes = [
        ({"record_id": ""}, {"record_id": ""}, "record_id is empty"),
        ({"memory_byte_seconds": 1e20}, {"memory_byte_seconds": "1e20"}, "outside"),
        ({"window_end_ms": v2["window_start_ms"]}, {"window_end_ms": v2["window_start_ms"]},
         "window_end is not after window_start"),
    ]  # fmt: skip
    for as_json, as_msgpack, why in changes:
        # `decode`, `report --kafka` and JSON Lines alike
        with pytest.raises(ValueError, match=why):
            from_json(json.dumps({**v2, **as_json}).encode())
        with pytest.raises(ValueError, match=why):
            from_msgpack(msgspec.msgpack.encode({**packed, **as_msgpack}))


def test_reserved_idle_stops_with_the_allocation_when_kubernetes_says_the_run_ended() -> None:
    """Under the pod watch's running gate (ContainerRun) the folder outlives the run: neither
    the allocation nor its idle part goes on after `finishedAt`."""
    n = Node()
    devs = [DeviceLimit(0, "GPU-A", 80 * GiB, 0)]
    row = UsageRow(1, 2, 0, GiB, 0, 0, GiB, 0, 60)
    events: list[Event] = [
        n.appeared(0, 1, devs),
        ContainerRun(1, n.inc, n._n(), 0, 1, True, 0, "started"),
        n.sample(0, 1, row),
        n.sample(10_000, 1, msgspec.structs.replace(row, sm_util=0)),
        ContainerRun(1, n.inc, n._n(), 21_000, 1, False, 20_000, "finished"),
    ]
    for t in (30_000, 60_000, 90_000):  # the folder stays and is restated
        state = ContainerState(1, "pod-1", "main", "v1.2", devs, [])
        events.append(n.heartbeat(t, [state]))
    events.append(n.gone(100_000, 1))
    records, _ = run(events, "cores")
    # present (running) 0..20 s, busy 0..10 s
    alloc, _, idle = container(records, "pod-1")
    assert (alloc, idle) == (20_000, 10_000)


def test_a_running_gate_read_before_its_late_announcement_is_kept_whenever_windows_close() -> None:
    """A `ContainerRun` (not running from 55 s) read in time, before the container's own
    `ContainerAppeared` (42 s), which comes late, after another container's sample let [0, 60 s)
    close: closing that window between the two dropped the unnamed track with its gate, so the
    container was billed from 60 s when windows closed after every event and not at all when
    they closed at the end."""
    n = Node()
    devs = [DeviceLimit(0, "GPU-A", 8 * GiB, 50)]
    appeared = n.appeared(42_000, 1, devs)  # sent before the others, read after them
    events: list[Event] = [
        n.appeared(0, 2, devs),
        ContainerRun(1, n.inc, n._n(), 58_000, 1, False, 55_000, "finished"),
        n.sample(75_000, 2, UsageRow(2, 2, 0, GiB, 0, 0, GiB, 0, 10)),
        appeared,
        n.gone(100_000, 1),
        n.gone(120_000, 2),
    ]
    agg = Aggregator(WindowSettings(allocation_policy="cores"))
    at_end: list[BillingRecord] = []
    for i, e in enumerate(events):
        agg.add("n1", e, offset=i)
    at_end += agg.flush()
    every, _ = run(events, "cores")
    assert sorted(to_json(r) for r in every) == sorted(to_json(r) for r in at_end)
    assert [r.pod_uid for r in every if r.kind == "container"] == ["pod-2", "pod-2"]
    gpu = [r for r in every if r.kind == "gpu" and r.window_start_ms == 60_000]
    assert [ms(r.allocated_gpu_seconds) for r in gpu] == [30_000]  # pod-2's half of 60 s


def test_a_running_gate_read_first_leaves_its_late_announcement_the_presence() -> None:
    """The gate's own time keeps it (`_prune`), not the track's last event: a `ContainerRun`
    (running from 58 s) read before the container's `ContainerAppeared` (42 s), which comes at
    100 s, after [0, 60 s) closed. The late announcement still makes the container present, so
    [60 s, 120 s) bills it whole, as the windows after it do; taking the gate's time for the
    track's last event billed 10 s of it (from its first own sample at 110 s)."""
    n = Node()
    devs = [DeviceLimit(0, "GPU-A", 8 * GiB, 50)]
    appeared = n.appeared(42_000, 1, devs)
    events: list[Event] = [
        n.appeared(0, 2, devs),
        ContainerRun(1, n.inc, n._n(), 58_000, 1, True, 58_000, "started"),
    ]
    for t in range(10_000, 240_000, 10_000):
        if t == 100_000:
            events.append(appeared)
        events.append(n.sample(t, 2, UsageRow(2, 2, 0, GiB, 0, 0, GiB, 0, 10)))
        if t > 100_000:
            events.append(n.sample(t + 1, 1, UsageRow(3, 3, 0, GiB, 0, 0, GiB, 0, 10)))
    events += [n.gone(240_000, 1), n.gone(240_000, 2)]
    every, _ = run(events, "cores")
    pod1 = [r for r in every if r.kind == "container" and r.pod_uid == "pod-1"]
    assert [(r.window_start_ms, ms(r.observed_seconds)) for r in pod1] == [
        (60_000, 60_000),
        (120_000, 60_000),
        (180_000, 60_000),
    ]
