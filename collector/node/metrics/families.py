"""One scrape: the catalog's metrics computed from the last scan, as prometheus_client families."""

from __future__ import annotations

import platform
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ...events import ContainerState, DeviceLimit, UsageRow
from ..nvml import NvmlDevice
from . import catalog

Published = list[tuple[ContainerState, int | None]]
# pod UID -> (namespace, pod name), or None while unknown. The collector knows only the UID
# (from the folder name); Kubernetes names come from whoever resolves them.
PodNames = Callable[[str], tuple[str, str] | None]
HAMI_ZONE = "vGPU"  # HAMi registers its monitor's metrics with this `zone` label


def _no_names(pod_uid: str) -> None:
    return None


try:
    VERSION = version("hami-usage")
except PackageNotFoundError:  # running from a source tree that was not installed
    VERSION = "unknown"


@dataclass(frozen=True)
class Health:
    scans: int
    last_scan_ms: float
    files: int
    anomalies: int
    events: int
    appended: int
    dropped: int
    spool_depth: int
    seconds_since_scan: float
    log_blocked: str | None = None  # why the local log refuses events now (an episode)
    log_blocked_episodes: int = 0
    log_write_errors: int = 0
    kafka_too_large: int = 0  # spooled events over the producer's max_request_size, skipped
    spool_read_errors: int = 0  # the Kafka forwarder's failed reads of the spool (retried)
    kafka_unstamped: int = 0  # events sent with the send time: the broker refused their own
    spool_unreadable: str | None = None  # why the forwarder cannot read the spool now
    forwarder_stopped: str | None = None  # what ended the Kafka forwarder (a bug)
    watch_stopped: str | None = None  # what ended the pod watch (a bug)
    clock_steps: int = 0  # steps of the wall clock absorbed (node/clock.py)
    clock_offset_ms: int = 0  # wall clock - event time as of the last step
    kube: KubeHealth | None = None  # None: the pod watch is off
    # Times Kafka refused the collector (credentials, certificate, ACL), by reason.
    kafka_refused: Mapping[str, int] = field(default_factory=dict)

    @property
    def log_blocked_now(self) -> int:
        return int(self.log_blocked is not None)


@dataclass(frozen=True)
class KubeHealth:
    """The pod watch's state (collector/node/podwatch.py), and the names it gave."""

    unnamed_containers: int  # tracked containers whose pod is not known
    stale_containers: int  # folders whose container terminated: not tracked, not billed
    connected: int  # 1 while the watch is connected
    watch_events: int
    bookmarks: int
    lists: int
    relists: int  # after 410 Gone
    errors: int
    auth_errors: int  # 401/403
    throttled: int  # 429
    owner_errors: int


@dataclass(frozen=True)
class ContainerDevice:
    """One container on one of its devices: what the container-scope metrics read."""

    used: int
    limit: int
    context: int
    module: int
    data: int
    sm_util: int  # percent
    sm_limit: int  # percent
    last_kernel_age: int | None
    processes: int


@dataclass(frozen=True)
class Scrape:
    published: Published
    health: Health
    devices: Mapping[int, NvmlDevice]  # the GPUs NVML read this interval, by index
    node: str
    now_s: float
    pod_names: PodNames = _no_names
    hami: bool = False
    legacy: bool = False


@dataclass
class _Container:
    """The published states of one (pod uid, container) together: a folder can hold more than
    one cache file (one left by an earlier run next to the new one), and a series must be one
    per label set, so their rows are summed; the device table is the first file's."""

    pod_uid: str
    container: str
    devices: dict[int, DeviceLimit] = field(default_factory=dict)
    rows: list[UsageRow] = field(default_factory=list)
    last_kernel: int | None = None


def _containers(published: Published) -> Iterator[_Container]:
    merged: dict[tuple[str, str], _Container] = {}
    for state, last_kernel in published:
        key = (state.pod_uid, state.container)
        c = merged.get(key)
        if c is None:
            c = merged[key] = _Container(*key)
        for dev in state.devices:
            c.devices.setdefault(dev.index, dev)
        c.rows += state.rows
        if last_kernel and (c.last_kernel is None or last_kernel > c.last_kernel):
            c.last_kernel = last_kernel
    return iter(merged.values())


def _container_series(
    scrape: Scrape,
) -> Iterator[tuple[catalog.Scope, dict[str, str], ContainerDevice]]:
    migs = {m.uuid: (d, m) for d in scrape.devices.values() for m in d.mig_devices}
    containers = list(_containers(scrape.published))
    names = {c.pod_uid: scrape.pod_names(c.pod_uid) for c in containers}
    # HAMi's label sets name a pod without its UID: two pods of one name on the node (a
    # StatefulSet pod force-deleted while its processes run on, and its replacement) would
    # be one label set twice, which a scraper keeps one of.
    uids_of: dict[tuple[str, str], set[str]] = {}
    for uid, name in names.items():
        if name:
            uids_of.setdefault(name, set()).add(uid)
    for state in containers:
        last_kernel = state.last_kernel
        name = names[state.pod_uid]
        namespace, pod = name if name else ("", "")
        hami_pod = pod if name and len(uids_of[name]) == 1 else state.pod_uid
        for dev in state.devices.values():
            rows = [r for r in state.rows if r.device == dev.index]
            context = {
                "namespace": namespace,
                "pod": pod,
                "pod_or_uid": hami_pod,
                "pod_uid": state.pod_uid,
                "container": state.container,
                "device_index": str(dev.index),
                "device_uuid": dev.uuid,
                "zone": HAMI_ZONE,
            }
            values = ContainerDevice(
                used=sum(r.total for r in rows),
                limit=dev.limit_bytes,
                context=sum(r.context for r in rows),
                module=sum(r.module for r in rows),
                data=sum(r.data for r in rows),
                sm_util=sum(r.sm_util for r in rows),
                sm_limit=dev.sm_limit,
                last_kernel_age=max(0, int(scrape.now_s) - last_kernel) if last_kernel else None,
                # With memory on this device: a process of a two-GPU container that uses only
                # one still has a row (of zeros) on the other. By host pid too: each run of a
                # container numbers its processes from 1, and its files sit side by side.
                processes=len({(r.pid, r.hostpid) for r in rows if r.total > 0}),
            )
            # HAMi's legacy memory metric spells the breakdown out in labels.
            context["context_bytes"] = str(values.context)
            context["module_bytes"] = str(values.module)
            context["data_bytes"] = str(values.data)
            context["offset_bytes"] = str(
                values.used - values.context - values.module - values.data
            )
            yield "container", context, values
            if dev.uuid in migs:
                parent, mig = migs[dev.uuid]
                yield (
                    "mig",
                    {
                        **context,
                        "parent_uuid": parent.uuid,
                        # NVML's name of a MIG device ends in its profile: "... MIG 3g.40gb".
                        "profile": mig.name.rpartition(" MIG ")[2] if " MIG " in mig.name else "",
                        # Not known without HAMi's allocation annotation on the pod.
                        "gpu_instance_id": "",
                        "compute_instance_id": "",
                    },
                    values,
                )


def _gpu_series(scrape: Scrape) -> Iterator[tuple[dict[str, str], NvmlDevice]]:
    for index, dev in sorted(scrape.devices.items()):
        yield (
            {
                "node": scrape.node,
                "device_index": str(index),
                "device_uuid": dev.uuid,
                "device_name": dev.name,
                "device_type": f"NVIDIA-{dev.name}",  # as HAMi labels it
                "zone": HAMI_ZONE,
            },
            dev,
        )


def _build_context() -> dict[str, str]:
    return {
        "version": VERSION,
        "build_date": "unknown",
        "revision": "unknown",
        "compiler": platform.python_implementation().lower(),
        "go_version": f"python{sys.version_info.major}.{sys.version_info.minor}",
        "platform": f"{sys.platform}/{platform.machine()}",
        "zone": HAMI_ZONE,
    }


def selected(scrape: Scrape) -> Sequence[catalog.Metric]:
    own = catalog.OWN
    if scrape.health.kube is None:  # no pod watch: no families of it, not even empty ones
        own = tuple(m for m in own if m.scope != "kube")
    return (
        *own,
        *(catalog.HAMI if scrape.hami else ()),
        *(catalog.LEGACY if scrape.legacy else ()),
    )


def families(scrape: Scrape) -> list[Metric]:
    metrics = selected(scrape)
    out: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
    for m in metrics:
        if m.kind == "counter":
            out[m.name] = CounterMetricFamily(m.name, m.help, labels=m.label_names)
        else:
            out[m.name] = GaugeMetricFamily(m.name, m.help, labels=m.label_names)

    def add(scope: catalog.Scope, context: dict[str, str], source: object) -> None:
        for m in metrics:
            if m.scope == scope:
                value = m.value(source)
                if value is not None:
                    out[m.name].add_metric(m.label_values(context), value)

    for scope, context, values in _container_series(scrape):
        add(scope, context, values)
    for context, dev in _gpu_series(scrape):
        add("gpu", context, dev)
    add("health", {}, scrape.health)
    for reason in REFUSAL_REASONS:  # every reason from the start: a counter that exists at 0
        add("kafka", {"reason": reason}, _Count(scrape.health.kafka_refused.get(reason, 0)))
    if scrape.health.kube is not None:
        add("kube", {}, scrape.health.kube)
    add("build", _build_context(), None)
    return list(out.values())


REFUSAL_REASONS = ("authentication", "certificate", "tls", "authorization")


@dataclass(frozen=True)
class _Count:
    count: int


class ScrapeCollector(Collector):
    """A prometheus_client collector over the latest scrape state."""

    def __init__(self, scrape: Callable[[], Scrape]) -> None:
        self._scrape = scrape

    def collect(self) -> Iterable[Metric]:
        return families(self._scrape())
