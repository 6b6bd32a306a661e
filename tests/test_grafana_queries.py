"""deploy/grafana-dashboard.json, evaluated by the real PromQL engine: every panel's query, with
Grafana's variables as a user who picks "All" over the last hour gets them, runs through
`promtool test rules` over an hour of series shaped as the aggregator's OTLP counters and gauges
reach Prometheus (names and labels from `collector/aggregate/otlp.py`'s declarations), and gives
the numbers a reader of that panel should see, worked out by hand below."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml
from operator_tools import tool
from otel_names import prometheus_label, prometheus_name

from collector.aggregate import otlp

ROOT = Path(__file__).resolve().parent.parent
GIB = 1024**3
# What Grafana puts in place of its variables: "All" (the dashboard's allValue) and a 1 h range.
VARIABLES = {"$node": ".*", "$namespace": ".*", "$__range": "1h", "$__rate_interval": "5m"}
NAME = {i.field: prometheus_name(i.name, i.unit, counter=True) for i in otlp.COUNTERS} | {
    i.field: prometheus_name(i.name, i.unit, counter=False) for i in otlp.GAUGES
}
L = {
    "node": prometheus_label(otlp.ATTR_NODE),
    "uid": prometheus_label(otlp.ATTR_POD_UID),
    "container": prometheus_label(otlp.ATTR_CONTAINER),
    "gpu": prometheus_label(otlp.ATTR_GPU_UUID),
    "namespace": prometheus_label(otlp.ATTR_NAMESPACE),
    "pod": prometheus_label(otlp.ATTR_POD_NAME),
}
WORKLOAD = {kind: prometheus_label(a) for kind, a in otlp.ATTR_WORKLOAD.items()}


def _container(labels: dict[str, str], memory: float, limit: float, nvml: float, sm: float,
               sm_limit: float, used: float) -> dict[str, Any]:
    """A container held steady for the hour on a GPU allocated to it alone: its gauges, and
    its counters' rates per second (each byte held, each SM fraction, for a second)."""
    gauges = {"memory_used_bytes": memory, "memory_limit_bytes": limit,
              "nvml_memory_bytes": nvml, "sm_percent": sm}
    rates = {"memory_byte_seconds": memory, "memory_limit_byte_seconds": limit,
             "nvml_memory_byte_seconds": nvml, "sm_percent_seconds": sm,
             "sm_limit_percent_seconds": sm_limit, "observed_seconds": 1,
             "allocated_gpu_seconds": 1, "used_gpu_seconds": used,
             "reserved_idle_gpu_seconds": 1 - used}
    return {"labels": labels, "gauge": gauges, "rate": rates}  # fmt: skip


# Two containers on one node, each on its own GPU, for an hour: trainer (Deployment, namespace
# ml) holds 2 GiB of a 4 GiB limit (NVML sees 2.5 GiB), runs at 50 % SM of a 100 % limit and
# used half of its allocated GPU-time; db (StatefulSet, web) holds 1 GiB of 2 GiB (NVML
# agrees), 25 % SM of 50 %, used a quarter of its GPU-time.
CONTAINERS: dict[str, dict[str, Any]] = {
    "trainer": _container(
        {L["uid"]: "uid-a", L["container"]: "main", L["gpu"]: "GPU-0", L["namespace"]: "ml",
         L["pod"]: "trainer-7d9f-abcde", WORKLOAD["Deployment"]: "trainer"},
        2 * GIB, 4 * GIB, 2.5 * GIB, 0.5, 1.0, 0.5,
    ),
    "db": _container(
        {L["uid"]: "uid-b", L["container"]: "pg", L["gpu"]: "GPU-1", L["namespace"]: "web",
         L["pod"]: "db-0", WORKLOAD["StatefulSet"]: "db"},
        1 * GIB, 2 * GIB, 1 * GIB, 0.25, 0.5, 0.25,
    ),
}  # fmt: skip
GAUGE_LABELS = {L["node"], L["uid"], L["container"], L["gpu"]}


def _selector(labels: dict[str, str]) -> str:
    return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def input_series() -> list[dict[str, str]]:
    """An hour of samples, one a minute: counters rising at their rate, gauges flat."""
    out = []
    for c in CONTAINERS.values():
        labels = {L["node"]: "node-a", **c["labels"]}
        gauge_labels = {k: v for k, v in labels.items() if k in GAUGE_LABELS}
        for field, per_s in c["rate"].items():
            series = NAME[field] + _selector(labels)
            out.append({"series": series, "values": f"0+{per_s * 60!r}x60"})
        for field, value in c["gauge"].items():
            series = NAME[field] + _selector(gauge_labels)
            out.append({"series": series, "values": f"{value!r}x60"})
    return out


def panel_queries() -> dict[str, list[str]]:
    dash = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    out: dict[str, list[str]] = {}
    for panel in dash["panels"]:
        exprs = []
        for target in panel["targets"]:
            expr = target["expr"]
            for var, value in VARIABLES.items():
                expr = expr.replace(var, value)
            assert "$" not in expr, (panel["title"], expr)  # a variable Grafana would fill
            exprs.append(expr)
        out[panel["title"]] = exprs
    return out


def expected() -> dict[str, list[list[tuple[dict[str, str], float]]]]:
    """Per panel title, per target: the rows (labels, value) a reader sees at the hour's end."""
    ns, pod, uid = L["namespace"], L["pod"], L["uid"]
    tr, db = CONTAINERS["trainer"]["labels"], CONTAINERS["db"]["labels"]

    def gauge_row(c: dict[str, str], name: str | None = None) -> dict[str, str]:
        """A gauge's labels; with `name`, a bare selector's row keeps the metric's name."""
        row = {L["node"]: "node-a", **{k: v for k, v in c.items() if k in GAUGE_LABELS}}
        return row if name is None else {"__name__": NAME[name], **row}

    def per_ns(ml: float, web: float) -> list[tuple[dict[str, str], float]]:
        return [({ns: "ml"}, ml), ({ns: "web"}, web)]

    def per_workload(trainer: float, dbv: float) -> list[tuple[dict[str, str], float]]:
        return [
            ({ns: "ml", WORKLOAD["Deployment"]: "trainer"}, trainer),
            ({ns: "web", WORKLOAD["StatefulSet"]: "db"}, dbv),
        ]

    return {
        # GiB·h over the hour: 2 GiB held for an hour, 1 GiB held for an hour
        "GPU memory GiB·h by namespace / pod (dashboard range)": [
            [({ns: "ml", pod: tr[pod], uid: "uid-a"}, 2.0),
             ({ns: "web", pod: "db-0", uid: "uid-b"}, 1.0)]
        ],
        "Average GPU memory used vs limit by namespace": [
            per_ns(2 * GIB, 1 * GIB), per_ns(4 * GIB, 2 * GIB)
        ],
        "GPU memory used vs limit per container (now)": [
            [(gauge_row(tr, "memory_used_bytes"), 2 * GIB),
             (gauge_row(db, "memory_used_bytes"), 1 * GIB)],
            [(gauge_row(tr, "memory_limit_bytes"), 4 * GIB),
             (gauge_row(db, "memory_limit_bytes"), 2 * GIB)],
        ],
        "GPU memory used / limit per container (now)": [
            [(gauge_row(tr), 50.0), (gauge_row(db), 50.0)]
        ],
        "SM utilisation per container (now)": [
            [(gauge_row(tr, "sm_percent"), 0.5), (gauge_row(db, "sm_percent"), 0.25)]
        ],
        "Average SM utilisation vs SM limit by namespace": [per_ns(0.5, 0.25), per_ns(1.0, 0.5)],
        # NVML sees half a GiB more than HAMi accounted for trainer: +25 % of its usage
        "NVML vs HAMi memory drift per container (now)": [
            [(gauge_row(tr), 0.5 * GIB), (gauge_row(db), 0.0)]
        ],
        "NVML vs HAMi memory drift by namespace (dashboard range)": [per_ns(25.0, 0.0)],
        "Observed container-GPU hours by namespace (dashboard range)": [per_ns(1.0, 1.0)],
        "Used vs reserved-but-idle GPU-hours per workload (dashboard range)": [
            per_workload(0.5, 0.25), per_workload(0.5, 0.75), per_workload(1.0, 1.0),
            per_workload(0.5, 0.75),  # idle share of the allocation
        ],
        "Used vs reserved-but-idle GPUs per workload": [
            per_workload(0.5, 0.25), per_workload(0.5, 0.75)
        ],
    }  # fmt: skip


def test_every_panel_shows_the_hand_worked_numbers(tmp_path: Path) -> None:
    queries, want = panel_queries(), expected()
    assert set(queries) == set(want), "a panel without expected numbers, or one that went away"
    cases = []
    for title, exprs in queries.items():
        assert len(exprs) == len(want[title]), title
        for expr, rows in zip(exprs, want[title], strict=True):
            cases.append(
                {
                    "expr": expr,
                    "eval_time": "60m",
                    "exp_samples": [{"labels": _selector(lab), "value": v} for lab, v in rows],
                }
            )
    spec = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": input_series(), "promql_expr_test": cases}],
    }
    (tmp_path / "dashboard_test.yml").write_text(yaml.safe_dump(spec, sort_keys=False))
    out = subprocess.run(
        [str(tool("promtool")), "test", "rules", "dashboard_test.yml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"SUCCESS", out.stdout + out.stderr), out.stdout + out.stderr
    assert len(cases) == 18  # every target of the 11 panels
