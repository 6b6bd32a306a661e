"""The Helm chart deploy/helm/hami-usage with a real helm (scripts/tools.sh helm): `helm lint`,
`helm template` with its defaults and with every value set, the rendered objects validated
strictly for Kubernetes 1.29 and the newest schema kubernetes-validate ships, and the default
rendering equal to the kustomize manifests it is made from."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s_schema import VERSIONS, validate
from operator_tools import tool
from test_deploy import RENDERED
from test_deploy_monitors import monitor

CHART = Path(__file__).resolve().parent.parent / "deploy" / "helm" / "hami-usage"
NAMESPACE = "gpu-metering"
HELM_LABELS = {
    "helm.sh/chart",
    "app.kubernetes.io/managed-by",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
}


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(tool("helm")), *args], capture_output=True, text=True, timeout=120)


def on_chart(
    command: str, values: tuple[str, ...], kube_version: str
) -> subprocess.CompletedProcess[str]:
    """`helm template|lint` of the chart in NAMESPACE for one Kubernetes version."""
    release = ["metering"] if command == "template" else ["--strict"]
    sets = [a for v in values for a in ("--set", v)]
    return helm(
        command,
        *release,
        str(CHART),
        "--namespace",
        NAMESPACE,
        "--kube-version",
        f"{kube_version}.0",
        *sets,
    )


def template(*values: str, kube_version: str = VERSIONS[0]) -> list[dict[str, Any]]:
    result = on_chart("template", values, kube_version)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def container(docs: list[dict[str, Any]], kind: str, name: str, c: str) -> dict[str, Any]:
    spec = find(docs, kind, name)["spec"]["template"]["spec"]
    (found,) = [x for x in spec["containers"] if x["name"] == c]
    return found


ALL_VALUES = (
    "image.repository=registry.example/hami-usage",
    "image.tag=9.9.9",
    "imagePullSecrets[0].name=pull",
    "kafka.bootstrap=kafka-0.kafka:9093",
    "kafka.securityProtocol=SASL_SSL",
    "kafka.tls.secretName=kafka-ca",
    "kafka.tls.certKey=tls.crt",
    "kafka.tls.keyKey=tls.key",
    "kafka.tls.checkHostname=false",
    "kafka.sasl.mechanism=SCRAM-SHA-512",
    "kafka.sasl.username=metering",
    "kafka.sasl.passwordSecret.name=kafka-user",
    "collector.nodeSelector.nvidia\\.com/gpu\\.present=true",
    "collector.tolerations[0].operator=Exists",
    "collector.priorityClassName=gpu-agents",
    "collector.resources.requests.cpu=100m",
    "collector.resources.requests.memory=128Mi",
    "collector.resources.limits.cpu=1",
    "collector.resources.limits.memory=512Mi",
    "collector.metrics.hami=true",
    "collector.metrics.hamiLegacy=true",
    "collector.runtimeClassName=nvidia",
    "aggregator.replicas=3",
    "aggregator.priorityClassName=billing",
    "aggregator.nodeSelector.pool=system",
    "monitors.enabled=true",
    "monitors.labels.release=kube-prometheus-stack",
    "monitors.interval=15s",
)


@pytest.mark.parametrize("version", VERSIONS)
def test_helm_lint(version: str) -> None:
    for values in ((), ALL_VALUES):
        result = on_chart("lint", values, version)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout


def _strip(doc: dict[str, Any]) -> dict[str, Any]:
    """What the chart adds on purpose: its labels, the release namespace, config checksums."""
    out = copy.deepcopy(doc)
    meta = out["metadata"]
    meta.pop("namespace", None)
    # The topics Job is a Helm hook (re-created on each upgrade: its template is immutable).
    hook = {k: v for k, v in meta.get("annotations", {}).items() if not k.startswith("helm.sh/")}
    if hook:
        meta["annotations"] = hook
    else:
        meta.pop("annotations", None)
    meta["labels"] = {k: v for k, v in meta.get("labels", {}).items() if k not in HELM_LABELS}
    template = out.get("spec", {}).get("template")
    if template:
        annotations = template["metadata"].get("annotations", {})
        annotations.pop("checksum/config", None)
        if not annotations:
            template["metadata"].pop("annotations", None)
    for subject in out.get("subjects", []):
        subject.pop("namespace", None)
    return out


def test_defaults_render_the_kustomize_manifests() -> None:
    """One copy of every manifest: the chart's defaults give what `kubectl apply -k` gives."""
    chart = {(d["kind"], d["metadata"]["name"]): _strip(d) for d in template()}
    kustomize = {
        (d["kind"], d["metadata"]["name"]): _strip(d)
        for d in RENDERED
        if d["kind"] != "Namespace"  # helm install --create-namespace
    }
    assert chart.keys() == kustomize.keys()
    image = f"hami-usage:{yaml.safe_load((CHART / 'Chart.yaml').read_text())['appVersion']}"
    for key, doc in chart.items():
        want = kustomize[key]
        spec = want.get("spec", {}).get("template", {}).get("spec", {})
        for c in [*spec.get("initContainers", []), *spec.get("containers", [])]:
            if c["image"].startswith("hami-usage:"):
                c["image"] = image  # the chart's appVersion, the kustomization's newTag
        assert doc == want, key


def test_objects_are_in_the_release_namespace() -> None:
    docs = template()
    for doc in docs:
        if doc["kind"] in ("ClusterRole", "ClusterRoleBinding"):
            continue
        assert doc["metadata"]["namespace"] == NAMESPACE, doc["metadata"]["name"]
        assert doc["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    binding = find(docs, "ClusterRoleBinding", "hami-usage-collector")
    assert [s["namespace"] for s in binding["subjects"]] == [NAMESPACE]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("values", [(), ALL_VALUES], ids=["defaults", "all-values"])
def test_rendered_objects_are_valid_kubernetes(version: str, values: tuple[str, ...]) -> None:
    docs = template(*values, kube_version=version)
    checked = 0
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # custom resources: tests/test_deploy_monitors.py
        validate(doc, version)
        checked += 1
    assert checked >= 10


def test_values_reach_the_objects() -> None:
    docs = template(*ALL_VALUES)
    ds = find(docs, "DaemonSet", "hami-usage-collector")["spec"]["template"]["spec"]
    assert ds["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert ds["tolerations"] == [{"operator": "Exists"}]
    assert ds["priorityClassName"] == "gpu-agents"
    assert ds["imagePullSecrets"] == [{"name": "pull"}]
    for c in [*ds["initContainers"], *ds["containers"]]:
        assert c["image"] == "registry.example/hami-usage:9.9.9"
    collector = container(docs, "DaemonSet", "hami-usage-collector", "collector")
    assert collector["resources"]["limits"] == {"cpu": 1, "memory": "512Mi"}
    assert collector["args"][-2:] == ["--metrics-hami", "--metrics-hami-legacy"]
    assert ds["runtimeClassName"] == "nvidia"
    nvidia = {e["name"]: e["value"] for e in collector["env"] if e["name"].startswith("NVIDIA_")}
    assert nvidia == {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_DRIVER_CAPABILITIES": "utility"}

    sts = find(docs, "StatefulSet", "hami-usage-aggregator")
    assert sts["spec"]["replicas"] == 3
    assert sts["spec"]["template"]["spec"]["priorityClassName"] == "billing"
    assert sts["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "system"}

    config = find(docs, "ConfigMap", "hami-usage-config")["data"]
    assert config["kafka-bootstrap"] == "kafka-0.kafka:9093"
    config_toml = (CHART.parent.parent / "config.toml").read_text()
    assert config["config.toml"] == config_toml

    for kind, name, c in (
        ("DaemonSet", "hami-usage-collector", "collector"),
        ("StatefulSet", "hami-usage-aggregator", "aggregator"),
    ):
        spec = find(docs, kind, name)["spec"]["template"]["spec"]
        env = {e["name"]: e.get("value") for e in container(docs, kind, name, c)["env"]}
        assert env["HAMI_USAGE_KAFKA_SECURITY_PROTOCOL"] == "SASL_SSL"
        assert env["HAMI_USAGE_KAFKA_CA_FILE"] == "/etc/hami-usage/kafka-tls/ca.crt"
        assert env["HAMI_USAGE_KAFKA_CERT_FILE"] == "/etc/hami-usage/kafka-tls/tls.crt"
        assert env["HAMI_USAGE_KAFKA_KEY_FILE"] == "/etc/hami-usage/kafka-tls/tls.key"
        assert env["HAMI_USAGE_KAFKA_CHECK_HOSTNAME"] == "false"
        assert env["HAMI_USAGE_KAFKA_SASL_MECHANISM"] == "SCRAM-SHA-512"
        assert env["HAMI_USAGE_KAFKA_USERNAME"] == "metering"
        # The password: a file from the Secret, never a value in the spec.
        assert env["HAMI_USAGE_KAFKA_PASSWORD_FILE"] == "/etc/hami-usage/kafka-sasl/password"
        assert "HAMI_USAGE_KAFKA_PASSWORD" not in env
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["kafka-tls"]["secret"] == {"secretName": "kafka-ca"}
        assert volumes["kafka-sasl"]["secret"] == {
            "secretName": "kafka-user",
            "items": [{"key": "password", "path": "password"}],
        }
        mounts = {m["name"]: m for m in container(docs, kind, name, c)["volumeMounts"]}
        assert mounts["kafka-tls"]["readOnly"] is mounts["kafka-sasl"]["readOnly"] is True
    init = find(docs, "DaemonSet", "hami-usage-collector")["spec"]["template"]["spec"]
    assert all("kafka-tls" not in str(c) for c in init["initContainers"])

    monitors = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert {m["metadata"]["name"] for m in monitors} == {"hami-usage-collector", "otel-collector"}
    for m in monitors:
        assert m["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        assert m["metadata"]["namespace"] == NAMESPACE
        assert {e["interval"] for e in m["spec"]["endpoints"]} == {"15s"}
    # The relabelings that keep the series' own namespace/pod/container (the real scrape is
    # tests/test_deploy_monitors.py's) reach the chart's monitor unchanged.
    (endpoint,) = find(docs, "ServiceMonitor", "hami-usage-collector")["spec"]["endpoints"]
    (manifest,) = monitor("hami-usage-collector")["spec"]["endpoints"]
    assert endpoint == {**manifest, "interval": "15s"}
    assert endpoint["metricRelabelings"] == [{"action": "labeldrop", "regex": "exported_node"}]


def kafka_of(docs: list[dict[str, Any]], kind: str, name: str, c: str) -> tuple[Any, ...]:
    """(user name, password Secret, TLS Secret) a container connects to Kafka with."""
    env = {e["name"]: e.get("value") for e in container(docs, kind, name, c)["env"]}
    volumes = {v["name"]: v for v in find(docs, kind, name)["spec"]["template"]["spec"]["volumes"]}
    return (
        env["HAMI_USAGE_KAFKA_USERNAME"],
        volumes["kafka-sasl"]["secret"]["secretName"],
        volumes["kafka-tls"]["secret"]["secretName"],
    )


def test_each_workload_may_be_a_principal_of_its_own() -> None:
    """The collector, the aggregator and the topics Job had to share one Kafka principal: the
    collector on every GPU node then held the aggregator's and the admin's rights (billing
    records, topic creation), or the aggregator and the Job were refused."""
    docs = template(
        *ALL_VALUES,
        "kafka.workloads.collector.username=collector",
        "kafka.workloads.collector.passwordSecret.name=kafka-collector",
        "kafka.workloads.topics.username=admin",
        "kafka.workloads.topics.passwordSecret.name=kafka-admin",
        "kafka.workloads.topics.tlsSecretName=kafka-admin-tls",
    )
    assert kafka_of(docs, "DaemonSet", "hami-usage-collector", "collector") == (
        "collector", "kafka-collector", "kafka-ca"
    )  # fmt: skip
    assert kafka_of(docs, "StatefulSet", "hami-usage-aggregator", "aggregator") == (
        "metering", "kafka-user", "kafka-ca"
    )  # fmt: skip
    (job,) = [d for d in docs if d["kind"] == "Job"]
    assert kafka_of(docs, "Job", job["metadata"]["name"], "topics") == (
        "admin", "kafka-admin", "kafka-admin-tls"
    )  # fmt: skip


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (("kafka.tls.secretName=kafka-ca",), "needs kafka.securityProtocol SSL or SASL_SSL"),
        (("kafka.securityProtocol=SSL", "kafka.sasl.mechanism=PLAIN"), "needs kafka.securi"),
        (("kafka.securityProtocol=SASL_SSL",), "SASL_SSL needs kafka.sasl.mechanism"),
        (("kafka.securityProtocol=TLS",), 'kafka.securityProtocol "TLS": one of PLAINTEXT'),
        (("kafka.securityProtocol=SASL_SSL", "kafka.sasl.mechanism=SCRAM"), "one of PLAIN, SCR"),
        # a principal the program would refuse (`kafka_username needs ... SASL_SSL`)
        (("kafka.sasl.username=u",), "needs kafka.sasl.mechanism and kafka.securityProtocol"),
        (("kafka.workloads.topics.username=t",), "kafka.workloads.topics) needs kafka.sasl"),
        (
            ("kafka.securityProtocol=SSL", "kafka.workloads.aggregator.passwordSecret.name=p"),
            "kafka.workloads.aggregator) needs kafka.sasl.mechanism",
        ),
        (("kafka.workloads.collector.tlsSecretName=t",), "workloads.collector.tlsSecretName needs"),
        # a misspelt workload was ignored, its principal with it
        (("kafka.workloads.colector.username=c",), "kafka.workloads.colector: one of collector"),
        # a CA file that is the Secret's folder, a password item with no key (refused at start,
        # and by the API server)
        (
            ("kafka.securityProtocol=SSL", "kafka.tls.secretName=t", "kafka.tls.caKey="),
            "kafka.tls.caKey is needed",
        ),
        (
            ("kafka.securityProtocol=SASL_SSL", "kafka.sasl.mechanism=PLAIN",
             "kafka.sasl.username=u", "kafka.sasl.passwordSecret.name=p",
             "kafka.sasl.passwordSecret.key="),
            "kafka.sasl.passwordSecret.key is needed",
        ),  # fmt: skip
    ],
)
def test_kafka_values_the_program_refuses_are_refused_by_the_chart(
    values: tuple[str, ...], message: str
) -> None:
    """Each rendered and installed, then every collector, aggregator and topics pod exited 2
    at start (a crash loop): a TLS Secret with the protocol left at PLAINTEXT the easiest."""
    result = on_chart("template", values, VERSIONS[0])
    assert result.returncode != 0
    assert message in result.stderr


def test_the_config_value_replaces_config_toml() -> None:
    """`[topics]`' replication_factor = 3 (the hook Job failed on a Kafka of fewer brokers,
    and with it the release), pod_labels and the window could not be set."""
    text = '[topics]\nreplication_factor = 1\n\n[aggregate]\nwindow = 300\n'
    result = helm("template", "m", str(CHART), "--set-string", f"config={text}")
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    config = find(docs, "ConfigMap", "hami-usage-config")["data"]["config.toml"]
    assert config == text
    before = find(template(), "DaemonSet", "hami-usage-collector")["spec"]["template"]
    after = find(docs, "DaemonSet", "hami-usage-collector")["spec"]["template"]
    key = "checksum/config"
    assert before["metadata"]["annotations"][key] != after["metadata"]["annotations"][key]


def test_without_the_example_collector() -> None:
    docs = template("otelCollector.enabled=false", "aggregator.otlpEndpoint=http://otel:4318")
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert not {n for n in names if n[1].startswith("otel-collector")}
    env = {
        e["name"]: e.get("value")
        for e in container(docs, "StatefulSet", "hami-usage-aggregator", "aggregator")["env"]
    }
    assert env["HAMI_USAGE_OTLP"] == "http://otel:4318"
    refused = helm("template", "m", str(CHART), "--set", "otelCollector.enabled=false")
    assert refused.returncode != 0
    assert "aggregator.otlpEndpoint is needed" in refused.stderr


def test_monitors_are_off_by_default_and_config_changes_roll_the_pods() -> None:
    docs = template()
    assert not [d for d in docs if d["kind"] == "ServiceMonitor"]
    before = find(docs, "DaemonSet", "hami-usage-collector")["spec"]["template"]["metadata"]
    after = find(template("kafka.bootstrap=elsewhere:9092"), "DaemonSet", "hami-usage-collector")
    assert (
        before["annotations"]["checksum/config"]
        != after["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
    )


def test_chart_refuses_kubernetes_older_than_1_29() -> None:
    result = helm("template", "m", str(CHART), "--kube-version", "1.28.0")
    assert result.returncode != 0
    assert "kubeVersion" in result.stderr or "incompatible" in result.stderr
