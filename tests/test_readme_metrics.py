"""The README's metric tables are generated from the declarations (collector/node/metrics/catalog.py
and collector/aggregate/otlp.py) and checked here, so they cannot drift.

`.venv/bin/python tests/test_readme_metrics.py` rewrites them in README.md.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from pathlib import Path

from otel_names import prometheus_label, prometheus_name

from collector.aggregate import otlp
from collector.node import metrics

README = Path(__file__).resolve().parent.parent / "README.md"


def _prometheus_rows(declared: Iterable[metrics.Metric]) -> list[str]:
    rows = ["| name | type | unit | labels | meaning |", "|---|---|---|---|---|"]
    for m in declared:
        labels = ", ".join(f"`{label}`" for label in m.label_names) or "—"
        rows.append(f"| `{m.name}` | {m.kind} | {m.unit or '—'} | {labels} | {m.help} |")
    return rows


def _otlp_rows() -> list[str]:
    rows = [
        "| OTLP name | instrument | unit | attributes | through the Collector's Prometheus"
        " exporter | meaning |",
        "|---|---|---|---|---|---|",
    ]
    kinds = (
        ("ObservableCounter", otlp.COUNTERS, "counter attributes"),
        ("ObservableGauge", otlp.GAUGES, "gauge attributes"),
    )
    for kind, instruments, attributes in kinds:
        for i in instruments:
            prom = prometheus_name(i.name, i.unit, counter=kind == "ObservableCounter")
            rows.append(
                f"| `{i.name}` | {kind} | `{i.unit}` | {attributes} | `{prom}` | {i.description} |"
            )
    return rows


def _attribute_rows() -> list[str]:
    rows = ["| | OTLP attributes | Prometheus labels |", "|---|---|---|"]
    for name, keys in (
        ("gauge attributes", otlp.GAUGE_ATTRIBUTES),
        ("counter attributes", otlp.COUNTER_ATTRIBUTES),
    ):
        attrs = ", ".join(f"`{k}`" for k in keys)
        labels = ", ".join(f"`{prometheus_label(k)}`" for k in keys)
        rows.append(f"| {name} | {attrs} | {labels}, plus `job`, `instance`, `otel_scope_*` |")
    return rows


def tables() -> dict[str, str]:
    return {
        "otlp": "\n".join(_otlp_rows()),
        "otlp-attributes": "\n".join(_attribute_rows()),
        "prometheus-own": "\n".join(_prometheus_rows(metrics.OWN)),
        "prometheus-hami": "\n".join(_prometheus_rows(metrics.HAMI)),
        "prometheus-legacy": "\n".join(_prometheus_rows(metrics.LEGACY)),
    }


def _block(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- {name} -->\n)(.*?)(\n<!-- /{name} -->)", re.S)


def test_readme_metric_tables_match_the_declarations() -> None:
    text = README.read_text()
    for name, table in tables().items():
        found = _block(name).search(text)
        assert found, f"README.md has no <!-- {name} --> block"
        assert found.group(2) == table, (
            f"README.md's {name} table is out of date: run .venv/bin/python {__file__}"
        )


if __name__ == "__main__":
    text = README.read_text()
    for name, table in tables().items():
        text, n = _block(name).subn(lambda m, t=table: m.group(1) + t + m.group(3), text)
        if n != 1:
            sys.exit(f"README.md: expected one <!-- {name} --> block, found {n}")
    README.write_text(text)
