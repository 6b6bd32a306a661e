"""Every metric the collector's `/metrics` can serve, declared once: name, type, unit, labels,
help and where its value comes from. The README's metrics tables are checked against this.

Three sets:
* `OWN` (always): `hami_usage_*`, names that cannot collide with HAMi's own monitor on the same
  cluster; ratios are 0-1 as Prometheus' conventions want.
* `HAMI` (`--metrics-hami`): HAMi's vGPU monitor's current set, same names, labels and value
  scales (its `_ratio` metrics are 0-100), with the `zone="vGPU"` label HAMi wraps them in, so a
  cluster can replace HAMi's monitor with the collector and keep its dashboards.
* `LEGACY` (`--metrics-hami-legacy`): the names HAMi served before it renamed them (and still
  serves behind its own `--legacy-metrics`).

A label is `name` (its value is the context's value of that name) or `name:source` (the value of
`source`): HAMi's `pod` is the pod's name, or its UID while the name is unknown.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["gauge", "counter"]
Scope = Literal["container", "gpu", "mig", "health", "kafka", "kube", "build"]


@dataclass(frozen=True)
class Metric:
    name: str  # as exposed; a counter's ends in _total
    kind: Kind
    unit: str  # bytes, seconds, ratio, percent, events, ... ("" for info metrics)
    scope: Scope  # what one series describes: its context
    labels: tuple[str, ...]
    help: str
    value: Callable[[Any], float | None]  # None: no series for this context

    @property
    def label_names(self) -> tuple[str, ...]:
        return tuple(label.split(":")[0] for label in self.labels)

    def label_values(self, context: dict[str, str]) -> list[str]:
        return [context[label.split(":")[-1]] for label in self.labels]


def _get(field: str, scale: float = 1.0) -> Callable[[Any], float | None]:
    def value(ctx: Any) -> float | None:
        raw = getattr(ctx, field)
        return None if raw is None else raw * scale

    return value


def _one(ctx: Any) -> float:
    return 1.0


# fmt: off
_CTR = ("namespace", "pod", "pod_uid", "container", "device_index", "device_uuid")
_GPU = ("device_index", "device_uuid", "device_name")

OWN: tuple[Metric, ...] = (
    Metric(
        "hami_usage_container_memory_used_bytes", "gauge", "bytes", "container", _CTR,
        "GPU memory HAMi accounts to the container on the device (sum of its processes' totals)",
        _get("used"),
    ),
    Metric(
        "hami_usage_container_memory_limit_bytes", "gauge", "bytes", "container", _CTR,
        "GPU memory limit of the container on the device", _get("limit"),
    ),
    Metric(
        "hami_usage_container_memory_context_bytes", "gauge", "bytes", "container", _CTR,
        "CUDA context memory of the container on the device", _get("context"),
    ),
    Metric(
        "hami_usage_container_memory_module_bytes", "gauge", "bytes", "container", _CTR,
        "CUDA module memory of the container on the device", _get("module"),
    ),
    Metric(
        "hami_usage_container_memory_buffer_bytes", "gauge", "bytes", "container", _CTR,
        "CUDA buffer (data) memory of the container on the device", _get("data"),
    ),
    Metric(
        "hami_usage_container_sm_utilization_ratio", "gauge", "ratio", "container", _CTR,
        "SM utilisation of the container on the device, 0-1 (1 = all SMs of the GPU)",
        _get("sm_util", 0.01),
    ),
    Metric(
        "hami_usage_container_sm_limit_ratio", "gauge", "ratio", "container", _CTR,
        "SM limit of the container on the device, 0-1 (0: no limit)", _get("sm_limit", 0.01),
    ),
    Metric(
        "hami_usage_container_last_kernel_age_seconds", "gauge", "seconds", "container", _CTR,
        "seconds since the container last launched a kernel (absent: none yet)",
        _get("last_kernel_age"),
    ),
    Metric(
        "hami_usage_container_processes", "gauge", "processes", "container", _CTR,
        "processes (pid and host pid) of the container with memory on the device",
        _get("processes"),
    ),
    Metric(
        "hami_usage_gpu_memory_used_bytes", "gauge", "bytes", "gpu", _GPU,
        "GPU memory in use on the device, per NVML", _get("memory_used"),
    ),
    Metric(
        "hami_usage_gpu_memory_total_bytes", "gauge", "bytes", "gpu", _GPU,
        "GPU memory of the device, per NVML", _get("memory_total"),
    ),
    Metric(
        "hami_usage_gpu_utilization_ratio", "gauge", "ratio", "gpu", _GPU,
        "GPU utilisation of the device per NVML, 0-1 (absent in MIG mode)",
        _get("utilization_gpu", 0.01),
    ),
    Metric(
        "hami_usage_scans_total", "counter", "scans", "health", (),
        "scans of the cache files done", _get("scans"),
    ),
    Metric(
        "hami_usage_scan_duration_seconds", "gauge", "seconds", "health", (),
        "duration of the last scan", _get("last_scan_ms", 0.001),
    ),
    Metric(
        "hami_usage_files", "gauge", "files", "health", (),
        "cache files tracked", _get("files"),
    ),
    Metric(
        "hami_usage_anomalies_total", "counter", "events", "health", (),
        "anomaly events emitted", _get("anomalies"),
    ),
    Metric(
        "hami_usage_events_total", "counter", "events", "health", (),
        "events appended to the local log", _get("appended"),
    ),
    Metric(
        "hami_usage_events_dropped_total", "counter", "events", "health", (),
        "events the local log refused (disk full, I/O error, size bound)", _get("dropped"),
    ),
    Metric(
        "hami_usage_spool_depth", "gauge", "events", "health", (),
        "events in the local log not yet acknowledged by Kafka", _get("spool_depth"),
    ),
    Metric(
        "hami_usage_log_blocked", "gauge", "", "health", (),
        "1 while the local log refuses events (disk full, I/O error, size bound)",
        _get("log_blocked_now"),
    ),
    Metric(
        "hami_usage_log_blocked_episodes_total", "counter", "episodes", "health", (),
        "episodes in which the local log refused events", _get("log_blocked_episodes"),
    ),
    Metric(
        "hami_usage_log_write_errors_total", "counter", "errors", "health", (),
        "failed writes to the local log (each retried)", _get("log_write_errors"),
    ),
    Metric(
        "hami_usage_kafka_too_large_total", "counter", "events", "health", (),
        "spooled events larger than a Kafka request may carry, skipped (each a sequence gap "
        "the aggregator reports)",
        _get("kafka_too_large"),
    ),
    Metric(
        "hami_usage_kafka_unstamped_total", "counter", "events", "health", (),
        "events sent stamped with the send time because Kafka refused their own time as too far "
        "ahead of its clock (a node clock stepped back by more than the topic's "
        "message.timestamp.after.max.ms, an hour by default); the aggregator refuses them as "
        "future events",
        _get("kafka_unstamped"),
    ),
    Metric(
        "hami_usage_spool_read_errors_total", "counter", "errors", "health", (),
        "failed reads of the spool by the Kafka forwarder (out of descriptors, an I/O error; "
        "each retried, the events stay spooled)",
        _get("spool_read_errors"),
    ),
    Metric(
        "hami_usage_kafka_refused_total", "counter", "refusals", "kafka", ("reason",),
        "times Kafka refused the collector, which retries: reason authentication (credentials), "
        "certificate (broker not trusted), tls (handshake refused), authorization (an ACL)",
        _get("count"),
    ),
    Metric(
        "hami_usage_unnamed_containers", "gauge", "containers", "kube", (),
        "containers tracked whose pod the pod watch does not know (billed without a namespace)",
        _get("unnamed_containers"),
    ),
    Metric(
        "hami_usage_stale_containers", "gauge", "containers", "kube", (),
        "cache folders whose container has terminated: not tracked, not billed",
        _get("stale_containers"),
    ),
    Metric(
        "hami_usage_kube_connected", "gauge", "", "kube", (),
        "1 while the pod watch is connected to the API server", _get("connected"),
    ),
    Metric(
        "hami_usage_kube_watch_events_total", "counter", "events", "kube", (),
        "pod watch events (ADDED, MODIFIED, DELETED)", _get("watch_events"),
    ),
    Metric(
        "hami_usage_kube_bookmarks_total", "counter", "events", "kube", (),
        "pod watch BOOKMARK events", _get("bookmarks"),
    ),
    Metric(
        "hami_usage_kube_lists_total", "counter", "requests", "kube", (),
        "complete lists of the node's pods", _get("lists"),
    ),
    Metric(
        "hami_usage_kube_relists_total", "counter", "requests", "kube", (),
        "lists again because the watch's resourceVersion was too old (410 Gone)",
        _get("relists"),
    ),
    Metric(
        "hami_usage_kube_errors_total", "counter", "requests", "kube", (),
        "failed API requests and dropped watches, all causes", _get("errors"),
    ),
    Metric(
        "hami_usage_kube_auth_errors_total", "counter", "requests", "kube", (),
        "API requests refused (401 Unauthorized, 403 Forbidden)", _get("auth_errors"),
    ),
    Metric(
        "hami_usage_kube_throttled_total", "counter", "requests", "kube", (),
        "API requests throttled (429, retried after Retry-After)", _get("throttled"),
    ),
    Metric(
        "hami_usage_kube_owner_errors_total", "counter", "requests", "kube", (),
        "failed reads of a ReplicaSet, Job or Namespace (names by convention meanwhile)",
        _get("owner_errors"),
    ),
    Metric(
        "hami_usage_clock_steps_total", "counter", "steps", "health", (),
        "steps of the wall clock seen and absorbed (event time keeps the monotonic clock)",
        _get("clock_steps"),
    ),
    Metric(
        "hami_usage_clock_offset_seconds", "gauge", "seconds", "health", (),
        "wall clock minus event time since the last step (0 until one)",
        _get("clock_offset_ms", 0.001),
    ),
    Metric(
        "hami_usage_build_info", "gauge", "", "build", ("version",),
        "hami-usage version, as a label; the value is 1", _one,
    ),
)

_HAMI_CTR = ("namespace", "pod:pod_or_uid", "container", "vdevice_index:device_index",
             "device_uuid", "zone")
_HAMI_HOST = ("node", "device_index", "device_uuid", "device_type", "zone")

HAMI: tuple[Metric, ...] = (
    Metric(
        "hami_host_gpu_memory_used_bytes", "gauge", "bytes", "gpu", _HAMI_HOST,
        "GPU device memory usage in bytes", _get("memory_used"),
    ),
    Metric(
        "hami_host_gpu_utilization_ratio", "gauge", "percent", "gpu", _HAMI_HOST,
        "GPU core utilization ratio (0-100)", _get("utilization_gpu"),
    ),
    Metric(
        "hami_host_gpu_memory_controller_utilization_ratio", "gauge", "percent", "gpu",
        ("device_index", "device_uuid", "device_type", "zone"),
        "GPU memory controller utilization ratio (0-100)", _get("utilization_memory"),
    ),
    Metric(
        "hami_vgpu_memory_used_bytes", "gauge", "bytes", "container", _HAMI_CTR,
        "vGPU device memory usage in bytes", _get("used"),
    ),
    Metric(
        "hami_vgpu_memory_limit_bytes", "gauge", "bytes", "container", _HAMI_CTR,
        "vGPU device memory limit in bytes", _get("limit"),
    ),
    Metric(
        "hami_container_device_memory_bytes", "gauge", "bytes", "container", _HAMI_CTR,
        "Container device memory usage in bytes", _get("used"),
    ),
    Metric(
        "hami_container_device_utilization_ratio", "gauge", "percent", "container", _HAMI_CTR,
        "Container device SM utilization ratio", _get("sm_util"),
    ),
    Metric(
        "hami_container_last_kernel_elapsed_seconds", "gauge", "seconds", "container",
        _HAMI_CTR, "Seconds since last kernel execution in container",
        _get("last_kernel_age"),
    ),
    Metric(
        "hami_mig_device_info", "gauge", "", "mig",
        ("namespace", "pod:pod_or_uid", "container", "vdevice_index:device_index",
         "device_uuid:parent_uuid", "mig_uuid:device_uuid", "profile", "gpu_instance_id",
         "compute_instance_id", "zone"),
        "MIG runtime identity for a container allocation", _one,
    ),
    Metric(
        "hami_vgpu_memory_context_bytes", "gauge", "bytes", "container", _HAMI_CTR,
        "Container device memory context size in bytes", _get("context"),
    ),
    Metric(
        "hami_vgpu_memory_module_bytes", "gauge", "bytes", "container", _HAMI_CTR,
        "Container device memory module size in bytes", _get("module"),
    ),
    Metric(
        "hami_vgpu_memory_buffer_bytes", "gauge", "bytes", "container", _HAMI_CTR,
        "Container device memory buffer size in bytes", _get("data"),
    ),
    Metric(
        "hami_build_info", "gauge", "", "build",
        ("build_date", "compiler", "go_version", "platform", "revision", "version"),
        "hami build metadata exposed as labels with a constant value of 1.", _one,
    ),
)

_LEGACY_CTR = ("podnamespace:namespace", "podname:pod_or_uid", "ctrname:container",
               "vdeviceid:device_index", "deviceuuid:device_uuid", "zone")
_LEGACY_HOST = ("nodeid:node", "deviceidx:device_index", "deviceuuid:device_uuid",
                "devicetype:device_type", "zone")

LEGACY: tuple[Metric, ...] = (
    Metric(
        "HostGPUMemoryUsage", "gauge", "bytes", "gpu", _LEGACY_HOST,
        "GPU device memory usage", _get("memory_used"),
    ),
    Metric(
        "HostCoreUtilization", "gauge", "percent", "gpu", _LEGACY_HOST,
        "GPU core utilization", _get("utilization_gpu"),
    ),
    Metric(
        "vGPU_device_memory_usage_in_bytes", "gauge", "bytes", "container", _LEGACY_CTR,
        "vGPU device usage", _get("used"),
    ),
    Metric(
        "vGPU_device_memory_limit_in_bytes", "gauge", "bytes", "container", _LEGACY_CTR,
        "vGPU device limit", _get("limit"),
    ),
    Metric(
        "Device_memory_desc_of_container", "gauge", "bytes", "container",
        (*_LEGACY_CTR, "context:context_bytes", "module:module_bytes", "data:data_bytes",
         "offset:offset_bytes"),
        "Container device memory description", _get("used"),
    ),
    Metric(
        "Device_utilization_desc_of_container", "gauge", "percent", "container", _LEGACY_CTR,
        "Container device utilization description", _get("sm_util"),
    ),
    Metric(
        "Device_last_kernel_of_container", "gauge", "seconds", "container", _LEGACY_CTR,
        "Container device last kernel description", _get("last_kernel_age"),
    ),
    Metric(
        "MigInfo", "gauge", "", "mig",
        (*_LEGACY_CTR[:4], "deviceuuid:parent_uuid", "instanceid:gpu_instance_id", "zone"),
        "Mig device information for container", _one,
    ),
)
# fmt: on
