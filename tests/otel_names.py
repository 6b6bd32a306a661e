"""OTel metric name + unit -> the name the OTel Collector's Prometheus exporter writes.

A copy of prometheus/otlptranslator's rules (default strategy UnderscoreEscapingWithSuffixes);
tests/test_otelcol.py checks it against a real collector's output.
"""

from __future__ import annotations

import re

# The unit words and "per" words.
_UNIT_WORDS = {
    "d": "days", "h": "hours", "min": "minutes", "s": "seconds", "ms": "milliseconds",
    "us": "microseconds", "ns": "nanoseconds", "By": "bytes", "KiBy": "kibibytes",
    "MiBy": "mebibytes", "GiBy": "gibibytes", "TiBy": "tibibytes", "KBy": "kilobytes",
    "MBy": "megabytes", "GBy": "gigabytes", "TBy": "terabytes", "m": "meters", "V": "volts",
    "A": "amperes", "J": "joules", "W": "watts", "g": "grams", "Cel": "celsius", "Hz": "hertz",
    "1": "", "%": "percent",
}  # fmt: skip
_PER_WORDS = {"s": "second", "m": "minute", "h": "hour", "d": "day", "w": "week", "mo": "month",
              "y": "year"}  # fmt: skip


def _clean_unit(unit: str) -> str:
    return re.sub(r"__+", "_", re.sub(r"[^a-zA-Z0-9:]", "_", unit)).removeprefix("_")


def prometheus_name(name: str, unit: str, *, counter: bool) -> str:
    """OTel metric name + unit -> Prometheus name: split on anything but [a-zA-Z0-9:], append the
    unit (words for known units, other characters to '_') unless already a token, `_total` for
    monotonic counters, `_ratio` for gauges of unit "1"."""
    tokens = [t for t in re.split(r"[^a-zA-Z0-9:]+", name) if t]
    main, _, per = (part.strip() for part in unit.partition("/"))
    main_suffix = _clean_unit(_UNIT_WORDS.get(main, main)) if main and "{" not in main else ""
    per_suffix = _clean_unit("per_" + _PER_WORDS.get(per, per)) if per and "{" not in per else ""
    per_suffix = "" if per_suffix == "per_" else per_suffix.removesuffix("_")
    if main_suffix in tokens:
        main_suffix = ""
    if per_suffix in tokens:
        per_suffix = ""
    if per_suffix:
        main_suffix = main_suffix.removesuffix("_")
    tokens += [s for s in (main_suffix, per_suffix) if s]
    if counter:
        tokens = [t for t in tokens if t != "total"] + ["total"]
    elif unit == "1":
        tokens = [t for t in tokens if t != "ratio"] + ["ratio"]
    out = "_".join(tokens)
    return "_" + out if out[:1].isdigit() else out


def prometheus_label(attribute: str) -> str:
    """An attribute key as a label: anything but [a-zA-Z0-9_] becomes '_'."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", attribute)
