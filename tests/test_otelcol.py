"""A real OpenTelemetry Collector, built by scripts/tools.sh with the OpenTelemetry Collector
Builder from scripts/tools/otelcol-builder.yaml: exactly the components
deploy/otel-collector-config.yaml uses. `otelcol validate` accepts the config; the aggregator's
OTLP exporter pushes to a collector running it, and what comes out of its Prometheus exporter
has the names the README and the Grafana dashboard use, the values sent, and passes
`promtool check metrics`."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_tools import promtool_check_metrics, tool
from otel_names import prometheus_label, prometheus_name
from prometheus_client.parser import text_string_to_metric_families

from collector.aggregate.otlp import (
    COUNTER_ATTRIBUTES,
    COUNTERS,
    GAUGE_ATTRIBUTES,
    GAUGES,
    OtlpExporter,
)
from collector.aggregate.records import BillingRecord, Gauge

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "deploy" / "otel-collector-config.yaml"
BUILDER = ROOT / "scripts" / "tools" / "otelcol-builder.yaml"
GPU = "GPU-3f1c2a8e-1111-2222-3333-444455556666"
KINDS = ("receivers", "processors", "exporters", "extensions", "connectors")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def config_components() -> dict[str, set[str]]:
    cfg = yaml.safe_load(CONFIG.read_text())
    return {kind: {name.split("/")[0] for name in cfg.get(kind) or {}} for kind in KINDS}


def test_the_collector_has_exactly_the_components_the_config_uses() -> None:
    listed = subprocess.run(
        [str(tool("otelcol")), "components"], capture_output=True, text=True, timeout=60
    )
    assert listed.returncode == 0, listed.stderr
    built = yaml.safe_load(listed.stdout)
    assert {k: {c["name"] for c in built.get(k) or []} for k in KINDS} == config_components()
    # ... all at the version of the contrib image the deployments run.
    builder = yaml.safe_load(BUILDER.read_text())
    image = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["otel-collector"][
        "image"
    ]
    tag = image.rsplit(":", 1)[1]
    for kind in ("receivers", "processors", "exporters", "extensions"):
        for component in builder[kind]:
            assert component["gomod"].endswith(f" v{tag}"), component


def test_otelcol_validate_accepts_the_deploy_config() -> None:
    result = subprocess.run(
        [str(tool("otelcol")), "validate", f"--config={CONFIG}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


def test_otelcol_validate_rejects_a_broken_config(tmp_path: Path) -> None:
    """The check can fail: a pipeline naming an exporter that is not configured."""
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg["service"]["pipelines"]["metrics"]["exporters"].append("otlphttp")
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump(cfg))
    result = subprocess.run(
        [str(tool("otelcol")), "validate", f"--config={broken}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "otlphttp" in result.stderr


class RunningCollector:
    def __init__(self, tmp_path: Path) -> None:
        self.otlp, self.metrics, self.health = free_port(), free_port(), free_port()
        cfg = yaml.safe_load(CONFIG.read_text())
        # The deploy config as it is, on free loopback ports (tests run side by side).
        cfg["receivers"]["otlp"]["protocols"]["http"]["endpoint"] = f"127.0.0.1:{self.otlp}"
        cfg["exporters"]["prometheus"]["endpoint"] = f"127.0.0.1:{self.metrics}"
        cfg["extensions"]["health_check"]["endpoint"] = f"127.0.0.1:{self.health}"
        # No telemetry listener of its own on the default port 8888.
        cfg["service"]["telemetry"] = {"metrics": {"level": "none"}}
        self.config = tmp_path / "otelcol.yaml"
        self.config.write_text(yaml.safe_dump(cfg))
        self.log = tmp_path / "otelcol.log"
        self._log = self.log.open("wb")
        self.proc = subprocess.Popen(
            [str(tool("otelcol")), f"--config={self.config}"],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def get(self, port: int, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, ""

    def wait_healthy(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                if self.get(self.health, "/")[0] == 200:
                    return
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.2)
        raise AssertionError(f"collector not healthy:\n{self.log.read_text()}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@pytest.fixture
def otelcol(tmp_path: Path) -> Iterator[RunningCollector]:
    collector = RunningCollector(tmp_path)
    try:
        collector.wait_healthy()
        yield collector
    finally:
        collector.stop()


def record(container: str, namespace: str = "", pod: str = "") -> BillingRecord:
    return BillingRecord(
        window_start_ms=60_000,
        window_end_ms=120_000,
        node="node-a",
        pod_uid=f"uid-{container}",
        container=container,
        device_uuid=GPU,
        namespace=namespace,
        pod=pod,
        memory_byte_seconds=1.5e9,
        memory_limit_byte_seconds=4.0e9,
        nvml_memory_byte_seconds=1.25e9,
        sm_percent_seconds=1234.5,
        sm_limit_percent_seconds=3000.0,
        peak_memory_bytes=2_000_000_000,
        observed_seconds=59.5,
        samples=60,
        record_id=f"{container}/1",
        allocated_gpu_seconds=30.0,
        used_gpu_seconds=12.25,
        reserved_idle_gpu_seconds=20.0,
    )


Series = dict[tuple[str, frozenset[tuple[str, str]]], float]


def series(text: str) -> Series:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_aggregator_otlp_through_the_collector(
    otelcol: RunningCollector, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(
        "OTEL_RESOURCE_ATTRIBUTES",
        "k8s.namespace.name=hami-usage,k8s.pod.name=hami-usage-aggregator-0",
    )
    exporter = OtlpExporter(
        f"http://127.0.0.1:{otelcol.otlp}", service_instance="hami-usage-aggregator-0", timeout_s=5
    )
    trainer = record("trainer", "ml", "train-0")
    try:
        exporter.record_window([trainer, record("sidecar")])
        exporter.set_gauges(
            [Gauge("node-a", "uid-trainer", "trainer", GPU, 3 << 30, 8 << 30, 73, 0)]
        )
        assert exporter.flush()
    finally:
        exporter.shutdown()

    expected = {prometheus_name(c.name, c.unit, counter=True) for c in COUNTERS} | {
        prometheus_name(g.name, g.unit, counter=False) for g in GAUGES
    }
    deadline = time.monotonic() + 30  # the batch processor holds data up to 5 s
    body = ""
    while time.monotonic() < deadline:
        status, body = otelcol.get(otelcol.metrics, "/metrics")
        if status == 200 and expected <= {name for name, _ in series(body)}:
            break
        time.sleep(0.5)
    got = series(body)
    ours = {name for name, _ in got if name.startswith("hami_")}
    assert ours == expected, body
    # Every label is a declared attribute (the README's table) or the exporter's own.
    own = {"job", "instance", "otel_scope_name", "otel_scope_version", "otel_scope_schema_url"}
    for name, label_set in got:
        if name.startswith("hami_"):
            declared = COUNTER_ATTRIBUTES if name.endswith("_total") else GAUGE_ATTRIBUTES
            allowed = {prometheus_label(a) for a in declared} | own
            assert {k for k, _ in label_set} <= allowed, name

    labels: dict[str, Any] = {
        "job": "hami-usage-aggregator",
        "instance": "hami-usage-aggregator-0",
        "k8s_node_name": "node-a",
        "k8s_pod_uid": "uid-trainer",
        "k8s_container_name": "trainer",
        "hw_id": GPU,
        "hw_type": "gpu",
        # The instrumentation scope: the meter is named after the package, at its version.
        "otel_scope_name": "hami-usage",
        "otel_scope_version": version("hami-usage"),
        "otel_scope_schema_url": "",
    }
    counter = frozenset({**labels, "k8s_namespace_name": "ml", "k8s_pod_name": "train-0"}.items())
    assert got.get(("hami_gpu_memory_usage_byte_seconds_total", counter)) == 1.5e9, body
    assert got[("hami_gpu_sm_usage_time_seconds_total", counter)] == pytest.approx(12.345)
    assert got[("hami_gpu_observed_time_seconds_total", counter)] == 59.5
    assert got[("hami_gpu_allocated_time_seconds_total", counter)] == 30.0
    assert got[("hami_gpu_used_time_seconds_total", counter)] == 12.25
    assert got[("hami_gpu_reserved_idle_time_seconds_total", counter)] == 20.0
    gauge = frozenset(labels.items())
    assert got[("hami_gpu_memory_usage_bytes", gauge)] == 3 << 30
    assert got[("hami_gpu_sm_utilization_ratio", gauge)] == pytest.approx(0.73)
    (info,) = [dict(labels) for name, labels in got if name == "target_info"]
    assert info["k8s_namespace_name"] == "hami-usage"
    assert info["k8s_pod_name"] == "hami-usage-aggregator-0"
    assert info["service_version"]

    result = promtool_check_metrics(body)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout + result.stderr == ""
