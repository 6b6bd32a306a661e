"""deploy/monitors.yaml: Prometheus Operator ServiceMonitors that select the kustomization's
metrics Services by label and scrape ports those Services have. (The monitoring.coreos.com kinds
are custom resources: no Kubernetes schema to validate them against; their fields are the
operator's v1 API, checked here field by field.)"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from operator_tools import tool
from test_collector_metrics import GPU, MIG, POD, POD2, Node
from test_deploy import RENDERED

from collector.node.metrics.families import VERSION

MONITORS = Path(__file__).resolve().parent.parent / "deploy" / "monitors.yaml"
_ENDPOINT_FIELDS = {"port", "path", "interval", "relabelings", "metricRelabelings", "honorLabels"}


def monitors() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(MONITORS.read_text()) if d]


def test_monitors_select_metrics_services_and_their_ports() -> None:
    docs = monitors()
    assert {d["metadata"]["name"] for d in docs} == {"hami-usage-collector", "otel-collector"}
    services = [d for d in RENDERED if d["kind"] == "Service"]
    for mon in docs:
        assert (mon["apiVersion"], mon["kind"]) == ("monitoring.coreos.com/v1", "ServiceMonitor")
        assert set(mon["spec"]) == {"selector", "endpoints"}
        wanted = mon["spec"]["selector"]["matchLabels"]
        (svc,) = [s for s in services if wanted.items() <= s["metadata"]["labels"].items()]
        ports = {p["name"] for p in svc["spec"]["ports"]}
        for endpoint in mon["spec"]["endpoints"]:
            assert set(endpoint) <= _ENDPOINT_FIELDS, endpoint
            assert endpoint["port"] in ports
            assert endpoint["path"] == "/metrics"


def test_monitors_are_not_in_the_kustomization() -> None:
    """Clusters without the Prometheus Operator must be able to `kubectl apply -k deploy/`."""
    assert not [d for d in RENDERED if d["apiVersion"].startswith("monitoring.coreos.com/")]


# --- the collector's monitor scraped by a real Prometheus ------------------------------------

# The collector pod as the operator's Kubernetes discovery describes the target.
_META = {
    "__meta_kubernetes_namespace": "hami-usage",
    "__meta_kubernetes_service_name": "hami-usage-collector-metrics",
    "__meta_kubernetes_endpoint_address_target_kind": "Pod",
    "__meta_kubernetes_endpoint_address_target_name": "hami-usage-collector-x7k2p",
    "__meta_kubernetes_pod_name": "hami-usage-collector-x7k2p",
    "__meta_kubernetes_pod_container_name": "collector",
    "__meta_kubernetes_pod_node_name": "n1",  # the collector's NODE_NAME (Node: "n1")
}
# What the Prometheus Operator puts before an endpoint's own relabelings (its
# generateServiceMonitorConfig, less the keep rules that select the Service and port): the
# standard target labels every ServiceMonitor target gets.
_OPERATOR_RELABELINGS: list[dict[str, Any]] = [
    {
        "source_labels": [
            "__meta_kubernetes_endpoint_address_target_kind",
            "__meta_kubernetes_endpoint_address_target_name",
        ],
        "separator": ";",
        "regex": "Pod;(.*)",
        "replacement": "${1}",
        "target_label": "pod",
    },
    {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
    {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "service"},
    {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
    {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
    {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "job"},
    {"target_label": "endpoint", "replacement": "metrics"},
]
_RELABEL_KEYS = {
    "sourceLabels": "source_labels",
    "targetLabel": "target_label",
    "action": "action",
    "regex": "regex",
    "replacement": "replacement",
    "separator": "separator",
}


def scrape_config(endpoint: dict[str, Any], target: str) -> dict[str, Any]:
    """A stand-in for what the operator generates from a ServiceMonitor endpoint, with the
    Kubernetes discovery replaced by a static target carrying the same meta labels."""

    def prometheus(relabelings: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{_RELABEL_KEYS[k]: v for k, v in r.items()} for r in relabelings]

    return {
        "job_name": "serviceMonitor/hami-usage/hami-usage-collector/0",
        "honor_labels": endpoint.get("honorLabels", False),
        "metrics_path": endpoint["path"],
        "scrape_interval": "1s",  # the monitor's 30 s, shortened
        "static_configs": [{"targets": [target], "labels": _META}],
        "relabel_configs": _OPERATOR_RELABELINGS + prometheus(endpoint.get("relabelings", [])),
        "metric_relabel_configs": prometheus(endpoint.get("metricRelabelings", [])),
    }


def query(port: int, promql: str) -> list[dict[str, str]]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=10) as resp:
        return [r["metric"] for r in json.load(resp)["data"]["result"]]


async def stored_series(collector_port: int, tmp_path: Path) -> list[dict[str, str]]:
    """Every hami_* series a real Prometheus stores from one scrape of the collector through the
    collector monitor's endpoint."""
    (endpoint,) = monitor("hami-usage-collector")["spec"]["endpoints"]
    config = {"scrape_configs": [scrape_config(endpoint, f"127.0.0.1:{collector_port}")]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc = subprocess.Popen(
        [
            str(tool("prometheus")),
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[1][-4000:]
            try:
                found = await asyncio.to_thread(query, port, '{__name__=~"hami_.+"}')
            except OSError:
                found = []
            if found:
                return found
            assert time.monotonic() < deadline, "Prometheus stored nothing in 60 s"
            await asyncio.sleep(0.5)
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def monitor(name: str) -> dict[str, Any]:
    (doc,) = [d for d in monitors() if d["metadata"]["name"] == name]
    return doc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_series_keep_their_own_labels_through_the_collector_monitor(
    tmp_path: Path,
) -> None:
    """The operator labels the target `namespace`, `pod`, `container` (the collector pod's);
    the container series have their own, and without the monitor's relabelings Prometheus
    kept those only as exported_*: a per-workload query found nothing."""
    node = Node(tmp_path)
    collector = node.collector(tmp_path / "c", metrics_hami=True)
    collector.pod_names = lambda uid: ("team-a", "trainer-0") if uid == POD else None
    task = asyncio.create_task(collector.run())
    try:
        while collector.scanner.stats.scans < 2:
            await asyncio.sleep(0.05)
        assert collector.metrics is not None
        series = await stored_series(collector.metrics.port, tmp_path)
    finally:
        collector.stopping.set()
        await task
        node.close()
    target = {
        "collector_namespace": "hami-usage",
        "collector_pod": "hami-usage-collector-x7k2p",
        "collector_container": "collector",
        "node": "n1",
        "service": "hami-usage-collector-metrics",
        "endpoint": "metrics",
        "job": "hami-usage-collector-metrics",
        "instance": f"127.0.0.1:{collector.metrics.port}",
    }
    assert not [s for s in series if any(k.startswith("exported_") for k in s)]
    by_name: dict[str, list[dict[str, str]]] = {}
    for s in series:
        by_name.setdefault(s.pop("__name__"), []).append(s)
    ctr = {"pod_uid": POD, "container": "main", "device_index": "0", "device_uuid": GPU}
    ctr2 = {"pod_uid": POD2, "container": "mig", "device_index": "0", "device_uuid": MIG}
    # The unnamed pod's series have no namespace and no pod, not the collector's.
    assert sorted(by_name["hami_usage_container_memory_used_bytes"], key=str) == sorted(
        [
            {**target, **ctr, "namespace": "team-a", "pod": "trainer-0"},
            {**target, **ctr2},
        ],
        key=str,
    )
    hami_ctr = {"container": "main", "vdevice_index": "0", "device_uuid": GPU, "zone": "vGPU"}
    assert {**target, **hami_ctr, "namespace": "team-a", "pod": "trainer-0"} in by_name[
        "hami_vgpu_memory_used_bytes"
    ]
    host = {"device_index": "0", "device_uuid": GPU, "zone": "vGPU"}
    (gpu,) = [s for s in by_name["hami_host_gpu_memory_used_bytes"] if s["device_uuid"] == GPU]
    assert gpu == {**target, **host, "device_type": "NVIDIA-NVIDIA H100 80GB HBM3"}
    # a series of the collector itself: the target's labels only
    assert by_name["hami_usage_build_info"] == [{**target, "version": VERSION}]
