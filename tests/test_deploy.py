"""Offline checks of the deployment files: deploy/ (kustomize), Dockerfile, docker-compose.yml.

Nothing here needs a cluster, Docker or kustomize: the kustomization is rendered by a small loader
that implements exactly the fields deploy/kustomization.yaml uses (and fails on any other), every
rendered object is validated against the Kubernetes 1.30 OpenAPI schemas bundled with
kubernetes-validate (strict: unknown fields fail), and every hami-usage command line in the
manifests and in docker-compose.yml is parsed by our own CLI parser and resolved into settings
the way `hami-usage` would.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml
from k8s_schema import VERSIONS, validate
from operator_tools import tool
from otel_names import prometheus_name

from collector import cli
from collector.aggregate import otlp
from collector.config import (
    AggregateConfig,
    CollectConfig,
    KafkaClientConfig,
    ReplayConfig,
    TopicsConfig,
    load,
)

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S_VERSION = VERSIONS[0]
IMAGE = "hami-usage"  # the image name the manifests use; kustomization.yaml `images` retags it
COMPOSE_IMAGE = "hami-usage:dev"
UID = 10001  # the Dockerfile's USER and the manifests' runAsUser

# --- a tiny kustomize -------------------------------------------------------------------------

_KUSTOMIZATION_FIELDS = {
    "apiVersion",
    "kind",
    "namespace",
    "resources",
    "configMapGenerator",
    "images",
    "replacements",
}
_GENERATOR_FIELDS = {"name", "files", "literals"}
_IMAGE_FIELDS = {"name", "newName", "newTag"}
_CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PriorityClass"}


def _local(base: Path, relative: str) -> Path:
    path = (base / relative).resolve()
    assert path.is_relative_to(base.resolve()), f"{relative}: outside the kustomization root"
    assert path.is_file(), f"{relative}: no such file"
    return path


def _split_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    assert sep and key, f"{text!r}: expected KEY=VALUE"
    return key, value


def pod_spec(doc: dict[str, Any]) -> dict[str, Any] | None:
    if doc["kind"] in ("Deployment", "DaemonSet", "StatefulSet", "Job"):
        spec: dict[str, Any] = doc["spec"]["template"]["spec"]
        return spec
    return None


def all_containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def _retag(image: str, rules: list[dict[str, str]]) -> str:
    name, _, tag = image.partition(":")
    for rule in rules:
        if rule["name"] == name:
            return f"{rule.get('newName', name)}:{rule.get('newTag', tag or 'latest')}"
    return image


def _path(doc: dict[str, Any], field_path: str) -> tuple[Any, str]:
    """The object holding the last step of `field_path` (dots; `[key=value]` picks a list
    item), and that step."""
    *steps, last = field_path.split(".")
    at: Any = doc
    for step in steps:
        if step.startswith("[") and step.endswith("]"):
            key, value = _split_pair(step[1:-1])
            (at,) = [item for item in at if item.get(key) == value]
        else:
            at = at[step]
    return at, last


def _selected(docs: list[dict[str, Any]], select: dict[str, str]) -> list[dict[str, Any]]:
    assert set(select) <= {"kind", "name"}, f"selector fields: {sorted(select)}"
    return [
        d
        for d in docs
        if d["kind"] == select["kind"]
        and d["metadata"]["name"] == select.get("name", d["metadata"]["name"])
    ]


def _replace(docs: list[dict[str, Any]], rule: dict[str, Any]) -> None:
    """A `replacements` entry: the source's field copied to each target's fields."""
    source = rule["source"]
    (doc,) = _selected(docs, {"kind": source["kind"], "name": source["name"]})
    holder, last = _path(doc, source["fieldPath"])
    for target in rule["targets"]:
        matched = _selected(docs, target["select"])
        assert matched, f"replacement target {target['select']}: no such object"
        for d in matched:
            for field_path in target["fieldPaths"]:
                at, step = _path(d, field_path)
                at[step] = holder[last]


def render(directory: Path) -> list[dict[str, Any]]:
    """`kustomize build DIRECTORY`, for the subset of kustomize the kustomization uses.

    Generated ConfigMaps keep their plain names (kustomize adds a content hash to the name and
    rewrites every reference; the references are checked against the plain names instead).
    """
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kust) - _KUSTOMIZATION_FIELDS
    assert not unknown, f"kustomization fields this loader does not implement: {sorted(unknown)}"
    assert kust["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert kust["kind"] == "Kustomization"
    docs: list[dict[str, Any]] = []
    for resource in kust.get("resources", []):
        text = _local(directory, resource).read_text()
        docs += [d for d in yaml.safe_load_all(text) if d is not None]
    for gen in kust.get("configMapGenerator", []):
        assert set(gen) <= _GENERATOR_FIELDS, f"generator fields: {sorted(set(gen))}"
        data: dict[str, str] = {}
        for entry in gen.get("files", []):
            key, _, path = entry.rpartition("=")
            data[key or Path(path).name] = _local(directory, path).read_text()
        for literal in gen.get("literals", []):
            key, value = _split_pair(literal)
            data[key] = value
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": gen["name"]},
                "data": data,
            }
        )
    rules = kust.get("images", [])
    for rule in rules:
        assert set(rule) <= _IMAGE_FIELDS, f"images fields: {sorted(set(rule))}"
    for doc in docs:
        if kust.get("namespace") and doc["kind"] not in _CLUSTER_SCOPED:
            doc["metadata"]["namespace"] = kust["namespace"]
        spec = pod_spec(doc)
        for container in all_containers(spec) if spec else []:
            container["image"] = _retag(container["image"], rules)
    for rule in kust.get("replacements", []):  # (after the namespace, as kustomize runs them)
        _replace(docs, rule)
    return docs


RENDERED = render(DEPLOY)


def find(kind: str, name: str) -> dict[str, Any]:
    matches = [d for d in RENDERED if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} objects"
    return matches[0]


def config_maps() -> dict[str, dict[str, str]]:
    return {d["metadata"]["name"]: d.get("data", {}) for d in RENDERED if d["kind"] == "ConfigMap"}


def workloads() -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for doc in RENDERED:
        spec = pod_spec(doc)
        if spec is not None:
            yield doc, spec


def is_ours(container: dict[str, Any]) -> bool:
    image: str = container["image"]
    return image.split(":")[0].rsplit("/", 1)[-1] == IMAGE


def kustomization() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    return data


# --- the rendered objects ---------------------------------------------------------------------


def test_kustomization_renders_the_expected_objects() -> None:
    names = {(d["kind"], d["metadata"]["name"]) for d in RENDERED}
    assert names == {
        ("Namespace", "hami-usage"),
        ("ServiceAccount", "hami-usage-collector"),
        ("ClusterRole", "hami-usage-collector"),
        ("ClusterRoleBinding", "hami-usage-collector"),
        ("DaemonSet", "hami-usage-collector"),
        ("StatefulSet", "hami-usage-aggregator"),
        ("Job", "hami-usage-topics"),
        ("Service", "hami-usage-aggregator"),
        ("Deployment", "otel-collector"),
        ("Service", "otel-collector"),
        ("Service", "hami-usage-collector-metrics"),
        ("ConfigMap", "hami-usage-config"),
        ("ConfigMap", "otel-collector-config"),
    }
    assert kustomization()["namespace"] == "hami-usage"
    for doc in RENDERED:
        if doc["kind"] not in _CLUSTER_SCOPED:
            assert doc["metadata"]["namespace"] == "hami-usage"


def test_loader_rejects_kustomize_fields_it_does_not_implement(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\npatches: []\n"
    )
    with pytest.raises(AssertionError, match="patches"):
        render(tmp_path)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(
    "doc", RENDERED, ids=[f"{d['kind']}/{d['metadata']['name']}" for d in RENDERED]
)
def test_manifest_is_valid_kubernetes(doc: dict[str, Any], version: str) -> None:
    validate(doc, version)


def test_the_validator_rejects_unknown_fields() -> None:
    """strict=True really is strict: a hostPath `readOnly` (a field that does not exist) fails."""
    bad = json.loads(json.dumps(find("DaemonSet", "hami-usage-collector")))
    bad["spec"]["template"]["spec"]["volumes"][0]["hostPath"]["readOnly"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def _effective(container: dict[str, Any], spec: dict[str, Any], key: str) -> Any:
    own = container.get("securityContext", {})
    return own[key] if key in own else spec.get("securityContext", {}).get(key)


def test_every_container_is_locked_down() -> None:
    for doc, spec in workloads():
        assert spec["automountServiceAccountToken"] is False, doc["metadata"]["name"]
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        for c in all_containers(spec):
            where = f"{doc['metadata']['name']}/{c['name']}"
            sc = c["securityContext"]
            assert sc.get("privileged", False) is False, where
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["capabilities"]["drop"] == ["ALL"], where
            assert set(c["resources"]["requests"]) == {"cpu", "memory"}, where
            assert set(c["resources"]["limits"]) == {"cpu", "memory"}, where
            if c in spec["containers"]:
                assert _effective(c, spec, "runAsNonRoot") is True, where
                assert _effective(c, spec, "runAsUser") == UID, where
                assert "add" not in sc["capabilities"], where


def test_collector_daemonset() -> None:
    ds = find("DaemonSet", "hami-usage-collector")
    spec = ds["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    (collector,) = spec["containers"]

    # HAMi's cache files: a hostPath, mounted read-only wherever it is mounted.
    cache = [n for n, v in volumes.items() if v.get("hostPath", {}).get("path") == otlp_root()]
    assert len(cache) == 1
    mounts = [
        (c["name"], m)
        for c in all_containers(spec)
        for m in c.get("volumeMounts", [])
        if m["name"] == cache[0]
    ]
    assert [name for name, _ in mounts] == ["collector"]  # not the root init container
    for _, mount in mounts:
        assert mount["mountPath"] == otlp_root()
        assert mount["readOnly"] is True
        assert "recursiveReadOnly" not in mount  # Kubernetes 1.29 has no such field
    # (HostPathVolumeSource has no readOnly field; test_the_validator_rejects_unknown_fields.)
    # Directory: HAMi's folder must exist; the collector never creates it on a node without HAMi.
    assert volumes[cache[0]]["hostPath"]["type"] == "Directory"
    assert spec["priorityClassName"] == "system-node-critical"

    # The spool: a hostPath the kubelet creates; the init container chowns only its events dir.
    spool = volumes["spool"]["hostPath"]
    assert spool == {"path": "/var/lib/hami-usage", "type": "DirectoryOrCreate"}
    spool_mount = next(m for m in collector["volumeMounts"] if m["name"] == "spool")
    assert spool_mount["mountPath"] == "/var/lib/hami-usage"
    assert not spool_mount.get("readOnly", False)
    (init,) = spec["initContainers"]
    assert init["securityContext"]["capabilities"]["add"] == ["CHOWN"]
    assert f"chown {UID}:{UID} /var/lib/hami-usage/events" in init["command"][-1]

    # Node name from the downward API.
    env = {e["name"]: e for e in collector["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    # NVML: the NVIDIA container runtime mounts libnvidia-ml.so (absent from the image) and the
    # GPUs into a container that asks with these; the pod requests no GPU.
    assert env["NVIDIA_VISIBLE_DEVICES"] == {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == {
        "name": "NVIDIA_DRIVER_CAPABILITIES",
        "value": "utility",
    }
    assert "nvidia.com/gpu" not in str(collector["resources"])
    assert "runtimeClassName" not in spec  # the node's default runtime, unless patched

    # hostPID exactly when the collector looks at the host's /proc.
    args = collector["args"]
    assert spec["hostPID"] is True
    assert args[args.index("--host-proc") + 1] == "/proc"

    # Probes: the collector's own /healthz on the metrics port it is told to serve.
    port = int(args[args.index("--metrics-port") + 1])
    assert collector["ports"] == [{"name": "metrics", "containerPort": port}]
    for probe in ("livenessProbe", "readinessProbe"):
        assert collector[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}

    # GPU nodes only, tainted ones included.
    assert spec["nodeSelector"] == {"gpu": "on"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
        "tolerations"
    ]
    assert collector["resources"]["requests"] == {"cpu": "50m", "memory": "64Mi"}
    assert ds["spec"]["updateStrategy"]["rollingUpdate"]["maxSurge"] == 0


@pytest.mark.parametrize("namespace", ["hami-usage", "gpu-metering"])
def test_the_binding_follows_the_namespace_in_kustomize_and_in_this_loader(
    tmp_path: Path, namespace: str
) -> None:
    """With `namespace` changed, kustomize (the real one) moved every object but left the
    ClusterRoleBinding's subject in hami-usage (it rewrites only subjects named `default`): the
    collector's pod watch got 403 and every container went unnamed."""
    copy = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copy, ignore=shutil.ignore_patterns("helm"))
    kust = copy / "kustomization.yaml"
    kust.write_text(kust.read_text().replace("namespace: hami-usage", f"namespace: {namespace}"))
    built = subprocess.run(
        [str(tool("kustomize")), "build", str(copy)], capture_output=True, text=True, check=True
    )
    for docs in (list(yaml.safe_load_all(built.stdout)), render(copy)):
        (binding,) = [d for d in docs if d["kind"] == "ClusterRoleBinding"]
        (sa,) = [d for d in docs if d["kind"] == "ServiceAccount"]
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "hami-usage-collector", "namespace": namespace}
        ]
        assert sa["metadata"]["namespace"] == namespace


def test_collector_rbac_is_read_only_and_matches_what_the_pod_watch_asks() -> None:
    role = find("ClusterRole", "hami-usage-collector")
    rules = {
        (group, resource): sorted(rule["verbs"])
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    # list/watch on pods; get on namespaces and on what owner resolution reads. Nothing else
    # (tests/test_podwatch.py checks this against the requests the client makes).
    assert rules == {
        ("", "pods"): ["list", "watch"],
        ("", "namespaces"): ["get"],
        ("apps", "replicasets"): ["get"],
        ("batch", "jobs"): ["get"],
    }
    binding = find("ClusterRoleBinding", "hami-usage-collector")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": "hami-usage-collector",
    }
    sa = find("ServiceAccount", "hami-usage-collector")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "hami-usage-collector", "namespace": "hami-usage"}
    ]
    assert sa["metadata"]["namespace"] == "hami-usage"
    assert sa["automountServiceAccountToken"] is False

    # The DaemonSet runs as that account; the token reaches the collector container only, at
    # the path the in-cluster configuration reads.
    spec = find("DaemonSet", "hami-usage-collector")["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == "hami-usage-collector"
    volume = next(v for v in spec["volumes"] if v["name"] == "kube-api-access")
    sources = volume["projected"]["sources"]
    assert sources[0]["serviceAccountToken"]["path"] == "token"
    assert sources[1]["configMap"] == {
        "name": "kube-root-ca.crt",
        "items": [{"key": "ca.crt", "path": "ca.crt"}],
    }
    mounts = [
        (c["name"], m)
        for c in all_containers(spec)
        for m in c.get("volumeMounts", [])
        if m["name"] == "kube-api-access"
    ]
    assert [(n, m["mountPath"], m["readOnly"]) for n, m in mounts] == [
        ("collector", "/var/run/secrets/kubernetes.io/serviceaccount", True)
    ]
    # The collector's own command line leaves Kubernetes on (in-cluster configuration).
    (collector,) = spec["containers"]
    assert "--no-kubernetes" not in collector["args"]
    assert "--kubeconfig" not in collector["args"]


def otlp_root() -> str:
    return CollectConfig().root


def test_aggregator_statefulset() -> None:
    sts = find("StatefulSet", "hami-usage-aggregator")
    assert sts["spec"]["replicas"] == 1
    # The governing Service exists and is headless.
    svc = find("Service", sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None"
    spec = sts["spec"]["template"]["spec"]
    (agg,) = spec["containers"]
    env = {e["name"]: e for e in agg["env"]}
    # The instance (transactional id suffix, static member id) is the pod's stable ordinal.
    assert env["HAMI_USAGE_INSTANCE"]["valueFrom"] == {
        "fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}
    }
    assert env["HAMI_USAGE_KAFKA"]["valueFrom"]["configMapKeyRef"]["key"] == "kafka-bootstrap"
    resource = dict(
        pair.split("=", 1) for pair in env["OTEL_RESOURCE_ATTRIBUTES"]["value"].split(",")
    )
    assert resource == {
        "k8s.namespace.name": "$(POD_NAMESPACE)",
        "k8s.pod.name": "$(POD_NAME)",
        "k8s.statefulset.name": sts["metadata"]["name"],
        "k8s.node.name": "$(NODE_NAME)",
    }
    for var in ("POD_NAMESPACE", "POD_NAME", "NODE_NAME"):  # defined before they are used
        assert list(env).index(var) < list(env).index("OTEL_RESOURCE_ATTRIBUTES")
    # Probes on the aggregator's own /healthz, on the port it is told to serve.
    args = agg["args"]
    port = int(args[args.index("--health-port") + 1])
    assert agg["ports"] == [{"name": "health", "containerPort": port, "protocol": "TCP"}]
    for probe in ("livenessProbe", "readinessProbe"):
        assert agg[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert spec["priorityClassName"] == "system-cluster-critical"


def test_images_are_retagged_by_the_kustomization() -> None:
    rules = kustomization()["images"]
    assert [r["name"] for r in rules] == [IMAGE]
    for _, spec in workloads():
        for c in all_containers(spec):
            if is_ours(c):
                assert c["image"] == f"{IMAGE}:{rules[0]['newTag']}"


def test_config_map_references_resolve() -> None:
    maps = config_maps()
    for doc, spec in workloads():
        for volume in spec.get("volumes", []):
            if "configMap" in volume:
                data = maps[volume["configMap"]["name"]]
                for item in volume["configMap"].get("items", []):
                    assert item["key"] in data, (doc["metadata"]["name"], item)
        for c in all_containers(spec):
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("configMapKeyRef")
                if ref:
                    assert ref["key"] in maps[ref["name"]], (doc["metadata"]["name"], e)


def test_services_select_pods_and_ports() -> None:
    for svc in (d for d in RENDERED if d["kind"] == "Service"):
        selector = svc["spec"]["selector"]
        targets = [
            spec
            for doc, spec in workloads()
            if selector.items() <= doc["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(targets) == 1, svc["metadata"]["name"]
        ports = {
            p["name"]: p["containerPort"] for c in targets[0]["containers"] for p in c["ports"]
        }
        for port in svc["spec"]["ports"]:
            assert ports[port["targetPort"]] == port["port"]


# --- the command lines, resolved the way `hami-usage` resolves them ---------------------------

_SETTINGS: dict[str, tuple[type[Any], list[str]]] = {
    "collect": (CollectConfig, cli.COLLECT_FLAGS),
    "aggregate": (AggregateConfig, cli.AGGREGATE_FLAGS),
    "replay": (ReplayConfig, cli.REPLAY_FLAGS),
    "topics": (TopicsConfig, cli.TOPICS_FLAGS),
    "report": (KafkaClientConfig, cli.KAFKA_FLAGS),
}


def dockerfile_entrypoint() -> list[str]:
    lines = [
        ln for ln in (ROOT / "Dockerfile").read_text().splitlines() if ln.startswith("ENTRYPOINT")
    ]
    assert len(lines) == 1
    entrypoint: list[str] = json.loads(lines[0].removeprefix("ENTRYPOINT"))
    return entrypoint


def argv_of(command: list[str] | None, args: list[str] | None) -> list[str]:
    """What runs in the container: `command` replaces the image's ENTRYPOINT, `args` its CMD."""
    full = [*(command if command is not None else dockerfile_entrypoint()), *(args or [])]
    assert full[0] == "hami-usage", full
    return [str(a) for a in full[1:]]


def settings_of(argv: list[str], env: dict[str, str], files: dict[str, Path]) -> Any:
    args = cli.build_parser().parse_args(argv)  # raises cli.UsageError on a bad flag
    cls, names = _SETTINGS[args.command]
    config = None if args.config is None else files[str(args.config)]
    flags = {name: getattr(args, name) for name in names}
    return load(cls, args.command, config_file=config, flags=flags, env=env)


# What Kubernetes puts in a field the settings check the form of: the pod index is a number
# (`instance` is 1-249 of A-Za-z0-9._-); other fields read as `<fieldPath>`.
POD_INDEX = "metadata.labels['apps.kubernetes.io/pod-index']"
FIELD_VALUES = {POD_INDEX: "3"}


def _resolve_env(container: dict[str, Any]) -> dict[str, str]:
    maps = config_maps()
    env = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "configMapKeyRef" in e["valueFrom"]:
            ref = e["valueFrom"]["configMapKeyRef"]
            env[e["name"]] = maps[ref["name"]][ref["key"]]
        else:
            path = e["valueFrom"]["fieldRef"]["fieldPath"]
            env[e["name"]] = FIELD_VALUES.get(path, f"<{path}>")
    return env


def _mounted_files(spec: dict[str, Any], container: dict[str, Any]) -> dict[str, Path]:
    """Path in the container -> the deploy/ file its ConfigMap was generated from."""
    sources = {
        gen["name"]: {Path(f).name: DEPLOY / f for f in gen.get("files", [])}
        for gen in kustomization()["configMapGenerator"]
    }
    volumes = {v["name"]: v for v in spec["volumes"]}
    files = {}
    for mount in container.get("volumeMounts", []):
        cm = volumes[mount["name"]].get("configMap")
        if cm:
            for item in cm["items"]:
                files[f"{mount['mountPath']}/{item['path']}"] = sources[cm["name"]][item["key"]]
    return files


def _our_k8s_containers() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    return [
        (doc["metadata"]["name"], spec, c)
        for doc, spec in workloads()
        for c in spec["containers"]
        if is_ours(c)
    ]


@pytest.mark.parametrize(
    "name,spec,container",
    _our_k8s_containers(),
    ids=[f"{name}/{c['name']}" for name, _, c in _our_k8s_containers()],
)
def test_k8s_command_lines_parse_and_resolve(
    name: str, spec: dict[str, Any], container: dict[str, Any]
) -> None:
    env = _resolve_env(container)
    argv = argv_of(container.get("command"), container.get("args"))
    settings = settings_of(argv, env, _mounted_files(spec, container))
    bootstrap = config_maps()["hami-usage-config"]["kafka-bootstrap"]
    assert settings.kafka == bootstrap
    if container["name"] != "topics":  # every service mounts its own Kafka Secret, optionally
        kafka = next(m for m in container["volumeMounts"] if m["name"] == "kafka")
        assert kafka["mountPath"] == "/etc/hami-usage-kafka" and kafka["readOnly"] is True
    secret = next(v["secret"] for v in spec["volumes"] if v["name"] == "kafka")
    assert secret["optional"] is True and secret["secretName"].startswith("hami-usage-kafka-")
    if isinstance(settings, TopicsConfig):
        assert argv[-1] == "--apply"
        assert (settings.topic, settings.billing_topic) == ("hami.usage.v1", "hami.billing.v1")
        return
    if isinstance(settings, CollectConfig):
        assert settings.root == "/usr/local/vgpu/containers"
        assert settings.log.startswith("/var/lib/hami-usage/")
        assert settings.host_proc == "/proc"
        assert settings.node is None  # so the collector takes NODE_NAME
    else:
        assert isinstance(settings, AggregateConfig)
        assert settings.instance == FIELD_VALUES[POD_INDEX]
        assert settings.health_port == 8080
        url = urlsplit(str(settings.otlp))
        svc = find("Service", url.hostname or "")
        assert url.port in [p["port"] for p in svc["spec"]["ports"]]
        assert url.path == "/v1/metrics"


def test_init_container_is_the_only_other_command() -> None:
    others = [
        c["name"]
        for _, spec in workloads()
        for c in all_containers(spec)
        if is_ours(c) and c not in spec["containers"]
    ]
    assert others == ["spool-owner"]


# --- deploy/config.toml -------------------------------------------------------------------------


def _section_lines(section: str) -> list[str]:
    text = (DEPLOY / "config.toml").read_text()
    lines: list[str] = []
    current = None
    for line in text.splitlines():
        header = re.fullmatch(r"\[(\w+)\]\s*", line)
        if header:
            current = header.group(1)
        elif current == section:
            lines.append(line)
    return lines


@pytest.mark.parametrize("section", sorted(_SETTINGS))
def test_config_toml_loads_and_documents_every_key(section: str) -> None:
    cls, _ = _SETTINGS[section]
    path = DEPLOY / "config.toml"
    settings = load(cls, section, config_file=path, env={})
    assert isinstance(settings, cls)
    table = tomllib.loads(path.read_text())[section]
    lines = _section_lines(section)
    mentioned = set()
    for i, line in enumerate(lines):
        m = re.match(r"(#\s*)?(\w+)\s*=", line)
        if m:
            mentioned.add(m.group(2))
            if not m.group(1):  # a key in effect: a comment right above it
                assert lines[i - 1].startswith("#"), f"[{section}] {m.group(2)}: no comment"
    assert set(table) <= mentioned
    # Every setting is there, in effect or commented out with its example value.
    assert mentioned == set(cls.__struct_fields__), set(cls.__struct_fields__) ^ mentioned


def test_config_toml_matches_the_defaults_it_repeats() -> None:
    """Keys written out in config.toml document the default: a changed default must show here."""
    table = tomllib.loads((DEPLOY / "config.toml").read_text())
    exceptions = {("aggregate", "otlp")}  # the one setting the cluster changes
    for section, (cls, _) in _SETTINGS.items():
        defaults = cls()
        for key, value in table[section].items():
            if (section, key) not in exceptions:
                assert getattr(defaults, key) == value, (section, key)


# --- Dockerfile and .dockerignore ---------------------------------------------------------------


def test_dockerfile() -> None:
    text = (ROOT / "Dockerfile").read_text()
    instructions = [ln for ln in text.splitlines() if ln and not ln.startswith(("#", " "))]
    assert instructions[0] == "FROM python:3.11-slim"
    assert [ln for ln in instructions if ln.startswith("FROM")] == [instructions[0]]
    code = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
    assert re.search(r"pip install \.(\s|$)", code)
    assert "[test]" not in code and "-e " not in code
    users = [ln.split()[1] for ln in instructions if ln.startswith("USER")]
    assert users == [f"{UID}:{UID}"]
    assert dockerfile_entrypoint() == ["hami-usage"]


def _dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule, simplified: the last matching pattern wins, `!` re-includes; a pattern also
    matches everything below a matched folder."""
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.removeprefix("!").strip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if pattern.startswith("**/"):
            hit = any(fnmatchcase(p, pattern[3:]) for p in parts)
        else:
            hit = any(fnmatchcase(p, pattern) for p in prefixes)
        if hit:
            ignored = not negate
    return ignored


def test_dockerignore_keeps_what_the_build_copies() -> None:
    patterns = [
        ln.strip()
        for ln in (ROOT / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    copied = []
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY"):
            copied += line.split()[1:-1]
    assert copied == ["pyproject.toml", "README.md", "collector"]
    for path in [*copied, "collector/cli/__init__.py", "collector/aggregate/otlp.py"]:
        assert not _dockerignored(path, patterns), path
    for path in [
        ".git/HEAD",
        ".venv/bin/python",
        ".kafka/libs",
        "tests/test_deploy.py",
        "collector/cli/__pycache__/collect.cpython-311.pyc",
    ]:
        assert _dockerignored(path, patterns), path


# --- docker-compose.yml --------------------------------------------------------------------------


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return data


def test_compose_services_and_images() -> None:
    services = compose()["services"]
    assert set(services) == {
        "kafka",
        "topics",
        "simulator",
        "collector",
        "aggregator",
        "otel-collector",
    }
    assert services["kafka"]["image"].startswith("apache/kafka:4.")
    for name in ("simulator", "collector", "aggregator"):
        assert services[name]["image"] == COMPOSE_IMAGE
        assert services[name]["build"]["context"] == "."
        assert services[name]["read_only"] is True
    otel_k8s = find("Deployment", "otel-collector")["spec"]["template"]["spec"]["containers"][0]
    assert services["otel-collector"]["image"] == otel_k8s["image"]
    assert services["otel-collector"]["image"].startswith("otel/opentelemetry-collector-contrib:")


def test_compose_kafka_is_single_node_kraft_with_a_healthcheck() -> None:
    kafka = compose()["services"]["kafka"]
    env = kafka["environment"]
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert "PLAINTEXT://kafka:9092" in env["KAFKA_ADVERTISED_LISTENERS"].split(",")
    for key in ("OFFSETS_TOPIC", "TRANSACTION_STATE_LOG"):
        assert env[f"KAFKA_{key}_REPLICATION_FACTOR"] == "1"  # exactly-once needs both
    assert "9092" in kafka["healthcheck"]["test"][-1]


def test_compose_volumes_and_dependencies() -> None:
    doc = compose()
    services = doc["services"]
    assert services["collector"]["volumes"][0] == "containers:/data/containers:ro"
    assert "containers:/data/containers" in services["simulator"]["volumes"]
    assert set(doc["volumes"]) == {"containers", "spool", "billing"}
    assert services["aggregator"]["depends_on"]["kafka"]["condition"] == "service_healthy"
    assert services["collector"]["depends_on"]["kafka"]["condition"] == "service_healthy"
    assert "otel-collector" in services["aggregator"]["depends_on"]
    for name in ("collector", "aggregator"):  # the topics exist before either starts
        condition = services[name]["depends_on"]["topics"]["condition"]
        assert condition == "service_completed_successfully"
    otel_mounts = services["otel-collector"]["volumes"]
    assert otel_mounts == [
        "./deploy/otel-collector-config.yaml:/etc/otelcol-contrib/config.yaml:ro"
    ]
    assert services["otel-collector"]["command"] == ["--config=/etc/otelcol-contrib/config.yaml"]


@pytest.mark.parametrize("service", ["simulator", "topics", "collector", "aggregator"])
def test_compose_command_lines_parse_and_resolve(service: str) -> None:
    svc = compose()["services"][service]
    argv = argv_of(svc.get("entrypoint"), svc["command"])
    if argv[0] == "topics":
        topics = settings_of(argv, svc["environment"], {})
        assert (topics.kafka, topics.replication_factor, topics.min_insync_replicas) == (
            "kafka:9092",
            1,
            1,
        )
        assert argv[-1] == "--apply"
        return
    if argv[0] == "simulate":
        args = cli.build_parser().parse_args(argv)
        assert (args.root, args.containers, args.layout, args.duration) == (
            "/data/containers",
            8,
            "mixed",
            86400.0,
        )
        return
    settings = settings_of(argv, {}, {})
    assert settings.kafka == "kafka:9092"
    if isinstance(settings, CollectConfig):
        assert (settings.root, settings.log, settings.node) == (
            "/data/containers",
            "/data/spool",
            "compose-node",
        )
        mounts = [v.split(":")[1] for v in svc["volumes"]]
        assert settings.root in mounts and settings.log in mounts
    else:
        assert settings.otlp == "http://otel-collector:4318/v1/metrics"
        assert settings.csv == "/out/billing.csv"


# --- the OpenTelemetry Collector ------------------------------------------------------------------


def test_otel_collector_config_is_one_file_used_by_both() -> None:
    path = DEPLOY / "otel-collector-config.yaml"
    cfg = yaml.safe_load(path.read_text())
    assert cfg["receivers"]["otlp"]["protocols"]["http"]["endpoint"] == "0.0.0.0:4318"
    assert cfg["exporters"]["prometheus"]["endpoint"] == "0.0.0.0:8889"
    assert "batch" in cfg["processors"]
    assert "debug" in cfg["exporters"]
    (pipeline,) = cfg["service"]["pipelines"].values()
    for kind in ("receivers", "processors", "exporters"):
        for component in pipeline[kind]:
            assert component in cfg[kind], (kind, component)
    assert set(pipeline["exporters"]) == {"prometheus", "debug"}
    for ext in cfg["service"]["extensions"]:
        assert ext in cfg["extensions"]
    # The ConfigMap is generated from this very file, and the Deployment reads it from there.
    assert config_maps()["otel-collector-config"] == {path.name: path.read_text()}
    spec = find("Deployment", "otel-collector")["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    (config_arg,) = [a for a in container["args"] if a.startswith("--config=")]
    assert config_arg.removeprefix("--config=") in _mounted_files_any(spec, container)
    health = cfg["extensions"]["health_check"]["endpoint"].rsplit(":", 1)[1]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"otlp-http": 4318, "metrics": 8889, "health": int(health)}


def _mounted_files_any(spec: dict[str, Any], container: dict[str, Any]) -> set[str]:
    maps = config_maps()
    volumes = {v["name"]: v for v in spec["volumes"]}
    out = set()
    for mount in container["volumeMounts"]:
        cm = volumes[mount["name"]].get("configMap")
        if cm:
            keys = [i["path"] for i in cm["items"]] if "items" in cm else list(maps[cm["name"]])
            out |= {f"{mount['mountPath']}/{k}" for k in keys}
    return out


# --- Grafana: metric names as the Prometheus exporter writes them ---------------------------------


def test_prometheus_name_follows_the_translator() -> None:
    # Examples from prometheus/otlptranslator's documentation and tests.
    assert (
        prometheus_name("http.server.duration", "s", counter=False)
        == "http_server_duration_seconds"
    )
    assert prometheus_name("requests.count", "1", counter=True) == "requests_count_total"
    assert prometheus_name("memory.usage", "By", counter=False) == "memory_usage_bytes"
    assert prometheus_name("system.io", "By/s", counter=False) == "system_io_bytes_per_second"
    assert prometheus_name("cpu.utilization", "1", counter=False) == "cpu_utilization_ratio"
    assert prometheus_name("packets", "{packet}", counter=True) == "packets_total"
    # A product unit the translator has no words for keeps its letters (promtool rejects the
    # abbreviation): why ours are annotations.
    assert prometheus_name("x.usage", "By.s", counter=True) == "x_usage_By_s_total"
    assert prometheus_name("x.usage_byte_seconds", "{By.s}", counter=True) == (
        "x_usage_byte_seconds_total"
    )


EXPORTED = {prometheus_name(c.name, c.unit, counter=True) for c in otlp.COUNTERS} | {
    prometheus_name(g.name, g.unit, counter=False) for g in otlp.GAUGES
}
# Every attribute a point can carry (the workload's by kind included), as a Prometheus label.
LABELS = {re.sub(r"[^a-zA-Z0-9_]", "_", a) for a in otlp.COUNTER_ATTRIBUTES}


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    return data


def _metric_refs(expr: str) -> set[str]:
    return set(re.findall(r"\bhami_[A-Za-z0-9_]+", expr))


def test_grafana_dashboard_queries_exported_metrics() -> None:
    dash = dashboard()
    assert len(EXPORTED) == len(otlp.COUNTERS) + len(otlp.GAUGES)
    used: set[str] = set()
    for panel in dash["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            refs = _metric_refs(expr)
            assert refs, (panel["title"], expr)
            assert refs <= EXPORTED, (panel["title"], refs - EXPORTED)
            assert '$node"' in expr, panel["title"]  # every panel follows the node variable
            labels = set(re.findall(r"\b(?:k8s|hw)_[a-z_]+", expr + target["legendFormat"]))
            assert labels <= LABELS, (panel["title"], labels - LABELS)
            used |= refs
    assert used == EXPORTED, f"metrics without a panel: {sorted(EXPORTED - used)}"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_grafana_shows_reserved_idle_against_used_per_workload() -> None:
    workload = {re.sub(r"\W", "_", a) for a in otlp.ATTR_WORKLOAD.values()}
    panels = [
        p for p in dashboard()["panels"] if any("reserved_idle" in t["expr"] for t in p["targets"])
    ]
    assert {p["type"] for p in panels} == {"table", "timeseries"}  # the range, and over time
    for panel in panels:
        refs = set().union(*(_metric_refs(t["expr"]) for t in panel["targets"]))
        assert {
            "hami_gpu_reserved_idle_time_seconds_total",
            "hami_gpu_used_time_seconds_total",
        } <= refs, panel["title"]
        for target in panel["targets"]:
            (by,) = re.findall(r"sum by \(([^)]*)\)", target["expr"])[:1]
            # grouped by namespace and every workload kind's label, nothing finer
            assert {x.strip() for x in by.split(",")} == workload | {"k8s_namespace_name"}


def test_grafana_dashboard_variables() -> None:
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    for name, label in (("node", "k8s_node_name"), ("namespace", "k8s_namespace_name")):
        query = variables[name]["query"]
        assert query.startswith("label_values(") and query.endswith(f", {label})")
        assert _metric_refs(query) <= EXPORTED and _metric_refs(query)
        # "All" must also match series without the label (namespace is not always known).
        assert variables[name]["allValue"] == ".*"
