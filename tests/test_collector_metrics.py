"""The collector's Prometheus endpoint over real HTTP: its own names, HAMi's (opt-in), HAMi's
legacy names (opt-in), /healthz, the bind address, and `promtool check metrics` on real scrapes."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pynvml
import pytest
from fake_nvml import FakeGpu, FakeMig, FakeNvml, nvml_error
from operator_tools import promtool_check_metrics
from prometheus_client.parser import text_string_to_metric_families

from collector.layout.declarations import V12
from collector.node import metrics
from collector.node.crosscheck import CrossCheck
from collector.node.metrics.families import VERSION
from collector.node.nvml import NvmlSource
from collector.node.service import Collector, CollectSettings
from collector.simulate import CacheWriter, GiB, MiB, SimDevice, new_cache_file
from collector.transport.kafka import ProducerSettings

GPU = "GPU-aaaaaaaa-bbbb-4ccc-8ddd-eeeeeeeeeeee"
GPU_MIG = "GPU-bbbbbbbb-bbbb-4ccc-8ddd-eeeeeeeeeeee"
MIG = "MIG-cccccccc-bbbb-4ccc-8ddd-eeeeeeeeeeee"
POD = "0b9d6c7e-1f2a-4b3c-9d4e-5f6a7b8c9d0e"
POD2 = "1b9d6c7e-1f2a-4b3c-9d4e-5f6a7b8c9d0e"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def get(port: int, path: str, host: str = "127.0.0.1", accept: str = "") -> tuple[int, str, str]:
    request = urllib.request.Request(f"http://{host}:{port}{path}")
    if accept:
        request.add_header("Accept", accept)
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read().decode()


def samples(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def names(text: str) -> set[str]:
    return {name for name, _ in samples(text)}


class Node:
    """Two cache files (one on a whole GPU, one on a MIG instance), a fake NVML, a collector."""

    def __init__(self, tmp_path: Path) -> None:
        root = tmp_path / "containers"
        self.writers: list[CacheWriter] = []
        w = new_cache_file(root, POD, "main", V12, [SimDevice(GPU, 8 * GiB, 40)])
        w.add_process(7, 4242)
        w.add_memory(7, 0, "context", 300 * MiB)
        w.add_memory(7, 0, "module", 20 * MiB)
        w.add_memory(7, 0, "data", GiB)
        w.watch({4242: {0: (GiB, 55)}})
        w.kernel_launched(1_000)
        self.writers.append(w)
        m = new_cache_file(root, POD2, "mig", V12, [SimDevice(MIG, 10 * GiB, 0)])
        m.add_process(9, 4343)
        m.add_memory(9, 0, "data", 2 * GiB)
        self.writers.append(m)
        self.fake = FakeNvml(
            gpus=[
                FakeGpu(GPU, memory_used=5 * GiB, utilization=37, memory_utilization=12),
                FakeGpu(GPU_MIG, migs=[FakeMig(MIG, 40 * GiB, 2 * GiB)]),
            ]
        )
        self.root = root

    def collector(self, tmp_path: Path, **settings: Any) -> Collector:
        collector = Collector(
            CollectSettings(
                root=self.root,
                node="n1",
                log_dir=tmp_path / "log",
                interval_s=0.1,
                nvml=False,
                metrics_port=0,
                **settings,
            )
        )
        source = NvmlSource.open(api_factory=lambda: self.fake)
        assert source is not None
        collector.scanner.crosscheck = CrossCheck(source)
        return collector

    def close(self) -> None:
        for w in self.writers:
            w.close()


Serve = Callable[..., Any]


@pytest.fixture
async def serve(tmp_path: Path) -> AsyncIterator[Serve]:
    node = Node(tmp_path)
    running: list[tuple[Collector, asyncio.Task[None]]] = []

    async def start(**settings: Any) -> Collector:
        collector = node.collector(tmp_path / str(len(running)), **settings)
        task = asyncio.create_task(collector.run())
        running.append((collector, task))
        while collector.scanner.stats.scans < 2:
            await asyncio.sleep(0.05)
        assert collector.metrics is not None
        return collector

    try:
        yield start
    finally:
        for collector, task in running:
            collector.stopping.set()
            await task
        node.close()


async def scrape(collector: Collector, accept: str = "") -> str:
    assert collector.metrics is not None
    status, content_type, body = await asyncio.to_thread(
        get, collector.metrics.port, "/metrics", "127.0.0.1", accept
    )
    assert status == 200
    return body


def own_labels(
    pod: str, pod_uid: str, container: str, uuid: str, index: int = 0
) -> frozenset[tuple[str, str]]:
    return frozenset(
        {
            "namespace": "" if not pod else "team-a",
            "pod": pod,
            "pod_uid": pod_uid,
            "container": container,
            "device_index": str(index),
            "device_uuid": uuid,
        }.items()
    )


async def test_own_names_by_default(serve: Serve) -> None:
    collector = await serve()
    body = await scrape(collector)
    got = samples(body)
    # Without a pod watch (no Kubernetes here) its metrics are not served at all.
    assert names(body) == {m.name for m in metrics.OWN if m.scope != "kube"}
    main = own_labels("", POD, "main", GPU)
    assert got[("hami_usage_container_memory_used_bytes", main)] == GiB + 320 * MiB
    assert got[("hami_usage_container_memory_limit_bytes", main)] == 8 * GiB
    assert got[("hami_usage_container_memory_context_bytes", main)] == 300 * MiB
    assert got[("hami_usage_container_memory_module_bytes", main)] == 20 * MiB
    assert got[("hami_usage_container_memory_buffer_bytes", main)] == GiB
    assert got[("hami_usage_container_sm_utilization_ratio", main)] == pytest.approx(0.55)
    assert got[("hami_usage_container_sm_limit_ratio", main)] == pytest.approx(0.40)
    assert got[("hami_usage_container_processes", main)] == 1
    assert got[("hami_usage_container_last_kernel_age_seconds", main)] > 0
    mig = own_labels("", POD2, "mig", MIG)
    assert got[("hami_usage_container_memory_used_bytes", mig)] == 2 * GiB
    # No kernel launched yet: no age series rather than a made-up one.
    assert ("hami_usage_container_last_kernel_age_seconds", mig) not in got
    gpu = frozenset(
        {"device_index": "0", "device_uuid": GPU, "device_name": "NVIDIA H100 80GB HBM3"}.items()
    )
    assert got[("hami_usage_gpu_memory_used_bytes", gpu)] == 5 * GiB
    assert got[("hami_usage_gpu_memory_total_bytes", gpu)] == 80 * GiB
    assert got[("hami_usage_gpu_utilization_ratio", gpu)] == pytest.approx(0.37)
    assert got[("hami_usage_files", frozenset())] == 2
    assert got[("hami_usage_events_dropped_total", frozenset())] == 0
    assert got[("hami_usage_scans_total", frozenset())] >= 2
    assert got[("hami_usage_build_info", frozenset({("version", VERSION)}))] == 1
    # Nothing of HAMi's: a cluster that runs HAMi's monitor too counts nothing twice.
    assert not any(n.startswith(("hami_vgpu", "hami_container", "hami_host")) for n in names(body))


async def test_kubernetes_names_fill_namespace_and_pod(serve: Serve) -> None:
    collector = await serve(metrics_hami=True)
    collector.pod_names = lambda uid: ("team-a", "trainer-0") if uid == POD else None
    got = samples(await scrape(collector))
    own = own_labels("trainer-0", POD, "main", GPU)
    assert got[("hami_usage_container_memory_used_bytes", own)] == GiB + 320 * MiB
    hami = {
        "namespace": "team-a",
        "pod": "trainer-0",
        "container": "main",
        "vdevice_index": "0",
        "device_uuid": GPU,
        "zone": "vGPU",
    }
    assert got[("hami_vgpu_memory_used_bytes", frozenset(hami.items()))] == GiB + 320 * MiB


async def test_hami_compatible_set(serve: Serve) -> None:
    collector = await serve(metrics_hami=True)
    body = await scrape(collector)
    got = samples(body)
    assert names(body) == {m.name for m in (*metrics.OWN, *metrics.HAMI) if m.scope != "kube"}
    labels = {
        "namespace": "",
        "pod": POD,  # the UID while the pod's name is unknown
        "container": "main",
        "vdevice_index": "0",
        "device_uuid": GPU,
        "zone": "vGPU",
    }
    ctr = frozenset(labels.items())
    assert got[("hami_vgpu_memory_used_bytes", ctr)] == GiB + 320 * MiB
    assert got[("hami_container_device_memory_bytes", ctr)] == GiB + 320 * MiB
    assert got[("hami_vgpu_memory_limit_bytes", ctr)] == 8 * GiB
    assert got[("hami_vgpu_memory_context_bytes", ctr)] == 300 * MiB
    assert got[("hami_vgpu_memory_module_bytes", ctr)] == 20 * MiB
    assert got[("hami_vgpu_memory_buffer_bytes", ctr)] == GiB
    assert got[("hami_container_device_utilization_ratio", ctr)] == 55  # HAMi's 0-100
    assert got[("hami_container_last_kernel_elapsed_seconds", ctr)] > 0
    host = {
        "node": "n1",
        "device_index": "0",
        "device_uuid": GPU,
        "device_type": "NVIDIA-NVIDIA H100 80GB HBM3",
        "zone": "vGPU",
    }
    assert got[("hami_host_gpu_memory_used_bytes", frozenset(host.items()))] == 5 * GiB
    assert got[("hami_host_gpu_utilization_ratio", frozenset(host.items()))] == 37
    del host["node"]
    key = ("hami_host_gpu_memory_controller_utilization_ratio", frozenset(host.items()))
    assert got[key] == 12
    mig = {
        "namespace": "",
        "pod": POD2,
        "container": "mig",
        "vdevice_index": "0",
        "device_uuid": GPU_MIG,
        "mig_uuid": MIG,
        "profile": "3g.40gb",
        "gpu_instance_id": "",
        "compute_instance_id": "",
        "zone": "vGPU",
    }
    assert got[("hami_mig_device_info", frozenset(mig.items()))] == 1
    (build,) = [labels for name, labels in got if name == "hami_build_info"]
    assert dict(build)["version"] == VERSION
    assert set(dict(build)) == {
        "build_date",
        "compiler",
        "go_version",
        "platform",
        "revision",
        "version",
    }


async def test_hami_legacy_names(serve: Serve) -> None:
    collector = await serve(metrics_hami_legacy=True)
    body = await scrape(collector)
    got = samples(body)
    assert names(body) == {m.name for m in (*metrics.OWN, *metrics.LEGACY) if m.scope != "kube"}
    legacy = {
        "podnamespace": "",
        "podname": POD,
        "ctrname": "main",
        "vdeviceid": "0",
        "deviceuuid": GPU,
        "zone": "vGPU",
    }
    assert got[("vGPU_device_memory_usage_in_bytes", frozenset(legacy.items()))] == GiB + 320 * MiB
    assert got[("vGPU_device_memory_limit_in_bytes", frozenset(legacy.items()))] == 8 * GiB
    assert got[("Device_utilization_desc_of_container", frozenset(legacy.items()))] == 55
    breakdown = {
        **legacy,
        "context": str(300 * MiB),
        "module": str(20 * MiB),
        "data": str(GiB),
        "offset": "0",
    }
    assert got[("Device_memory_desc_of_container", frozenset(breakdown.items()))] == GiB + 320 * MiB
    host = {
        "nodeid": "n1",
        "deviceidx": "0",
        "deviceuuid": GPU,
        "devicetype": "NVIDIA-NVIDIA H100 80GB HBM3",
        "zone": "vGPU",
    }
    assert got[("HostGPUMemoryUsage", frozenset(host.items()))] == 5 * GiB
    assert got[("HostCoreUtilization", frozenset(host.items()))] == 37
    mig = {
        "podnamespace": "",
        "podname": POD2,
        "ctrname": "mig",
        "vdeviceid": "0",
        "deviceuuid": GPU_MIG,
        "instanceid": "",
        "zone": "vGPU",
    }
    assert got[("MigInfo", frozenset(mig.items()))] == 1


async def test_promtool_accepts_own_and_hami_scrapes(serve: Serve) -> None:
    # promtool reads the text format (its 2.42 mistakes OpenMetrics' counters for unnamed ones).
    collector = await serve(metrics_hami=True)
    result = await asyncio.to_thread(promtool_check_metrics, await scrape(collector))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout + result.stderr == ""


async def test_promtool_on_legacy_names_finds_only_hamis_camel_case(serve: Serve) -> None:
    """HAMi's legacy names break Prometheus' naming rules; the lint says so, and nothing else."""
    collector = await serve(metrics_hami_legacy=True)
    result = await asyncio.to_thread(promtool_check_metrics, await scrape(collector))
    camel = " metric names should be written in 'snake_case' not 'camelCase'"
    assert result.returncode == 3  # promtool's "lint found problems"
    assert set(result.stderr.splitlines()) == {
        name + camel
        for name in (
            "HostGPUMemoryUsage",
            "HostCoreUtilization",
            "MigInfo",
            "vGPU_device_memory_usage_in_bytes",
            "vGPU_device_memory_limit_in_bytes",
        )
    }


async def test_content_negotiation(serve: Serve) -> None:
    collector = await serve()
    assert collector.metrics is not None
    port = collector.metrics.port
    _, plain, _ = await asyncio.to_thread(get, port, "/metrics")
    assert plain.startswith("text/plain; version=0.0.4")
    _, om, body = await asyncio.to_thread(
        get, port, "/metrics", "127.0.0.1", "application/openmetrics-text; version=1.0.0"
    )
    assert om.startswith("application/openmetrics-text")
    assert body.endswith("# EOF\n")


async def test_health(serve: Serve) -> None:
    collector = await serve()
    assert collector.metrics is not None
    port = collector.metrics.port
    assert (await asyncio.to_thread(get, port, "/healthz"))[0] == 200
    assert (await asyncio.to_thread(get, port, "/nope"))[0] == 404
    collector.metrics.stale_after_s = 0.0  # as if the scan loop had stopped
    assert (await asyncio.to_thread(get, port, "/healthz"))[0] == 503


async def test_bind_address(serve: Serve) -> None:
    collector = await serve(metrics_bind_address="127.0.0.2")
    assert collector.metrics is not None
    port = collector.metrics.port
    assert (await asyncio.to_thread(get, port, "/healthz", "127.0.0.2"))[0] == 200
    with pytest.raises(urllib.error.URLError):
        await asyncio.to_thread(get, port, "/healthz", "127.0.0.1")


async def scrape_root(root: Path, tmp_path: Path, writers: list[Any]) -> str:
    """/metrics of a collector of `root` after its second scan; the writers closed after."""
    collector = Collector(CollectSettings(root=root, node="n1", log_dir=tmp_path / "log",
                                          interval_s=0.1, nvml=False, metrics_port=0))  # fmt: skip
    task = asyncio.create_task(collector.run())
    try:
        while collector.scanner.stats.scans < 2:
            await asyncio.sleep(0.05)
        return await scrape(collector)
    finally:
        collector.stopping.set()
        await task
        for w in writers:
            w.close()


async def test_two_cache_files_of_one_container_are_one_series(tmp_path: Path) -> None:
    """A folder with a second cache file (one left by an earlier run next to the new one): one
    series per label set, the two files' memory summed (Prometheus drops a duplicate series'
    second sample as a duplicate)."""
    root = tmp_path / "containers"
    writers = [new_cache_file(root, POD, "main", V12, [SimDevice(GPU, 8 * GiB, 40)]) for _ in "ab"]
    for i, w in enumerate(writers):
        w.add_process(7, 4242 + i)
        w.add_memory(7, 0, "data", (i + 1) * GiB)
    body = await scrape_root(root, tmp_path, writers)
    name = "hami_usage_container_memory_used_bytes"
    used = [ln for ln in body.splitlines() if ln.startswith(name + "{")]
    assert len(used) == 1, used
    labels = own_labels("", POD, "main", GPU)
    assert samples(body)[(name, labels)] == 3 * GiB
    # pid 7 in both, two processes of two runs (host pids 4242 and 4243): it counted one
    assert samples(body)[("hami_usage_container_processes", labels)] == 2


async def test_processes_count_only_those_with_memory_on_the_device(tmp_path: Path) -> None:
    """README: "processes of the container with memory on the device". A process of a two-GPU
    container has a row on each device, of zeros where it holds nothing: it was counted on
    both."""
    root = tmp_path / "containers"
    w = new_cache_file(root, POD, "main", V12, [SimDevice(GPU, 8 * GiB), SimDevice(GPU_MIG, GiB)])
    w.add_process(7, 4242)
    w.add_memory(7, 0, "data", GiB)  # device 0 only
    w.add_process(8, 4343)
    w.add_memory(8, 0, "data", MiB)
    w.add_memory(8, 1, "data", MiB)  # both devices
    got = samples(await scrape_root(root, tmp_path, [w]))
    name = "hami_usage_container_processes"
    per_device = [
        got[(name, own_labels("", POD, "main", u, i))] for i, u in enumerate([GPU, GPU_MIG])
    ]
    assert per_device == [2, 1]


def test_health_before_the_first_scan_says_there_was_none() -> None:
    """503 until a scan happened, and the body says so (it named a last scan never made)."""
    from collector.node.metrics.families import Health
    from collector.node.metrics.server import healthz

    starting = Health(0, 0.0, 0, 0, 0, 0, 0, 0, seconds_since_scan=3.0)
    assert healthz(starting, 30.0) == (
        "503 Service Unavailable",
        "no scan yet (started 3.0 s ago)\n",
    )
    scanned = Health(1, 0.0, 0, 0, 0, 0, 0, 0, seconds_since_scan=0.5)
    assert healthz(scanned, 30.0) == ("200 OK", "last scan 0.5 s ago\n")


def test_health_says_what_the_kafka_forwarder_cannot_do() -> None:
    """A spool the forwarder cannot read now is `degraded`, 200 (it retries by itself, as the
    local log does); a forwarder that has stopped is 503: nothing leaves the node until a
    restart (it said healthy)."""
    from collector.node.metrics.families import Health
    from collector.node.metrics.server import healthz

    unreadable = Health(
        1, 0.0, 0, 0, 0, 0, 0, 0, seconds_since_scan=0.5,
        log_blocked="No space left on device", spool_unreadable="Too many open files",
    )  # fmt: skip
    assert healthz(unreadable, 30.0) == (
        "200 OK",
        "degraded: local log refuses events (No space left on device); kafka forwarder cannot "
        "read the spool (Too many open files); last scan 0.5 s ago\n",
    )
    stopped = Health(
        1, 0.0, 0, 0, 0, 0, 0, 0, seconds_since_scan=0.5, forwarder_stopped="ValueError('x')"
    )
    assert healthz(stopped, 30.0) == (
        "503 Service Unavailable",
        "kafka forwarder stopped (ValueError('x')): events stay spooled; last scan 0.5 s ago\n",
    )


async def _health_once_stopped(
    collector: Collector, stopped: str, caplog: pytest.LogCaptureFixture
) -> tuple[int, str, str, list[str]]:
    """Run `collector` until two scans were made and its `stopped` attribute is set: the
    /healthz status and body, /metrics, and the errors logged by then."""
    task = asyncio.create_task(collector.run())
    try:
        while collector.scanner.stats.scans < 2 or getattr(collector, stopped) is None:
            await asyncio.sleep(0.05)
        assert collector.metrics is not None
        status, _, body = await asyncio.to_thread(get, collector.metrics.port, "/healthz")
        _, _, page = await asyncio.to_thread(get, collector.metrics.port, "/metrics")
        said = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    finally:
        collector.stopping.set()
        await task
    return status, body, page, said


async def test_a_forwarder_that_stopped_is_said_at_once_and_healthz_is_503(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An error the forwarder does not know to wait out ends its task: it is logged when it
    happens (it was logged at shutdown), /healthz is 503 while scans go on, and the shutdown
    does not try to drain (it would fail the same way; the spool stays for the next start)."""
    root = tmp_path / "containers"
    root.mkdir()
    collector = Collector(CollectSettings(root=root, node="n1", log_dir=tmp_path / "log",
                                          interval_s=0.1, nvml=False, metrics_port=0,
                                          kafka=ProducerSettings("127.0.0.1:9")))  # fmt: skip
    assert collector.forwarder is not None

    async def bug() -> int:
        raise ValueError("x")

    collector.forwarder.forward_once = bug  # type: ignore[method-assign]
    status, body, _, said = await _health_once_stopped(collector, "forwarder_stopped", caplog)
    assert status == 503
    assert body.startswith("kafka forwarder stopped (ValueError('x')): events stay spooled; last")
    assert said == [
        f"kafka forwarder stopped: events stay in the spool {tmp_path / 'log'} until a restart"
    ]
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == said


async def test_a_pod_watch_that_stopped_is_said_and_healthz_is_503(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An error the watch does not know to retry ends its task: /healthz stayed 200 and
    hami_usage_kube_connected 1 while no pod was named any more. Now both say it."""
    from kubernetes_asyncio.client import ApiClient

    from collector.node.podwatch import KubeSettings

    root = tmp_path / "containers"
    root.mkdir()
    collector = Collector(
        CollectSettings(root=root, node="n1", log_dir=tmp_path / "log", interval_s=0.1,
                        nvml=False, metrics_port=0, kube=KubeSettings()),
        kube_api=ApiClient(),  # (the real client; nothing is asked of it: the watch fails first)
    )  # fmt: skip
    watch = collector.podwatch
    assert watch is not None

    async def bug() -> None:
        watch.stats.connected = True
        raise ValueError("x")

    watch.run = bug  # type: ignore[method-assign]
    status, body, page, said = await _health_once_stopped(collector, "watch_stopped", caplog)
    assert status == 503
    assert body.startswith("pod watch stopped (ValueError('x')): pods are not named; last scan")
    assert samples(page)[("hami_usage_kube_connected", frozenset())] == 0
    assert said == ["pod watch stopped: pod names are no longer updated"]


async def test_a_gpu_nvml_cannot_read_now_is_not_served_with_its_last_values(
    tmp_path: Path,
) -> None:
    """A GPU whose query fails (lost from the bus) stays in the inventory as last seen, but its
    gauges were served with the values read before, forever, as were every GPU's while NVML
    hung: a scrape could not tell them from a reading. They are left out until read again."""
    node = Node(tmp_path)
    collector = node.collector(tmp_path / "c", metrics_hami=True)
    source = NvmlSource.open(api_factory=lambda: node.fake, timeout_s=0.3)
    assert source is not None
    collector.scanner.crosscheck = CrossCheck(source)
    task = asyncio.create_task(collector.run())

    async def gpu_series() -> dict[str, dict[str, float]]:
        """device index -> {metric: value} of the GPU families, after two more scans."""
        target = collector.scanner.stats.scans + 2
        while collector.scanner.stats.scans < target:
            await asyncio.sleep(0.05)
        out: dict[str, dict[str, float]] = {}
        for (name, labels), value in samples(await scrape(collector)).items():
            if name.startswith(("hami_usage_gpu_", "hami_host_gpu_")):
                out.setdefault(dict(labels)["device_index"], {})[name] = value
        return out

    try:
        before = await gpu_series()
        assert before["0"]["hami_usage_gpu_memory_used_bytes"] == 5 * GiB
        assert before["1"]["hami_usage_gpu_memory_total_bytes"] == 80 * GiB
        node.fake.fail["device 1"] = nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
        node.fake.gpus[0].memory_used = GiB
        lost = await gpu_series()
        assert set(lost) == {"0"}
        assert lost["0"]["hami_usage_gpu_memory_used_bytes"] == GiB
        assert lost["0"]["hami_host_gpu_memory_used_bytes"] == GiB
        del node.fake.fail["device 1"]
        assert set(await gpu_series()) == {"0", "1"}
        gate = node.fake.hang["device_count"] = threading.Event()
        try:
            assert await gpu_series() == {}  # NVML hangs: nothing read
        finally:
            gate.set()
        del node.fake.hang["device_count"]
        assert set(await gpu_series()) == {"0", "1"}
    finally:
        collector.stopping.set()
        await task
        node.close()


async def test_two_pods_of_one_name_are_two_series_in_hamis_sets(serve: Serve) -> None:
    """HAMi's label sets carry the pod's name, not its UID: a StatefulSet pod force-deleted
    while its processes run on and its replacement (same namespace and name) on the same GPU
    were one label set twice, which Prometheus keeps one of. Each is named by its UID then;
    a name held by one pod stays the name."""
    collector = await serve(metrics_hami=True, metrics_hami_legacy=True)
    collector.pod_names = lambda uid: ("team-a", "db-0")  # both pods
    body = await scrape(collector)
    got = samples(body)
    used = {dict(labels)["pod"] for name, labels in got if name == "hami_vgpu_memory_used_bytes"}
    assert used == {POD, POD2}
    legacy = {
        dict(labels)["podname"]
        for name, labels in got
        if name == "vGPU_device_memory_usage_in_bytes"
    }
    assert legacy == {POD, POD2}
    own = {dict(labels)["pod"] for name, labels in got if name == "hami_usage_container_processes"}
    assert own == {"db-0"}  # its own set has pod_uid beside the name
    collector.pod_names = lambda uid: ("team-a", "db-0") if uid == POD else ("team-a", "web-0")
    got = samples(await scrape(collector))
    used = {dict(labels)["pod"] for name, labels in got if name == "hami_vgpu_memory_used_bytes"}
    assert used == {"db-0", "web-0"}


async def test_a_burst_of_scrapes_formats_the_page_once_or_twice_and_scans_go_on(
    serve: Serve,
) -> None:
    """Each scrape formatted the whole page in a worker thread of its own, so a burst took
    the workers and the interpreter from the scans (64 scrapers of a large node: one scan in
    10 s). Scrapes waiting for a formatting begun after they asked share it."""
    collector = await serve()
    assert collector.metrics is not None
    formatted = 0
    real = collector.metrics.registry.collect

    def counted() -> Any:
        nonlocal formatted
        formatted += 1
        time.sleep(0.2)  # a large node's page
        return real()

    collector.metrics.registry.collect = counted  # type: ignore[method-assign]
    scans = collector.scanner.stats.scans
    port = collector.metrics.port
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(32) as scrapers:  # not the loop's workers: the server's
        bodies = await asyncio.gather(
            *(loop.run_in_executor(scrapers, get, port, "/metrics") for _ in range(32))
        )
    assert {status for status, _, _ in bodies} == {200}
    assert all("hami_usage_scans_total" in body for _, _, body in bodies)
    assert formatted <= 3, formatted  # one in flight when the rest came, one for them
    assert collector.scanner.stats.scans - scans >= 2
