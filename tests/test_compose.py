"""docker-compose.yml through compose-go (scripts/tools/compose-check, the loader `docker compose
config` uses: schema, interpolation, anchors, references), and what it resolves to: the Kafka
version the tests run, and healthchecks that ask what the Kubernetes probes ask."""

from __future__ import annotations

import json
import re
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from operator_tools import tool

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"


def compose_config(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(tool("compose-check")), "-f", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=path.parent,
    )


@pytest.fixture(scope="module")
def project() -> dict[str, Any]:
    result = compose_config(COMPOSE)
    assert result.returncode == 0, result.stderr
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def test_compose_go_loads_the_file(project: dict[str, Any]) -> None:
    assert project["name"] == "hami-usage"
    assert set(project["services"]) >= {
        "kafka",
        "simulator",
        "collector",
        "aggregator",
        "otel-collector",
    }
    # The x-hami-usage anchor was merged into every hami-usage service.
    for name in ("simulator", "collector", "aggregator"):
        assert project["services"][name]["read_only"] is True
        assert project["services"][name]["build"]["context"] == str(ROOT)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda t: t.replace("condition: service_healthy", "condition: service_ready", 1),
            "condition value must be one of",
        ),
        (lambda t: t.replace("  aggregator:\n", "  aggregator:\n    colour: blue\n", 1), "colour"),
        (
            lambda t: t.replace(
                "      kafka:\n        condition", "      kafkaa:\n        condition", 1
            ),
            "kafkaa",
        ),
    ],
    ids=["bad-condition", "unknown-field", "unknown-dependency"],
)
def test_compose_go_rejects_broken_files(tmp_path: Path, change: Any, message: str) -> None:
    broken = tmp_path / "docker-compose.yml"
    text = COMPOSE.read_text()
    assert change(text) != text
    broken.write_text(change(text))
    result = compose_config(broken)
    assert result.returncode == 1, result.stdout
    assert message in result.stderr


def test_compose_kafka_is_the_version_the_tests_run(project: dict[str, Any]) -> None:
    pom = ET.parse(ROOT / "scripts" / "kafka-pom.xml").getroot()
    ns = {"m": "http://maven.apache.org/POM/4.0.0"}
    version = pom.find("m:properties/m:kafka.version", ns)
    assert version is not None and version.text
    assert project["services"]["kafka"]["image"] == f"apache/kafka:{version.text}"


def _flag(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


@pytest.mark.parametrize(
    ("service", "flag"), [("collector", "--metrics-port"), ("aggregator", "--health-port")]
)
def test_healthchecks_ask_the_services_own_healthz(
    project: dict[str, Any], service: str, flag: str
) -> None:
    """The same question as the Kubernetes probes: GET /healthz on the port the service serves."""
    svc = project["services"][service]
    test = svc["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"]
    (url,) = re.findall(r"'(http://[^']+)'", test[3])
    assert url == f"http://127.0.0.1:{_flag(svc['command'], flag)}/healthz"
    completed = subprocess.run(  # the check's own Python is valid and fails on a dead port
        ["python3", "-c", test[3].replace(url, "http://127.0.0.1:9/healthz")],
        capture_output=True,
        timeout=30,
    )
    assert completed.returncode == 1
