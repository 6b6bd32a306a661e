"""Restarts, redelivered duplicates, reordering and batching beyond the usage rows: the GPU
inventory, a heartbeat's ends, Kubernetes' running gate and pod names give the records of an
uninterrupted run, whenever the aggregator restarts and however many windows one `advance()`
closes (the pattern of `test_windows_restart.py`: feed to a cut, restart from
`needed_offsets()` with `emitted_until_ms`, compare)."""

from __future__ import annotations

from decimal import Decimal

from test_windows import Collector, dev, row, state

from collector.aggregate.records import BillingRecord, record_order
from collector.aggregate.windows import Aggregator, WindowSettings
from collector.events import (
    ContainerRun,
    ContainerState,
    DeviceInventory,
    DeviceLimit,
    Event,
    GpuInfo,
    Heartbeat,
    Identity,
    PodIdentity,
    UsageRow,
)

S = WindowSettings()  # 60 s windows, 10 s lateness, 90 s max gap
GiB = 1 << 30


def feed(
    agg: Aggregator, msgs: list[Event], first: int, last: int | None = None, every: int = 1
) -> list[BillingRecord]:
    """Add msgs[first:last] at their offsets, `advance()` after every `every` of them."""
    out: list[BillingRecord] = []
    for offset in range(first, len(msgs) if last is None else last):
        agg.add("n1", msgs[offset], offset=offset)
        if (offset + 1) % every == 0:
            out += agg.advance()
    return out + agg.advance()


def restarted(
    msgs: list[Event], cut: int, settings: WindowSettings = S
) -> tuple[list[BillingRecord], Aggregator, int]:
    """Records of a run that stops after msgs[:cut] and restarts from `needed_offsets()`."""
    before = Aggregator(settings)
    got = feed(before, msgs, 0, cut)
    resume = before.needed_offsets().get(0, cut)
    after = Aggregator(settings, emitted_until_ms=before.emitted_until_ms)
    got += feed(after, msgs, resume) + after.flush()
    return sorted(got, key=record_order), after, resume


def uninterrupted(
    msgs: list[Event], settings: WindowSettings = S
) -> tuple[list[BillingRecord], Aggregator]:
    """Records of a run that reads msgs without a restart."""
    whole = Aggregator(settings)
    return sorted(feed(whole, msgs, 0) + whole.flush(), key=record_order), whole


def redelivered_after_a_restart(
    msgs: list[Event], expected: list[BillingRecord], whole: Aggregator, cut: int
) -> None:
    """The uninterrupted run dropped one redelivered duplicate; a restart after msgs[:cut]
    re-reads from offset 2, takes it as a late event, and gives the same records, as does a
    restart at any other cut."""
    assert whole.stats.duplicates == 1
    got, after, resume = restarted(msgs, cut)
    assert (resume, after.stats.late_events) == (2, 1)
    assert got == expected
    for other in range(1, len(msgs)):
        assert restarted(msgs, other)[0] == expected, other


def container(records: list[BillingRecord]) -> list[BillingRecord]:
    return [r for r in records if r.kind == "container"]


# --- the GPU inventory --------------------------------------------------------------------


def test_a_restart_keeps_the_gpu_inventory_the_open_windows_use() -> None:
    """One scan a second, a heartbeat every 30 s preceded by the inventory's restatement (as
    the collector orders them). A restart re-reads the latest statement before the closed end,
    so the allocation (`max` of 10 % SMs and 40 of 80 GiB) never falls back to `cores`."""
    settings = WindowSettings(window_ms=10_000, lateness_ms=3_000, max_gap_ms=90_000)
    c = Collector(inc=5)
    devices = [DeviceLimit(0, "GPU-0", 40 * GiB, 10)]
    busy = UsageRow(1, 1001, 0, 8 * GiB, 0, 0, 8 * GiB, 8 * GiB, 0)
    msgs: list[Event] = [c.appeared(0, devices=devices)]
    for t in range(0, 121_000, 30_000):
        msgs.append(DeviceInventory(1, c.inc, c._n(), t,
                                    [GpuInfo(0, "GPU-0", "H100", 80 * GiB, False)]))  # fmt: skip
        msgs.append(c.heartbeat(t, state(1, busy, devices=devices)))
    expected, whole = uninterrupted(msgs, settings)
    assert [(r.window_start_ms, r.gpu_model, r.gpu_memory_bytes, r.allocated_gpu_seconds,
             r.used_gpu_seconds, r.reserved_idle_gpu_seconds)
            for r in container(expected)][:3] == [
        (0, "H100", 80 * GiB, 5, 1, 5),
        (10_000, "H100", 80 * GiB, 5, 1, 5),
        (20_000, "H100", 80 * GiB, 5, 1, 5),
    ]  # fmt: skip
    assert whole.stats.allocation_fallbacks == 0
    # Cut after the restatement at 30 s, windows up to 20 s closed: the one at 0 s (offset 1)
    # still names the model of [20 s, 30 s). Cut after offset 7 (closed 80 s): only the
    # statement at 60 s (offset 5), the latest before the closed end, is needed.
    for cut, resume in ((4, 1), (8, 5)):
        got, after, at = restarted(msgs, cut, settings)
        assert at == resume
        assert got == expected, cut
        assert after.stats.allocation_fallbacks == 0
    for cut in range(1, len(msgs)):
        assert restarted(msgs, cut, settings)[0] == expected, cut


# --- a heartbeat's ends -------------------------------------------------------------------


K1 = row(1, 400)  # process 1: exits unseen, a heartbeat no longer states it
K2 = row(2, 100)  # process 2 lives on


def test_a_redelivered_duplicate_after_a_restart_does_not_revive_what_a_heartbeat_ended() -> None:
    """K1 is sampled at 1 s and no longer stated by the heartbeat at 30 s (ended there). The
    restart re-reads from that heartbeat; the sample redelivered after it is older than the
    heartbeat, so it is not taken (the uninterrupted run drops it as a duplicate)."""
    c = Collector()
    sample_k1 = c.sample(1_000, K1)
    msgs: list[Event] = [
        c.appeared(0),
        sample_k1,
        c.hb(30_000, K2),
        c.hb(62_000, K2),
        c.hb(92_000, K2),  # closes [0, 60 s)
        sample_k1,  # redelivered
        c.hb(122_000, K2),
        c.hb(152_000, K2),
    ]
    expected, whole = uninterrupted(msgs)
    values = [(r.window_start_ms, r.memory_byte_seconds, r.peak_memory_bytes)
              for r in container(expected)]  # fmt: skip
    # [0, 60 s): K1 400 B for [1 s, 30 s) + K2 100 B for [30 s, 60 s); then K2 alone
    assert values == [
        (0, Decimal("14600"), 400),
        (60_000, Decimal("6000"), 100),
        (120_000, Decimal("6000"), 100),
        (180_000, Decimal("6000"), 100),
        (240_000, Decimal("200"), 100),
    ]
    redelivered_after_a_restart(msgs, expected, whole, 5)


def test_a_late_sample_older_than_a_heartbeat_that_no_longer_states_its_key_is_not_taken() -> None:
    """A sample of K1 at 20 s delivered after [0, 60 s) closed: the heartbeat at 30 s did not
    state K1, so it does not hold past 30 s and bills nothing from the closed end on (it is not
    revived there until its cap at 110 s)."""
    c = Collector()
    msgs: list[Event] = [c.appeared(0), c.hb(30_000, K2)]
    late_k1 = c.sample(20_000, K1)
    msgs += [c.hb(62_000, K2), c.hb(92_000, K2), late_k1, c.hb(122_000, K2), c.hb(152_000, K2)]
    agg = Aggregator(S)
    records = feed(agg, msgs, 0) + agg.flush()
    assert agg.stats.late_events == 1
    assert agg.stats.late_ms_dropped == 10_000  # its value would have held [20 s, 30 s)
    assert [(r.window_start_ms, r.memory_byte_seconds, r.peak_memory_bytes)
            for r in container(records)][:2] == [
        (0, Decimal("3000"), 100),
        (60_000, Decimal("6000"), 100),
    ]  # fmt: skip


# --- Kubernetes' running gate -------------------------------------------------------------


def _hb(c: Collector, ts: int, running: bool) -> Heartbeat:
    return c.heartbeat(ts, ContainerState(1, "pod-a", "main", "v1.2", [dev()], [], running))


def test_a_redelivered_old_container_run_after_a_restart_does_not_flip_the_gate() -> None:
    """Not running from 5 s, running again from 40 s. The stop redelivered after a restart that
    re-reads from 30 s is older in the collector's order than the start and the heartbeats that
    restated it: not taken (the uninterrupted run drops it as a duplicate)."""
    c = Collector()
    msgs: list[Event] = [c.appeared(0)]
    stop = ContainerRun(1, c.inc, c._n(), 5_000, 1, False, 5_000, "terminated")
    msgs += [stop, _hb(c, 30_000, False)]
    msgs.append(ContainerRun(1, c.inc, c._n(), 40_000, 1, True, 40_000, "started"))
    msgs += [_hb(c, 62_000, True), _hb(c, 92_000, True)]  # the second closes [0, 60 s)
    msgs.append(stop)  # redelivered
    msgs += [_hb(c, 122_000, True), _hb(c, 152_000, True)]
    expected, whole = uninterrupted(msgs)
    values = [(r.window_start_ms, r.memory_limit_byte_seconds, r.observed_seconds,
               r.allocated_gpu_seconds) for r in container(expected)]  # fmt: skip
    # a 1000 B limit at 50 % SMs: [0, 5 s) and [40 s, 60 s) of the first window, then all
    assert values == [
        (0, Decimal("25000"), Decimal("25"), Decimal("12.5")),
        (60_000, Decimal("60000"), Decimal("60"), Decimal("30")),
        (120_000, Decimal("60000"), Decimal("60"), Decimal("30")),
        (180_000, Decimal("60000"), Decimal("60"), Decimal("30")),
        (240_000, Decimal("2000"), Decimal("2"), Decimal("1")),
    ]
    redelivered_after_a_restart(msgs, expected, whole, 6)


def test_a_container_run_reordered_within_the_lateness_is_placed_whenever_advance_runs() -> None:
    """The stop (sent at 65 s, finished at 50 s: placed at 55 s) arrives after a sample at 72 s
    (7 s later, within the 10 s lateness), which lets [0, 60 s) close. It takes effect at 60 s
    whether `advance()` ran between the two or not, and is not a late event."""
    c = Collector()
    appeared = c.appeared(0)
    stop = ContainerRun(1, c.inc, c._n(), 65_000, 1, False, 50_000, "terminated")
    msgs: list[Event] = [appeared, c.sample(72_000, row(1, 100)), stop,
                         c.sample(130_000, row(1, 100))]  # fmt: skip
    results = []
    for every in (1, 2, 3, 10):
        agg = Aggregator(S)
        out = feed(agg, msgs, 0, every=every) + agg.flush()
        results.append((
            [(r.window_start_ms, r.memory_limit_byte_seconds, r.observed_seconds)
             for r in container(out)],
            agg.stats.late_events, agg.stats.presence_clamped, agg.stats.presence_clamped_ms,
        ))  # fmt: skip
    assert results == [results[0]] * 4
    assert results[0] == (
        [(0, Decimal("60000"), Decimal("60")), (60_000, 0, 0), (120_000, 0, 0),
         (180_000, 0, 0)],
        0, 1, 10_000,
    )  # fmt: skip


def test_a_stopped_container_announced_again_after_a_silence_bills_whenever_advance_runs() -> None:
    """Kubernetes says at 10 s that the container stopped; it is silent (another container of
    the node keeps event time moving) until the collector announces it again at 300 s, past
    its name's retention (250 s after its last event). Its gate goes with its name, so the
    bill after 300 s is the same whether `advance()` closed windows in the silence (the track
    dropped) or not (it used to be billed only in the first case: 90 s of limits)."""
    c = Collector()
    msgs: list[Event] = [c.appeared(0), c.appeared(0, cid=2, pod="pod-b")]
    msgs.append(ContainerRun(1, c.inc, c._n(), 10_000, 1, False, 10_000, "Completed"))
    for t in range(10_000, 400_001, 10_000):
        msgs.append(c.sample(t, row(1, 100), cid=2))
        if t == 300_000:
            msgs.append(c.appeared(t))
    bills = []
    for every in (1, 7, len(msgs)):
        agg = Aggregator(S)
        out = feed(agg, msgs, 0, every=every) + agg.flush()
        bills.append([(r.window_start_ms // 1000, r.memory_limit_byte_seconds, r.observed_seconds)
                      for r in container(out) if r.pod_uid == "pod-a"])  # fmt: skip
    assert bills == [bills[0]] * 3
    assert bills[0] == [(0, Decimal("10000"), Decimal("10")),
                        (300, Decimal("60000"), Decimal("60")),
                        (360, Decimal("30000"), Decimal("30"))]  # fmt: skip


# --- pod names ----------------------------------------------------------------------------


def test_names_do_not_depend_on_how_many_windows_one_advance_closes() -> None:
    """The pod is named once (at 0 s) and never restated; its container is sampled every
    10 s. A window that starts `retain_ms` (2 x 90 s + 10 s + 60 s = 250 s) or more after the
    identity is not named by it, whether `advance()` runs after each event or once."""
    c = Collector()
    who = Identity("pod-a", "ml", "trainer-x", "Deployment", "trainer", {})
    msgs: list[Event] = [c.appeared(0), PodIdentity(1, c.inc, c._n(), 0, who)]
    msgs += [c.sample(t, row(1, 100)) for t in range(0, 500_000, 10_000)]
    named = []
    for every in (1, 20, len(msgs)):
        agg = Aggregator(S)
        out = feed(agg, msgs, 0, every=every) + agg.flush()
        named.append(([(r.window_start_ms // 1000, r.namespace) for r in container(out)],
                      agg.stats.unnamed_records))  # fmt: skip
    assert named == [named[0]] * 3
    assert named[0] == (
        [(0, "ml"), (60, "ml"), (120, "ml"), (180, "ml"), (240, "ml"),
         (300, ""), (360, ""), (420, ""), (480, ""), (540, "")],
        5,
    )  # fmt: skip


def test_the_longest_window_holds_a_record_of_a_2_tib_device_used_all_along() -> None:
    """`window` is at most an hour: a record's integrals hold 2**63 - 1 byte-ms, an hour of
    2 TiB is 7.9e18 of them. A day of a busy 141 GB GPU (1.2e19) was a refused record."""
    tib2 = 1 << 41
    c = Collector()
    msgs: list[Event] = [c.appeared(0, devices=[dev(limit=tib2)])]
    msgs += [c.sample(t, row(1, tib2)) for t in range(0, 3_630_000, 30_000)]
    agg = Aggregator(WindowSettings(window_ms=3_600_000))
    out = container(feed(agg, msgs, 0) + agg.flush())
    assert agg.stats.refused_records == 0
    first = out[0]
    assert (first.window_start_ms, first.window_end_ms) == (0, 3_600_000)
    assert first.memory_byte_seconds == first.memory_limit_byte_seconds == tib2 * 3600
