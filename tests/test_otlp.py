"""OtlpExporter against a real OTLP/HTTP receiver on loopback."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from decimal import Decimal
from importlib.metadata import version
from typing import Any

import pytest
from otlp_receiver import Attrs, OtlpReceiver, Received

from collector.aggregate import otlp
from collector.aggregate.otlp import (
    COUNTER_ATTRIBUTES,
    COUNTERS,
    GAUGE_ATTRIBUTES,
    GAUGES,
    OtlpExporter,
    _metrics_url,
)
from collector.aggregate.records import BillingRecord, Gauge

CUMULATIVE = 2  # AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE in OTLP
COUNTER_NAMES = {c.name for c in COUNTERS}
GAUGE_NAMES = {g.name for g in GAUGES}
UNITS = {i.name: i.unit for i in (*COUNTERS, *GAUGES)}
GPU = "GPU-3f1c2a8e-1111-2222-3333-444455556666"


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as r:
        yield r


def make_record(window: int, container: str, scale: float, **overrides: Any) -> BillingRecord:
    pod_uid = f"uid-{container}"
    fields: dict[str, Any] = {
        "window_start_ms": window * 60_000,
        "window_end_ms": (window + 1) * 60_000,
        "node": "node-a",
        "pod_uid": pod_uid,
        "container": container,
        "device_uuid": GPU,
        "memory_byte_seconds": 1.5e9 * scale,
        "memory_limit_byte_seconds": 4.0e9 * scale,
        "nvml_memory_byte_seconds": 1.25e9 * scale,
        "sm_percent_seconds": 1234.5 * scale,
        "sm_limit_percent_seconds": 3000.0 * scale,
        "peak_memory_bytes": 2_000_000_000,
        "observed_seconds": 59.5 * scale,
        "allocated_gpu_seconds": 30.0 * scale,
        "used_gpu_seconds": 12.25 * scale,
        "reserved_idle_gpu_seconds": 20.0 * scale,
        "samples": 60,
        "record_id": f"{pod_uid}/{container}/{GPU}/{window}",
    }
    if container == "trainer":  # one container with pod metadata, one without
        fields |= {
            "namespace": "ml",
            "pod": "train-0",
            "workload_kind": "StatefulSet",
            "workload": "train",
            "labels": {"team": "vision"},
        }
    fields |= overrides
    return BillingRecord(**fields)


def counter_attrs(rec: BillingRecord) -> Attrs:
    base = {
        "k8s.node.name": rec.node,
        "k8s.pod.uid": rec.pod_uid,
        "k8s.container.name": rec.container,
        "hw.id": rec.device_uuid,
        "hw.type": "gpu",
    }
    if rec.namespace:
        base["k8s.namespace.name"] = rec.namespace
    if rec.pod:
        base["k8s.pod.name"] = rec.pod
    if rec.workload_kind == "StatefulSet":
        base["k8s.statefulset.name"] = rec.workload
    return frozenset(base.items())


def gauge_attrs(g: Gauge) -> Attrs:
    return frozenset(
        {
            "k8s.node.name": g.node,
            "k8s.pod.uid": g.pod_uid,
            "k8s.container.name": g.container,
            "hw.id": g.device_uuid,
            "hw.type": "gpu",
        }.items()
    )


def test_points_carry_only_declared_attributes(receiver: OtlpReceiver) -> None:
    exporter = OtlpExporter(receiver.endpoint, timeout_s=5)
    try:
        exporter.record_window([make_record(1, "trainer", 1.0), make_record(1, "sidecar", 1.0)])
        exporter.set_gauges([Gauge("node-a", "uid-1", "c1", GPU, 1, 2, 3, 4)])
        assert exporter.flush()
    finally:
        exporter.shutdown()
    for name, metric in receiver.wait_for(1)[0].metrics().items():
        declared = COUNTER_ATTRIBUTES if name in COUNTER_NAMES else GAUGE_ATTRIBUTES
        for attrs in metric.points:
            keys = {k for k, _ in attrs}
            assert keys <= set(declared), (name, keys)
            assert set(GAUGE_ATTRIBUTES) <= keys, name  # the identity is always complete


def test_no_metric_name_is_the_prefix_of_another() -> None:
    names = [i.name for i in (*COUNTERS, *GAUGES)]
    assert len(set(names)) == len(names)
    for a in names:
        for b in names:
            assert not b.startswith(a + "."), (a, b)


def expected_counters(records: list[BillingRecord]) -> dict[str, dict[Attrs, float]]:
    """Per counter and series: the exact sum of the records' values (/ 100 for percent), as
    the nearest double."""
    out: dict[str, dict[Attrs, float]] = {}
    for c in COUNTERS:
        sums: dict[Attrs, Decimal] = {}
        for rec in records:
            key = counter_attrs(rec)
            sums[key] = sums.get(key, Decimal(0)) + Decimal(getattr(rec, c.field))
        out[c.name] = {k: float(v / 100 if c.percent else v) for k, v in sums.items()}
    return out


def assert_counters(got: Received, records: list[BillingRecord]) -> None:
    metrics = got.metrics()
    for name, points in expected_counters(records).items():
        m = metrics[name]
        assert (m.kind, m.unit, m.is_monotonic, m.temporality) == (
            "sum",
            UNITS[name],
            True,
            CUMULATIVE,
        ), name
        assert m.points.keys() == points.keys(), name
        for key, value in points.items():
            assert isinstance(m.points[key], float)
            assert m.points[key] == value, (name, key)


def dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_windows_counters_and_gauges(receiver: OtlpReceiver) -> None:
    w1 = [make_record(1, "trainer", 1.0), make_record(1, "sidecar", 0.25)]
    w2 = [make_record(2, "trainer", 2.0), make_record(2, "sidecar", 0.5)]
    gauges = [
        Gauge(
            "node-a", "uid-trainer", "trainer", GPU, 3_000_000_000, 8_000_000_000, 73, 2_900_000_000
        ),
        Gauge("node-a", "uid-sidecar", "sidecar", GPU, 100_000_000, 1_000_000_000, 5, 90_000_000),
    ]
    exporter = OtlpExporter(receiver.endpoint, service_instance="aggregator-0", timeout_s=5)
    try:
        exporter.record_window(w1)
        assert exporter.flush() is True
        exporter.record_window(w2)
        exporter.set_gauges(gauges)
        assert exporter.flush() is True
    finally:
        exporter.shutdown()

    first, second = receiver.wait_for(2)[:2]
    assert first.path == second.path == "/v1/metrics"
    assert first.headers["content-type"] == "application/x-protobuf"

    # Window 1 only: the counters, no gauges yet.
    assert set(first.metrics()) == COUNTER_NAMES
    assert_counters(first, w1)

    # Window 2: cumulative totals of both windows, plus the gauges.
    assert set(second.metrics()) == COUNTER_NAMES | GAUGE_NAMES
    assert_counters(second, w1 + w2)
    for name in COUNTER_NAMES:  # same cumulative stream: same start time
        assert second.metrics()[name].start_times == first.metrics()[name].start_times

    metrics = second.metrics()
    for gauge in GAUGES:
        m = metrics[gauge.name]
        assert (m.kind, m.unit) == ("gauge", gauge.unit)
        assert m.points == {
            gauge_attrs(g): getattr(g, gauge.field) / (100 if gauge.percent else 1) for g in gauges
        }
        # Bytes stay integers; the 0-1 ratio is a double.
        kind = int if gauge.unit == "By" else float
        assert all(isinstance(v, kind) for v in m.points.values())

    # the exact attribute sets
    trainer = frozenset(
        {
            ("k8s.node.name", "node-a"),
            ("k8s.pod.uid", "uid-trainer"),
            ("k8s.container.name", "trainer"),
            ("hw.id", GPU),
            ("hw.type", "gpu"),
            ("k8s.namespace.name", "ml"),
            ("k8s.pod.name", "train-0"),
            ("k8s.statefulset.name", "train"),  # by workload_kind; labels are not attributes
        }
    )
    sidecar = frozenset(
        {
            ("k8s.node.name", "node-a"),
            ("k8s.pod.uid", "uid-sidecar"),
            ("k8s.container.name", "sidecar"),
            ("hw.id", GPU),
            ("hw.type", "gpu"),
        }
    )
    usage = metrics["hami.gpu.memory.usage_byte_seconds"].points
    assert set(usage) == {trainer, sidecar}
    assert usage[trainer] == pytest.approx(1.5e9 * 3)
    # percent-seconds / 100 = seconds of a whole GPU's SMs
    assert metrics["hami.gpu.sm.usage_time"].points[sidecar] == pytest.approx(12.345 * 0.75)

    for got in (first, second):
        resource = got.resource_attributes()
        assert resource["service.name"] == "hami-usage-aggregator"
        assert resource["service.version"] == version("hami-usage")
        assert resource["service.instance.id"] == "aggregator-0"
    # The final flush in shutdown() sent the same totals once more.
    assert exporter.failed_exports == 0
    assert exporter.successful_exports == 3


def test_every_counter_counts_from_when_the_exporter_was_made(receiver: OtlpReceiver) -> None:
    """The totals hold every window since the exporter was made, but the SDK started a series
    at the collection that first observed it: a first point holding a closed window (or a
    drain's whole backlog) started a millisecond before its time, and a backend reading start
    times saw that window accrue in a millisecond (Prometheus drops a created timestamp not
    before its sample's)."""
    made = time.time_ns()
    exporter = OtlpExporter(receiver.endpoint, service_instance="aggregator-0", timeout_s=5)
    try:
        time.sleep(0.05)
        exporter.record_window([make_record(1, "trainer", 1.0)])
        assert exporter.flush() is True
        time.sleep(0.05)
        exporter.record_window([make_record(2, "sidecar", 0.5)])  # a series of the second push
        assert exporter.flush() is True
    finally:
        exporter.shutdown()
    first, second = receiver.wait_for(2)[:2]
    starts = set()
    for got in (first, second):
        for name in COUNTER_NAMES:
            m = got.metrics()[name]
            starts |= set(m.start_times.values())
            assert all(m.times[k] - m.start_times[k] >= 40_000_000 for k in m.times)
    (start,) = starts
    assert made <= start <= made + 40_000_000


def test_gauges_report_only_the_latest_list(receiver: OtlpReceiver) -> None:
    a = Gauge("node-a", "uid-1", "c1", GPU, 10, 100, 50, 11)
    b = Gauge("node-a", "uid-2", "c2", GPU, 20, 200, 25, 21)
    a2 = Gauge("node-a", "uid-1", "c1", GPU, 15, 100, 60, 16)
    exporter = OtlpExporter(receiver.endpoint, service_instance="x", timeout_s=5)
    try:
        exporter.set_gauges([a, b])
        assert exporter.flush()
        exporter.set_gauges([a2])
        assert exporter.flush()
        exporter.set_gauges([])
        assert exporter.flush()
    finally:
        exporter.shutdown()
    got = receiver.wait_for(2)
    assert got[0].metrics()["hami.gpu.memory.usage"].points == {
        gauge_attrs(a): 10,
        gauge_attrs(b): 20,
    }
    assert got[1].metrics()["hami.gpu.sm.utilization"].points == {gauge_attrs(a2): 0.6}
    # Nothing left to report: either no request or one without these metrics.
    for later in got[2:]:
        assert not set(later.metrics()) & GAUGE_NAMES


def test_dead_endpoint_fails_fast_and_is_counted() -> None:
    timeout_s = 1.0
    exporter = OtlpExporter(f"http://127.0.0.1:{dead_port()}", timeout_s=timeout_s)
    exporter.record_window([make_record(1, "trainer", 1.0)])
    exporter.set_gauges([Gauge("node-a", "uid-1", "c1", GPU, 1, 2, 3, 4)])
    started = time.monotonic()
    assert exporter.flush() is False
    assert time.monotonic() - started < timeout_s + 2
    assert exporter.failed_exports == 1
    assert exporter.successful_exports == 0
    started = time.monotonic()
    exporter.shutdown()  # one more (failing) flush, then close: no exception
    assert time.monotonic() - started < timeout_s + 2
    assert exporter.failed_exports == 2
    assert exporter.flush() is False  # after shutdown: refused, not raised


def test_stalled_collector_is_bounded_by_timeout(receiver: OtlpReceiver) -> None:
    receiver.delay_s = 5.0
    timeout_s = 1.0
    exporter = OtlpExporter(receiver.endpoint, timeout_s=timeout_s)
    exporter.record_window([make_record(1, "trainer", 1.0)])
    started = time.monotonic()
    assert exporter.flush() is False
    assert time.monotonic() - started < timeout_s + 2
    assert exporter.failed_exports == 1
    receiver.delay_s = 0.0


def test_failed_export_loses_nothing(receiver: OtlpReceiver) -> None:
    w1 = [make_record(1, "trainer", 1.0)]
    w2 = [make_record(2, "trainer", 3.0)]
    exporter = OtlpExporter(receiver.endpoint, timeout_s=2)
    try:
        receiver.fail_status = 500  # not retryable: fails at once
        exporter.record_window(w1)
        assert exporter.flush() is False
        assert exporter.failed_exports == 1
        assert receiver.attempts == 1
        receiver.fail_status = None
        exporter.record_window(w2)
        assert exporter.flush() is True
    finally:
        exporter.shutdown()
    assert_counters(receiver.wait_for(1)[0], w1 + w2)


def test_gzip_and_headers(receiver: OtlpReceiver) -> None:
    exporter = OtlpExporter(
        receiver.endpoint + "/",
        timeout_s=5,
        compression="gzip",
        headers={"Authorization": "Bearer t0ken"},
    )
    try:
        exporter.record_window([make_record(1, "trainer", 1.0)])
        assert exporter.flush()
    finally:
        exporter.shutdown()
    got = receiver.wait_for(1)[0]
    assert got.headers["content-encoding"] == "gzip"
    assert got.headers["authorization"] == "Bearer t0ken"
    assert_counters(got, [make_record(1, "trainer", 1.0)])


def test_duplicate_record_ids_are_added_once(receiver: OtlpReceiver) -> None:
    r1 = make_record(1, "trainer", 1.0)
    r2 = make_record(2, "trainer", 2.0)
    exporter = OtlpExporter(receiver.endpoint, timeout_s=5)
    try:
        exporter.record_window([r1, r1])
        assert exporter.flush()
        exporter.record_window([r2, r1])  # r1 published again (replay after a restart)
        assert exporter.flush()
    finally:
        exporter.shutdown()
    assert exporter.duplicate_records == 2
    assert_counters(receiver.wait_for(2)[1], [r1, r2])


def test_dedupe_capacity_bounds_memory(receiver: OtlpReceiver) -> None:
    r1, r2, r3 = (make_record(w, "trainer", 1.0) for w in (1, 2, 3))
    exporter = OtlpExporter(receiver.endpoint, timeout_s=5, dedupe_capacity=2)
    try:
        exporter.record_window([r1, r2, r3])  # r1 forgotten once r3 is remembered
        exporter.record_window([r3, r1])
        assert exporter.flush()
    finally:
        exporter.shutdown()
    assert exporter.duplicate_records == 1
    assert_counters(receiver.wait_for(1)[0], [r1, r2, r3, r1])


def test_invalid_values_are_not_added(receiver: OtlpReceiver) -> None:
    bad = make_record(1, "trainer", 1.0, memory_byte_seconds=float("nan"), sm_percent_seconds=-5.0)
    inf = make_record(2, "trainer", 1.0, observed_seconds=float("inf"))
    exporter = OtlpExporter(receiver.endpoint, timeout_s=5)
    try:
        exporter.record_window([bad, inf])
        assert exporter.flush()
    finally:
        exporter.shutdown()
    assert exporter.rejected_values == 3
    metrics = receiver.wait_for(1)[0].metrics()
    key = counter_attrs(bad)
    usage = metrics["hami.gpu.memory.usage_byte_seconds"].points
    assert usage[key] == pytest.approx(1.5e9)  # window 2 only
    assert metrics["hami.gpu.sm.usage_time"].points[key] == pytest.approx(12.345)
    assert metrics["hami.gpu.observed_time"].points[key] == pytest.approx(59.5)
    assert metrics["hami.gpu.memory.limit_byte_seconds"].points[key] == pytest.approx(8.0e9)


def test_series_overflow_is_reported(
    receiver: OtlpReceiver, caplog: pytest.LogCaptureFixture
) -> None:
    exporter = OtlpExporter(receiver.endpoint, timeout_s=5, max_series=2)
    try:
        exporter.record_window([make_record(1, f"c{i}", 1.0) for i in range(3)])
        assert exporter.flush()
    finally:
        exporter.shutdown()
    assert exporter.overflowed
    assert "max_series" in caplog.text
    points = receiver.wait_for(1)[0].metrics()["hami.gpu.observed_time"].points
    assert frozenset({("otel.metric.overflow", True)}) in points
    assert sum(points.values()) == pytest.approx(59.5 * 3)


def test_series_past_max_series_are_summed_in_bounded_memory(receiver: OtlpReceiver) -> None:
    """Every series ever recorded kept its own total although past max_series the SDK folds
    them into one: memory grew with every container a cluster ever ran. Past max_series they
    are summed as one overflow total, exactly as the SDK sent them."""
    exporter = OtlpExporter(receiver.endpoint, timeout_s=5, max_series=2)
    try:
        for window in (1, 2):
            exporter.record_window([make_record(window, f"c{i}", 1.0) for i in range(50)])
        assert exporter.flush()
    finally:
        exporter.shutdown()
    assert exporter.overflowed
    assert [len(totals) for totals in exporter._totals] == [3] * len(COUNTERS)
    points = receiver.wait_for(1)[0].metrics()["hami.gpu.observed_time"].points
    overflow = frozenset({("otel.metric.overflow", True)})
    assert sorted(points.values()) == [119.0, 119.0, 48 * 119.0]
    assert points[overflow] == 48 * 119.0


def test_nothing_recorded_flush_succeeds(receiver: OtlpReceiver) -> None:
    exporter = OtlpExporter(receiver.endpoint, timeout_s=5)
    try:
        assert exporter.flush() is True
        assert exporter.failed_exports == 0
    finally:
        exporter.shutdown()


def pushed_resource(receiver: OtlpReceiver) -> dict[str, Any]:
    """The resource of one push of a default exporter."""
    exporter = OtlpExporter(receiver.endpoint, timeout_s=5)
    try:
        exporter.record_window([make_record(1, "trainer", 1.0)])
        assert exporter.flush()
    finally:
        exporter.shutdown()
    return dict(receiver.wait_for(1)[0].resource_attributes())


def test_service_instance_defaults_to_host_name(receiver: OtlpReceiver) -> None:
    assert pushed_resource(receiver)["service.instance.id"] == socket.gethostname()


def test_service_instance_from_otel_resource_attributes(
    receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two replicas on one host name each their own instance this way (the host name was the
    id whatever the variable said: both wrote one series)."""
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.instance.id=agg-b,k8s.pod.name=p")
    resource = pushed_resource(receiver)
    assert (resource["service.instance.id"], resource["k8s.pod.name"]) == ("agg-b", "p")


@pytest.mark.parametrize(
    ("endpoint", "url"),
    [
        ("http://collector:4318", "http://collector:4318/v1/metrics"),
        ("http://collector:4318/", "http://collector:4318/v1/metrics"),
        ("https://otlp.example/v1/metrics", "https://otlp.example/v1/metrics"),
        ("https://otlp.example/custom/path", "https://otlp.example/custom/path"),
    ],
)
def test_endpoint_url(endpoint: str, url: str) -> None:
    assert _metrics_url(endpoint) == url


@pytest.mark.parametrize("endpoint", ["collector:4318", "", "/v1/metrics"])
def test_endpoint_must_be_a_url(endpoint: str) -> None:
    with pytest.raises(ValueError):
        OtlpExporter(endpoint)


@pytest.mark.parametrize(
    ("kind", "attribute"),
    [
        ("Deployment", "k8s.deployment.name"),
        ("StatefulSet", "k8s.statefulset.name"),
        ("DaemonSet", "k8s.daemonset.name"),
        ("Job", "k8s.job.name"),
        ("CronJob", "k8s.cronjob.name"),
        ("ReplicaSet", "k8s.replicaset.name"),
        ("Pod", None),
        ("", None),
    ],
)
def test_workload_attribute_follows_the_semantic_conventions(
    kind: str, attribute: str | None
) -> None:
    from collector.aggregate.otlp import _record_attributes

    rec = make_record(0, "x", 1.0, namespace="ml", pod="w-0", workload_kind=kind, workload="w")
    attrs = _record_attributes(rec)
    workload = {k: v for k, v in attrs.items() if k.startswith("k8s.") and k.endswith(".name")}
    expected = {
        "k8s.node.name": rec.node,
        "k8s.container.name": "x",
        "k8s.namespace.name": "ml",
        "k8s.pod.name": "w-0",
    }
    if attribute is not None:
        expected[attribute] = "w"
    assert workload == expected


@pytest.mark.parametrize("status", [301, 302, 307, 308])
def test_a_redirect_is_a_failed_export_not_a_delivery(
    receiver: OtlpReceiver, status: int, caplog: pytest.LogCaptureFixture
) -> None:
    """The SDK counts any 3xx as delivered and follows none: nothing arrives. An ingress that
    redirects http to https would have dropped every push silently."""
    receiver.fail_status = status
    exporter = OtlpExporter(receiver.endpoint, timeout_s=2)
    exporter.record_window([make_record(1, "trainer", 1.0)])
    assert exporter.flush() is False
    assert (exporter.failed_exports, exporter.successful_exports) == (1, 0)
    assert receiver.attempts == 1 and receiver.received == []
    assert "a redirect to '/moved', not followed" in caplog.text
    receiver.fail_status = None
    exporter.shutdown()


def test_a_push_never_waits_for_a_slow_answer_and_never_doubles(
    receiver: OtlpReceiver, caplog: pytest.LogCaptureFixture
) -> None:
    """An answer sent a byte every 0.2 s (each read within the 1 s timeout, 20 bytes: 4 s)
    holds a flush that long. `push` returns at once; a push while it runs is skipped, counted
    and logged once; the next push after it carries everything recorded meanwhile."""
    receiver.dribble_s, receiver.dribble_bytes = 0.2, 20
    exporter = OtlpExporter(receiver.endpoint, timeout_s=1, push_interval_s=0, push_share=1)
    exporter.record_window([make_record(1, "trainer", 1.0)])
    assert exporter.push() is True
    first = exporter._pushing
    assert first is not None and first.is_alive()  # returned while the answer is coming
    exporter.record_window([make_record(2, "trainer", 3.0)])
    assert (exporter.push(), exporter.push()) == (False, False)
    assert exporter.pushes_skipped == 2
    assert caplog.text.count("is still running; later pushes wait for it") == 1
    first.join(30)
    assert not first.is_alive() and exporter.successful_exports == 1
    receiver.dribble_s = 0.0
    assert exporter.push() is True
    exporter.shutdown()
    got = receiver.wait_for(3)
    assert len(got) == 3  # the two pushes that ran, and shutdown's
    assert_counters(got[1], [make_record(1, "trainer", 1.0), make_record(2, "trainer", 3.0)])


def test_shutdown_does_not_wait_for_a_push_that_does_not_end(
    receiver: OtlpReceiver, caplog: pytest.LogCaptureFixture
) -> None:
    """At most 2 x timeout_s in all (4 s here), not the minute the answer takes, nor twice
    that bound (once for the running push, once for the last one)."""
    receiver.dribble_s, receiver.dribble_bytes = 0.3, 200  # a minute, each read within 2 s
    exporter = OtlpExporter(receiver.endpoint, timeout_s=2)
    exporter.record_window([make_record(1, "trainer", 1.0)])
    exporter.push()
    started = time.monotonic()
    exporter.shutdown()
    assert time.monotonic() - started < 6
    assert "did not finish in 4s: not waiting for it" in caplog.text
    assert exporter.push() is False  # shut down


def test_a_push_is_split_into_requests_of_bounded_points(
    receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One request of every series was dropped whole by the SDK past its 64 MiB cap (and a
    collector refuses bodies past 20 MiB by default): requests carry at most
    MAX_POINTS_PER_REQUEST points (here 20), and all of them arrive."""
    monkeypatch.setattr(otlp, "MAX_POINTS_PER_REQUEST", 20)
    exporter = OtlpExporter(receiver.endpoint, timeout_s=5)
    records = [make_record(1, f"c{i}", 1.0) for i in range(30)]
    exporter.record_window(records)
    assert exporter.flush() is True
    exporter.shutdown()
    got = receiver.wait_for(100, timeout_s=1)
    sizes = [sum(len(m.points) for m in r.metrics().values()) for r in got]
    assert max(sizes) <= 20 and len(sizes) > 1
    per_metric: dict[str, int] = {}
    for r in got:
        for name, m in r.metrics().items():
            per_metric[name] = per_metric.get(name, 0) + len(m.points)
    # every counter's 30 series arrived (the second flush at shutdown sends them all again)
    assert per_metric["hami.gpu.observed_time"] == 2 * 30


def test_counters_are_the_exact_sum_of_the_records_rounded_once(receiver: OtlpReceiver) -> None:
    """A month of one-minute windows of a 79 GiB container: adding each record as a float drifted
    52 746 byte-seconds from the records' sum; and percent-seconds / 100 is 0.57, not
    0.5700000000000001 (57 x 0.01)."""
    records = [
        make_record(
            w, "trainer", 1.0,
            memory_byte_seconds=Decimal("5090113232977.123"), sm_percent_seconds=Decimal("57.000"),
        )
        for w in range(43_200)
    ]  # fmt: skip
    gauge = Gauge("node-a", "uid-trainer", "trainer", GPU, 1, 2, 57, 3)
    exporter = OtlpExporter(receiver.endpoint, timeout_s=5)
    try:
        exporter.record_window(records[:1])
        exporter.set_gauges([gauge])
        assert exporter.flush()
        exporter.record_window(records[1:])
        assert exporter.flush()
    finally:
        exporter.shutdown()
    first, second = receiver.wait_for(2)[:2]
    key = counter_attrs(records[0])
    assert first.metrics()["hami.gpu.sm.usage_time"].points[key] == 0.57
    assert first.metrics()["hami.gpu.sm.utilization"].points[gauge_attrs(gauge)] == 0.57
    usage = second.metrics()["hami.gpu.memory.usage_byte_seconds"].points[key]
    assert usage == float(Decimal("5090113232977.123") * 43_200) == 2.198928916646117e17
    assert second.metrics()["hami.gpu.sm.usage_time"].points[key] == 24624.0


def test_collecting_is_not_bounded_by_the_request_timeout(receiver: OtlpReceiver) -> None:
    """Collecting the series took ~15 us a point and shared the request's timeout: past it
    (about 75 000 series at the default 10 s) every push failed with MetricsTimeoutError.
    Here 400 series (3 600 points) against a 10 ms timeout, which the receiver on loopback
    answers within."""
    exporter = OtlpExporter(receiver.endpoint, timeout_s=0.01)
    try:
        exporter.record_window([make_record(1, f"c{i}", 1.0) for i in range(400)])
        started = time.monotonic()
        ok = exporter.flush()
        took = time.monotonic() - started
    finally:
        exporter.shutdown()
    assert took > 0.01  # (the point of the test: collecting alone outlasts the timeout)
    assert (ok, exporter.failed_exports) == (True, 0)
    points = receiver.wait_for(1)[0].metrics()["hami.gpu.observed_time"].points
    assert len(points) == 400


def test_an_overlong_attribute_is_not_sent_and_blocks_nothing(
    receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record whose container name is 30 000 characters made its request too large for the
    collector, and the SDK stops a push at its first failed request: the series after it were
    never sent. It is left out and counted; the rest arrive."""
    monkeypatch.setattr(otlp, "MAX_POINTS_PER_REQUEST", 20)
    receiver.max_body = 20_000  # 20 points of real names are about 5 000 bytes
    long = "x" * 30_000
    edge = "y" * 384  # MAX_ATTRIBUTE_CHARS: a cache file's UUID as the collector shows it
    records = [make_record(1, long, 1.0)] + [make_record(1, f"c{i}", 1.0) for i in range(5)]
    records.append(make_record(1, edge, 1.0, pod_uid="uid-edge"))
    gauges = [Gauge("node-a", f"uid-{c}", c, GPU, 1, 2, 3, 4) for c in (long, "c0")]
    exporter = OtlpExporter(receiver.endpoint, timeout_s=5)
    try:
        exporter.record_window(records)
        exporter.set_gauges(gauges)
        assert exporter.flush()
    finally:
        exporter.shutdown()
    assert exporter.rejected_series == 1
    assert "rejected_series=1" in exporter.summary()
    sent: dict[str, set[str]] = {}
    for request in receiver.wait_for(100, timeout_s=1):
        for name, m in request.metrics().items():
            sent.setdefault(name, set()).update(
                dict(k).get("k8s.container.name", "") for k in m.points
            )
    assert sent["hami.gpu.observed_time"] == {f"c{i}" for i in range(5)} | {edge}
    assert {n: v for n, v in sent.items() if n in GAUGE_NAMES} == {n: {"c0"} for n in GAUGE_NAMES}
    assert len(edge) == otlp.MAX_ATTRIBUTE_CHARS


def test_pushes_are_paced_by_their_cost(receiver: OtlpReceiver) -> None:
    """The aggregator pushes at each commit (every 5 s at most) and a push costs about 35 us of
    CPU a point: unpaced, pushes took most of a core past a few thousand series. The next
    push starts no sooner than push_interval_s, nor than the last push's duration / push_share,
    after the last one started; shutdown's push is never deferred."""
    receiver.delay_s = 0.3  # each push takes 0.3 s or more
    exporter = OtlpExporter(receiver.endpoint, timeout_s=5, push_interval_s=0.1, push_share=0.5)
    exporter.record_window([make_record(1, "trainer", 1.0)])
    started = time.monotonic()
    assert exporter.push() is True
    pushing = exporter._pushing
    assert pushing is not None
    pushing.join(10)
    took = time.monotonic() - started
    assert took >= 0.3
    assert exporter.push() is False  # within 2 x took of the start: deferred, not counted
    assert exporter.pushes_skipped == 0
    time.sleep(max(0.0, started + 2 * took + 0.05 - time.monotonic()))
    assert exporter.push() is True
    pushing = exporter._pushing
    assert pushing is not None
    pushing.join(10)
    exporter.record_window([make_record(2, "trainer", 3.0)])
    exporter.shutdown()  # (a push now would be deferred; shutdown's is not)
    got = receiver.wait_for(3)
    assert len(got) == 3
    assert_counters(got[2], [make_record(1, "trainer", 1.0), make_record(2, "trainer", 3.0)])


def test_a_partial_success_is_counted_and_logged_once_a_push(
    receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A backend that takes a request but rejects some of its points answers 200 with OTLP's
    partial_success, which the SDK never reads: such a push counted as a successful export and
    the points were gone without a word. They are counted in `rejected_points` (the summary
    line) and each push logs one warning with the backend's reasons, escaped to one line."""
    monkeypatch.setattr(otlp, "MAX_POINTS_PER_REQUEST", 20)
    receiver.partial = (3, "out of order\nsample")
    exporter = OtlpExporter(receiver.endpoint, timeout_s=5)
    exporter.record_window([make_record(1, f"c{i}", 1.0) for i in range(30)])
    assert exporter.flush() is True
    requests_sent = receiver.attempts
    assert requests_sent > 1
    assert exporter.rejected_points == 3 * requests_sent
    warnings = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()]
    assert warnings == [
        f"the OTLP backend at {exporter.endpoint} rejected {3 * requests_sent} points of this "
        f"push ({3 * requests_sent} so far; not retried, as OTLP asks): out of order\\nsample"
    ]
    receiver.partial = (0, "")  # an empty partial_success is a full success
    assert exporter.flush() is True
    assert exporter.rejected_points == 3 * requests_sent
    receiver.partial = None
    exporter.shutdown()
    assert f"rejected_points={3 * requests_sent}" in exporter.summary()
