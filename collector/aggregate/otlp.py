"""OTLP/HTTP metrics export of closed billing windows and current gauges.

The aggregator calls :meth:`OtlpExporter.record_window` with every batch of closed-window
:class:`BillingRecord` objects, :meth:`OtlpExporter.set_gauges` with the latest per-container
values, and then :meth:`OtlpExporter.push`, which runs :meth:`OtlpExporter.flush` on a thread of
its own: it collects and sends OTLP ``ExportMetricsServiceRequest`` s (http/protobuf, ``POST
<endpoint>/v1/metrics``, at most `MAX_POINTS_PER_REQUEST` points each). Nothing is sent unless
``push`` or ``flush`` is called, and at most one push runs at a time.

Metrics
=======

`COUNTERS` and `GAUGES` below declare every metric once (the README's table is generated from
them). Names and units follow the OpenTelemetry semantic conventions where one applies (UCUM
units, `1` for ratios, `hw.id` for the device) and are chosen so that the Prometheus translation
(the OTel Collector's prometheus exporter) gives names `promtool check metrics` accepts: a time
integral of a ratio is in seconds (`s`), and byte-seconds, which no translator maps to words, are
annotated `{By.s}` with `byte_seconds` in the name. No name is the dotted prefix of another.
Integrals are sums of the billing records; gauges are the values in effect now.

Attributes on every point: `k8s.node.name`, `k8s.pod.uid`, `k8s.container.name`, `hw.id` (the
GPU's UUID, `GPU-...` or `MIG-...`), `hw.type=gpu`; on counters also `k8s.namespace.name`,
`k8s.pod.name` and the workload's `k8s.deployment.name`, `k8s.statefulset.name`,
`k8s.daemonset.name`, `k8s.job.name`, `k8s.cronjob.name` or `k8s.replicaset.name` (by the
record's `workload_kind`; none for a bare pod) when the record has them.

Resource: `service.name=hami-usage-aggregator`, `service.version` (the package's),
`service.instance.id` (the `service_instance` argument, else the one `OTEL_RESOURCE_ATTRIBUTES`
gives, else the host name, i.e. the pod name),
the SDK's `telemetry.sdk.*`, and whatever `OTEL_RESOURCE_ATTRIBUTES` adds (the manifests add the
aggregator's own `k8s.namespace.name`, `k8s.pod.name`, `k8s.statefulset.name`, `k8s.node.name`).

Semantics
=========

Counters are monotonic sums with CUMULATIVE temporality, double values: every export carries
the total since the exporter was created, so a failed export loses nothing (the next successful
one carries the whole total). The totals are kept exactly (the records' decimals) and rounded
once, to the nearest double, when sent: a counter is the sum of the records' integrals. An
aggregator restart starts them at 0 with a new `start_time_unix_nano`: a backend that reads
start times sees a reset; Prometheus, through the Collector's exporter, sees one only when the
first value after it is below the last before (see the README: what Prometheus shows over
time). Average memory over an interval =
increase(`hami.gpu.memory.usage_byte_seconds`) / increase(`hami.gpu.observed_time`).
Point timestamps are flush times, not window bounds: the billing records stay the source of
truth for billing, OTLP is for dashboards and alerts.

Gauges report exactly the series of the latest `set_gauges` list; a container gone from it is
no longer reported.

Records are de-duplicated by `record_id` (a restart or replay may publish a record again): a
`record_id` seen among the last `dedupe_capacity` is ignored, counted in `duplicate_records`.
`revision` is not interpreted (it is always 0 today and part of `record_id`); should corrections
ever be emitted as replacement records, their earlier revision would have to be subtracted here.
Negative or non-finite values are never added (logged, counted in `rejected_values`).
"""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from decimal import Decimal
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Final, Literal
from urllib.parse import urlsplit, urlunsplit

import requests
from google.protobuf.message import DecodeError
from opentelemetry.context import _SUPPRESS_INSTRUMENTATION_KEY, attach, detach, set_value
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceResponse,
)
from opentelemetry.sdk.metrics import (
    Counter,
    Histogram,
    MeterProvider,
    ObservableCounter,
    ObservableGauge,
    ObservableUpDownCounter,
    UpDownCounter,
)
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    MetricExporter,
    MetricExportResult,
    MetricReader,
    MetricsData,
    Sum,
)
from opentelemetry.sdk.resources import OTELResourceDetector, Resource

from ..events import MAX_CACHE_UUID, MAX_NAME
from ..settings_check import one_line
from .records import BillingRecord, Gauge

__all__ = [
    "ATTR_CONTAINER",
    "ATTR_GPU_UUID",
    "ATTR_HW_TYPE",
    "ATTR_NAMESPACE",
    "ATTR_NODE",
    "ATTR_POD_NAME",
    "ATTR_POD_UID",
    "COUNTERS",
    "COUNTER_ATTRIBUTES",
    "GAUGE_ATTRIBUTES",
    "GAUGES",
    "Instrument",
    "SERVICE_NAME",
    "Gauge",
    "OtlpExporter",
]

_log = logging.getLogger(__name__)

SERVICE_NAME: Final = "hami-usage-aggregator"

ATTR_NODE: Final = "k8s.node.name"
ATTR_POD_UID: Final = "k8s.pod.uid"
ATTR_CONTAINER: Final = "k8s.container.name"
ATTR_NAMESPACE: Final = "k8s.namespace.name"
ATTR_POD_NAME: Final = "k8s.pod.name"
# The semantic conventions' attribute for a workload's name, by its kind.
ATTR_WORKLOAD: Final = {
    "Deployment": "k8s.deployment.name",
    "StatefulSet": "k8s.statefulset.name",
    "DaemonSet": "k8s.daemonset.name",
    "Job": "k8s.job.name",
    "CronJob": "k8s.cronjob.name",
    "ReplicaSet": "k8s.replicaset.name",
}
ATTR_GPU_UUID: Final = "hw.id"
ATTR_HW_TYPE: Final = "hw.type"
# Every attribute a point can carry (the README's tables list them): gauges always carry theirs;
# counters also the Kubernetes names when the record has them.
GAUGE_ATTRIBUTES: Final = (ATTR_NODE, ATTR_POD_UID, ATTR_CONTAINER, ATTR_GPU_UUID, ATTR_HW_TYPE)
COUNTER_ATTRIBUTES: Final = (
    *GAUGE_ATTRIBUTES,
    ATTR_NAMESPACE,
    ATTR_POD_NAME,
    *ATTR_WORKLOAD.values(),
)


@dataclass(frozen=True)
class Instrument:
    name: str
    unit: str
    field: str  # of BillingRecord (counters) or Gauge (gauges)
    percent: bool  # the field is in percent: the metric's value in `unit` is the field / 100
    description: str


COUNTERS: Final[tuple[Instrument, ...]] = (
    Instrument(
        "hami.gpu.memory.usage_byte_seconds",
        "{By.s}",
        "memory_byte_seconds",
        False,
        "GPU memory used by the container (HAMi accounting), integrated over time",
    ),
    Instrument(
        "hami.gpu.memory.limit_byte_seconds",
        "{By.s}",
        "memory_limit_byte_seconds",
        False,
        "GPU memory limit of the container while present (and running, with the pod watch), "
        "integrated over time",
    ),
    Instrument(
        "hami.gpu.memory.nvml_usage_byte_seconds",
        "{By.s}",
        "nvml_memory_byte_seconds",
        False,
        "GPU memory NVML attributes to the container's processes, integrated over time",
    ),
    Instrument(
        "hami.gpu.sm.usage_time",
        "s",
        "sm_percent_seconds",
        True,
        "SM utilisation integrated over time: 1 s = all SMs of one GPU for one second",
    ),
    Instrument(
        "hami.gpu.sm.limit_time",
        "s",
        "sm_limit_percent_seconds",
        True,
        "SM limit integrated over time: 1 s = one whole GPU for one second",
    ),
    Instrument(
        "hami.gpu.observed_time",
        "s",
        "observed_seconds",
        False,
        "time the container was observed on the GPU",
    ),
    Instrument(
        "hami.gpu.allocated_time",
        "s",
        "allocated_gpu_seconds",
        False,
        "GPU time allocated to the container (the aggregator's allocation policy): 1 s = one"
        " whole GPU for one second",
    ),
    Instrument(
        "hami.gpu.used_time",
        "s",
        "used_gpu_seconds",
        False,
        "GPU time the container used: the larger of its SM time and its memory share",
    ),
    Instrument(
        "hami.gpu.reserved_idle_time",
        "s",
        "reserved_idle_gpu_seconds",
        False,
        "the part of the allocated GPU time during which the container had no SM activity on"
        " the GPU (reserved but idle)",
    ),
)

GAUGES: Final[tuple[Instrument, ...]] = (
    Instrument(
        "hami.gpu.memory.usage", "By", "memory_used_bytes", False, "GPU memory used now (HAMi)"
    ),
    Instrument("hami.gpu.memory.limit", "By", "memory_limit_bytes", False, "GPU memory limit now"),
    Instrument(
        "hami.gpu.memory.nvml_usage",
        "By",
        "nvml_memory_bytes",
        False,
        "GPU memory NVML attributes to the container's processes now",
    ),
    Instrument(
        "hami.gpu.sm.utilization",
        "1",
        "sm_percent",
        True,
        "SM utilisation now, 0-1 (1 = all SMs of one GPU)",
    ),
)

_ZERO: Final = Decimal(0)

_CUMULATIVE: Final[dict[type, AggregationTemporality]] = {
    cls: AggregationTemporality.CUMULATIVE
    for cls in (
        Counter,
        UpDownCounter,
        Histogram,
        ObservableCounter,
        ObservableUpDownCounter,
        ObservableGauge,
    )
}

_COMPRESSION: Final = {
    "none": Compression.NoCompression,
    "gzip": Compression.Gzip,
    "deflate": Compression.Deflate,
}

_OVERFLOW_ATTRIBUTE: Final = "otel.metric.overflow"
_Series = tuple[tuple[str, str | bool], ...]  # a counter's attributes
_OVERFLOW_SERIES: Final[_Series] = ((_OVERFLOW_ATTRIBUTE, True),)

# Points per request, about 240 bytes each with these attributes: about 1.2 MB a request, far
# under the OpenTelemetry Collector's default 20 MiB body limit and the SDK's 64 MiB cap (one
# request of every series was dropped whole, and every later push with it, past ~21 700
# container series).
MAX_POINTS_PER_REQUEST: Final = 5000

# The longest attribute value sent: the longest string an event may carry into one (a cache
# file's UUID as the collector shows it; names are at most 255). Without a bound, one record
# with a megabyte name (events come from any producer on the topic) made its request too large
# for the collector, and the SDK stops a push at its first failed request: every series after
# it went unsent at every push. (The events' own bounds now refuse such a name at intake; this
# one stays for records from anywhere else.)
MAX_ATTRIBUTE_CHARS: Final = max(MAX_NAME, MAX_CACHE_UUID)


class _RedirectRefused(requests.RequestException):
    """An OTLP endpoint answered with a redirect."""


class _Session(requests.Session):
    """What the SDK does not look at in the answers.

    A redirect: the SDK counts any 3xx answer as delivered, though it follows none (nothing
    arrived); it is refused here, so the push fails, is logged with where it pointed, and
    counts. A partial success: a 200 whose body says the backend rejected some of the request's
    points (OTLP's `partial_success`: not to be retried, and the SDK reads no answer's body);
    `on_partial` gets the count and the backend's message."""

    def __init__(self, on_partial: Callable[[int, str], None]) -> None:
        super().__init__()
        self._on_partial = on_partial

    def request(self, *args: Any, **kwargs: Any) -> Any:
        response = super().request(*args, **kwargs)
        if 300 <= response.status_code < 400:
            response.close()
            raise _RedirectRefused(
                f"{response.status_code} {response.reason}: a redirect to "
                f"{response.headers.get('location')!r}, not followed (set the endpoint to it)"
            )
        if 200 <= response.status_code < 300 and response.content:
            try:
                answer = ExportMetricsServiceResponse.FromString(response.content)
            except DecodeError:
                return response  # not an OTLP answer: nothing in it to count
            partial = answer.partial_success
            if partial.rejected_data_points or partial.error_message:
                self._on_partial(partial.rejected_data_points, partial.error_message)
        return response


def _version() -> str:
    try:
        return version("hami-usage")
    except PackageNotFoundError:  # a source tree that was not installed
        return "unknown"


def _metrics_url(endpoint: str) -> str:
    """A base URL (no path) gets the OTLP/HTTP metrics path; any other path is kept."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"OTLP endpoint must be an http(s) URL, got {endpoint!r}")
    if parts.path in ("", "/"):
        parts = parts._replace(path="/v1/metrics")
    return urlunsplit(parts)


class _OnDemandReader(MetricReader):
    """A reader that exports only when :meth:`flush` is called and reports whether it worked.

    (``PeriodicExportingMetricReader.force_flush`` always returns True, even when the export
    failed, so it cannot tell the caller that the collector is down.)
    """

    def __init__(self, exporter: MetricExporter, max_series: int) -> None:
        super().__init__(
            preferred_temporality=_CUMULATIVE,
            cardinality_limits={ObservableCounter: max_series, ObservableGauge: max_series},
        )
        self._exporter = exporter
        self._result: MetricExportResult | None = None
        self.overflow = False
        self.started_ns = time.time_ns()  # what the counters count since

    def _receive_metrics(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> None:
        self.overflow = self.overflow or _has_overflow(metrics_data)
        token = attach(set_value(_SUPPRESS_INSTRUMENTATION_KEY, True))
        try:
            metrics_data = _counting_since(metrics_data, self.started_ns)
            self._result = self._exporter.export(metrics_data, timeout_millis=timeout_millis)
        except Exception:
            _log.exception("OTLP metric export raised")
            self._result = MetricExportResult.FAILURE
        finally:
            detach(token)

    def flush(self) -> bool:
        self._result = None
        # Collecting is local work (the callbacks and the SDK's aggregation, about 15 us a
        # point): bounded by the request timeout, every push failed past ~75 000 series.
        # The exporter bounds its requests by its own timeout.
        self.collect(timeout_millis=math.inf)
        # None: nothing was collected, so nothing needed sending.
        return self._result is not MetricExportResult.FAILURE

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self._exporter.shutdown(timeout_millis=timeout_millis)


def _counting_since(metrics_data: MetricsData, started_ns: int) -> MetricsData:
    """`metrics_data` with every counter point's start time `started_ns`. The totals count
    every window since the exporter was made, but the SDK starts a series at the collection
    that first observes it: its first point, holding windows already closed, started a
    millisecond before it (a rate of 149 GPU-seconds in 1 ms; Prometheus drops a created
    timestamp not before its sample's)."""

    def started(m: Any) -> Any:
        if not isinstance(m.data, Sum):
            return m
        points = [replace(p, start_time_unix_nano=started_ns) for p in m.data.data_points]
        return replace(m, data=replace(m.data, data_points=points))

    resources = [
        replace(rm, scope_metrics=[
            replace(sm, metrics=[started(m) for m in sm.metrics]) for sm in rm.scope_metrics
        ])
        for rm in metrics_data.resource_metrics
    ]  # fmt: skip
    return replace(metrics_data, resource_metrics=resources)


def _has_overflow(metrics_data: MetricsData) -> bool:
    for rm in metrics_data.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                for point in getattr(metric.data, "data_points", ()):
                    if point.attributes and point.attributes.get(_OVERFLOW_ATTRIBUTE):
                        return True
    return False


def _instance_from_env() -> str:
    """`service.instance.id` as `OTEL_RESOURCE_ATTRIBUTES` sets it, or "". The resource's own
    value would win over the variable's, so the host name was the id even where the operator
    named each replica: two replicas on one host then wrote the same series, the old owner of a
    partition its frozen totals between the new owner's (the backend counted resets)."""
    value = OTELResourceDetector().detect().attributes.get("service.instance.id", "")
    return value if isinstance(value, str) else ""


class OtlpExporter:
    """Exports billing-window counters and current gauges over OTLP/HTTP (protobuf).

    Thread-safe. ``flush`` blocks the calling thread for about ``timeout_s`` per request at
    most while the collector answers at a normal pace (the exporter retries connection errors
    and 429/502/503/504 with back-off inside that budget); ``push`` runs it on a thread of its
    own, which is what async code calls.

    :param endpoint: the collector's OTLP/HTTP base URL (``http://collector:4318``, to which
        ``/v1/metrics`` is appended) or full metrics URL (any URL with a non-root path).
    :param service_instance: ``service.instance.id``; default: ``OTEL_RESOURCE_ATTRIBUTES``'s,
        else the host name (the pod name).
    :param timeout_s: bound of one request (connect + send + retries; `requests` bounds each
        read of the answer by it, not the whole answer).
    :param headers: extra HTTP headers (e.g. authorization).
    :param compression: ``none`` (default), ``gzip`` or ``deflate`` request bodies.
    :param max_series: most attribute sets per metric kept over the exporter's lifetime (the
        cumulative counters remember every container ever seen); beyond it the SDK folds new
        series into one ``otel.metric.overflow=true`` series -- logged once as an error and
        visible as ``overflowed``.
    :param dedupe_capacity: how many ``record_id`` values are remembered for de-duplication.
    :param push_interval_s: least time from one push's start to the next's.
    :param push_share: most share of the time pushes take: the next push starts no sooner than
        the last one's duration / ``push_share`` after it started. A push costs about 35 µs of
        CPU a point (9 a container series: 3 s at 10 000 series, 40 s at 100 000), and the
        aggregator pushes at each commit (every 5 s at most): unpaced, pushes took most of a
        core from the consumer past a few thousand series.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        service_instance: str = "",
        timeout_s: float = 10,
        headers: dict[str, str] | None = None,
        compression: Literal["none", "gzip", "deflate"] = "none",
        max_series: int = 100_000,
        dedupe_capacity: int = 100_000,
        push_interval_s: float = 10.0,
        push_share: float = 0.2,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")
        if compression not in _COMPRESSION:
            raise ValueError(f"compression must be one of {sorted(_COMPRESSION)}")
        self.endpoint = _metrics_url(endpoint)
        self.timeout_s = float(timeout_s)
        self.service_instance = service_instance or _instance_from_env() or socket.gethostname()
        self.failed_exports = 0
        self.successful_exports = 0
        self.duplicate_records = 0
        self.rejected_values = 0
        self.rejected_series = 0  # records with an attribute over MAX_ATTRIBUTE_CHARS
        self.rejected_points = 0  # points the backend answered it rejected (partial success)
        self._partial_now: list[tuple[int, str]] = []  # this push's partial answers

        self._exporter = OTLPMetricExporter(
            endpoint=self.endpoint,
            headers=dict(headers or {}),
            timeout=self.timeout_s,
            compression=_COMPRESSION[compression],
            session=_Session(self._partial),
            preferred_temporality=_CUMULATIVE,
            max_export_batch_size=MAX_POINTS_PER_REQUEST,
        )
        self._reader = _OnDemandReader(self._exporter, max_series)
        self._provider = MeterProvider(
            resource=Resource.create(
                {
                    "service.name": SERVICE_NAME,
                    "service.version": _version(),
                    "service.instance.id": self.service_instance,
                }
            ),
            metric_readers=[self._reader],
            shutdown_on_exit=False,
        )
        meter = self._provider.get_meter("hami-usage", _version())
        # Exact totals per counter and series, observed at each flush: adding each record's
        # value as a float would round once per record, and the counter would drift from the
        # sum of the records' integrals (52 746 byte-seconds over a month of one 79 GiB
        # container); a total is rounded once, when it is sent.
        # At most max_series of them a counter, and the rest summed as the SDK would fold them
        # (`_OVERFLOW_SERIES`): kept for every series ever seen, they grew without bound.
        self._totals: tuple[dict[_Series, Decimal], ...] = tuple({} for _ in COUNTERS)
        self._max_series = max_series
        for c, totals in zip(COUNTERS, self._totals, strict=True):
            meter.create_observable_counter(
                c.name, callbacks=[self._counter_callback(c, totals)], unit=c.unit,
                description=c.description,
            )  # fmt: skip
        self._gauges: tuple[Gauge, ...] = ()
        for g in GAUGES:
            meter.create_observable_gauge(
                g.name, callbacks=[self._gauge_callback(g)], unit=g.unit, description=g.description
            )

        self._lock = threading.Lock()  # record_window bookkeeping
        self._flush_lock = threading.Lock()  # one export at a time
        self._seen: OrderedDict[str, None] = OrderedDict()  # recent record ids, oldest first
        self._dedupe_capacity = max(0, dedupe_capacity)
        self._closed = False
        self._overflow_logged = False
        self._pushing: threading.Thread | None = None
        self.pushes_skipped = 0  # pushes not started because the one before was still running
        self._stall_logged = False
        self._push_interval_s = push_interval_s
        self._push_share = push_share
        self._next_push_at = 0.0  # time.monotonic() before which `push` defers
        self.last_push_unfinished = False  # shutdown stopped waiting for the last push

    @property
    def overflowed(self) -> bool:
        """True once some metric exceeded ``max_series`` attribute sets."""
        return self._reader.overflow

    # -- counters -------------------------------------------------------------------------

    def record_window(self, records: Sequence[BillingRecord]) -> None:
        """Add closed-window records to the cumulative counters (sent at the next ``flush``)."""
        if self._closed:
            _log.warning("OtlpExporter is shut down; %d records not recorded", len(records))
            return
        with self._lock:
            for rec in records:
                self._record(rec)

    def _record(self, rec: BillingRecord) -> None:
        if rec.kind in ("gpu", "idle"):
            # A GPU's own rows have the node row's attributes: they would add to its series.
            return
        record_id = rec.record_id
        if record_id and record_id in self._seen:
            self.duplicate_records += 1
            _log.debug("record %s already exported, ignored", record_id)
            return
        attrs = _record_attributes(rec)
        if not _sendable(attrs):
            self.rejected_series += 1
            if self.rejected_series == 1:
                _log.warning(
                    "not exporting record %.64s: an attribute is longer than %d characters "
                    "(counted in rejected_series, logged once)", record_id, MAX_ATTRIBUTE_CHARS
                )  # fmt: skip
            return
        series: _Series = tuple(attrs.items())
        for instrument, totals in zip(COUNTERS, self._totals, strict=True):
            value = Decimal(getattr(rec, instrument.field))
            if not value.is_finite() or value < 0:
                self.rejected_values += 1
                _log.warning(
                    "not exporting %s=%s of record %s (negative or not finite)",
                    instrument.field,
                    value,
                    record_id,
                )
            elif value > 0:
                key = series
                if key not in totals and len(totals) >= self._max_series + (
                    _OVERFLOW_SERIES in totals
                ):
                    key = _OVERFLOW_SERIES
                totals[key] = totals.get(key, _ZERO) + value
        if record_id and self._dedupe_capacity:
            self._seen[record_id] = None
            while len(self._seen) > self._dedupe_capacity:
                self._seen.popitem(last=False)

    # -- gauges ---------------------------------------------------------------------------

    def set_gauges(self, gauges: Iterable[Gauge]) -> None:
        """Replace the current gauge values (read at the next ``flush``)."""
        # (a gauge's attributes are its records': a rejected one is counted there)
        self._gauges = tuple(g for g in gauges if _sendable(_gauge_attributes(g)))

    def _gauge_callback(
        self, instrument: Instrument
    ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        field, percent = instrument.field, instrument.percent

        def callback(options: CallbackOptions) -> Iterable[Observation]:
            return [
                Observation(
                    getattr(g, field) / 100 if percent else int(getattr(g, field)),
                    _gauge_attributes(g),
                )
                for g in self._gauges
            ]

        return callback

    def _counter_callback(
        self, instrument: Instrument, totals: dict[_Series, Decimal]
    ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        shift = -2 if instrument.percent else 0

        def callback(options: CallbackOptions) -> Iterable[Observation]:
            with self._lock:  # (record_window adds on the event loop's thread)
                now = list(totals.items())
            # scaleb: an exact division by 100; float(): the one rounding, to the nearest
            return [Observation(float(total.scaleb(shift)), dict(series)) for series, total in now]

        return callback

    # -- export ---------------------------------------------------------------------------

    def flush(self) -> bool:
        """Collect and export now; True if accepted (or nothing to send). Never raises.

        A failure is logged and counted in ``failed_exports``; nothing is lost (the counters
        are cumulative, the next successful flush carries the totals).
        """
        if self._closed:
            return False
        started = time.monotonic()
        with self._flush_lock:
            self._partial_now = []
            try:
                ok = self._reader.flush()
            except Exception:
                _log.exception("OTLP metric collection failed")
                ok = False
            if ok:
                self.successful_exports += 1
            else:
                self.failed_exports += 1
            partial = self._partial_now
            took = time.monotonic() - started
            self._next_push_at = started + max(self._push_interval_s, took / self._push_share)
            if self._reader.overflow and not self._overflow_logged:
                self._overflow_logged = True
                _log.error(
                    "more than max_series attribute sets on a metric: new series are merged "
                    "into otel.metric.overflow=true; raise max_series or restart the aggregator"
                )
        if partial:
            rejected = sum(n for n, _ in partial)
            self.rejected_points += rejected
            _log.warning(
                "the OTLP backend at %s rejected %d points of this push (%d so far; not "
                "retried, as OTLP asks): %s",
                self.endpoint,
                rejected,
                self.rejected_points,
                "; ".join(sorted({m for _, m in partial if m})) or "no reason given",
            )
        if not ok:
            _log.warning(
                "OTLP metric export to %s failed after %.1fs (%d failures so far)",
                self.endpoint,
                time.monotonic() - started,
                self.failed_exports,
            )
        return ok

    def _partial(self, rejected: int, message: str) -> None:
        """A request of the running flush was answered with a partial success (the SDK's
        thread, within `_flush_lock`)."""
        self._partial_now.append((rejected, one_line(message[:500])))

    def push(self, *, paced: bool = True) -> bool:
        """Start a flush on a daemon thread of its own and return at once: the caller (the
        aggregator's event loop) never waits for the collector. `requests` bounds each read of
        an answer, not the answer, so a collector or proxy that answers a byte at a time holds
        a flush as long as it likes: while one runs, no second one starts (the next carries the
        totals: the counters are cumulative); skipped pushes are counted and logged once per
        stall. `paced`: not before `push_interval_s` and `push_share` allow (a push deferred so
        is not counted: the next carries its totals). False when skipped, deferred or shut
        down."""
        if self._closed:
            return False
        running = self._pushing
        if running is not None and running.is_alive():
            self.pushes_skipped += 1
            if not self._stall_logged:
                self._stall_logged = True
                _log.warning(
                    "an OTLP push to %s is still running; later pushes wait for it (%d skipped)",
                    self.endpoint,
                    self.pushes_skipped,
                )
            return False
        self._stall_logged = False
        if paced and time.monotonic() < self._next_push_at:
            return False
        self._pushing = threading.Thread(target=self.flush, name="otlp-push", daemon=True)
        self._pushing.start()
        return True

    def shutdown(self) -> None:
        """Push once more, waiting for that and any push still running at most 2 x
        `timeout_s` in all, then release the HTTP connection. Idempotent; never raises; never
        waits for a push that does not end."""
        if self._closed:
            return
        deadline = time.monotonic() + 2 * self.timeout_s
        finished = (
            self._await_push(deadline) and self.push(paced=False) and self._await_push(deadline)
        )
        self._closed = True
        if not finished:
            self.last_push_unfinished = True
            _log.warning(
                "the last OTLP push to %s did not finish in %.0fs: not waiting for it",
                self.endpoint,
                2 * self.timeout_s,
            )
            return
        try:
            self._provider.shutdown(timeout_millis=self.timeout_s * 1000)
        except Exception:
            _log.exception("OTLP meter provider shutdown failed")

    def summary(self) -> str:
        """What was exported and what went wrong, for the aggregator's summary line (after
        `shutdown`): `otlp: exports=12 failed_exports=2`, the counts that are not 0."""
        counts = {
            "failed_exports": self.failed_exports,
            "pushes_skipped": self.pushes_skipped,
            "duplicate_records": self.duplicate_records,
            "rejected_values": self.rejected_values,
            "rejected_series": self.rejected_series,
            "rejected_points": self.rejected_points,
            "overflowed": int(self.overflowed),
            "last_push_unfinished": int(self.last_push_unfinished),
        }
        parts = [f"exports={self.successful_exports + self.failed_exports}"]
        parts += [f"{k}={v}" for k, v in counts.items() if v]
        return "otlp: " + " ".join(parts)

    def _await_push(self, deadline: float) -> bool:
        """Wait for the running push (if any) until `deadline`; True when none runs."""
        running = self._pushing
        if running is not None:
            running.join(max(0.0, deadline - time.monotonic()))
        return running is None or not running.is_alive()

    def __enter__(self) -> OtlpExporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _record_attributes(rec: BillingRecord) -> dict[str, str]:
    attrs = {
        ATTR_NODE: rec.node,
        ATTR_POD_UID: rec.pod_uid,
        ATTR_CONTAINER: rec.container,
        ATTR_GPU_UUID: rec.device_uuid,
        ATTR_HW_TYPE: "gpu",
    }
    if rec.namespace:
        attrs[ATTR_NAMESPACE] = rec.namespace
    if rec.pod:
        attrs[ATTR_POD_NAME] = rec.pod
    workload = ATTR_WORKLOAD.get(rec.workload_kind)
    if workload is not None and rec.workload:
        attrs[workload] = rec.workload
    return attrs


def _sendable(attrs: dict[str, str]) -> bool:
    return all(len(v) <= MAX_ATTRIBUTE_CHARS for v in attrs.values())


def _gauge_attributes(g: Gauge) -> dict[str, str]:
    return {
        ATTR_NODE: g.node,
        ATTR_POD_UID: g.pod_uid,
        ATTR_CONTAINER: g.container,
        ATTR_GPU_UUID: g.device_uuid,
        ATTR_HW_TYPE: "gpu",
    }
