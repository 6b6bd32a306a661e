"""deploy/monitors.yaml: Prometheus Operator ServiceMonitors that select the kustomization's
metrics Services by label and scrape ports those Services have. (The monitoring.coreos.com kinds
are custom resources: no Kubernetes schema to validate them against; their fields are the
operator's v1 API, checked here field by field.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from test_deploy import RENDERED

MONITORS = Path(__file__).resolve().parent.parent / "deploy" / "monitors.yaml"
_ENDPOINT_FIELDS = {"port", "path", "interval", "relabelings", "honorLabels"}


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
