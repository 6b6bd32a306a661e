"""The demo end to end on the embedded log, checked against the simulator's ground truth."""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from collector.cli import build_parser
from collector.demo import DemoResult, DemoSettings, format_report, run_demo
from collector.node.scan import Scanner
from collector.simulate import GroundTruth


class ScanGaps:
    """The wall-clock times the demo's collector starts its scans (the time their events
    carry), from the simulator's first step, as the ground truth observed it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.times: list[float] = []
        self.observed = False
        scan, observe = Scanner.scan, GroundTruth.observe

        def timed_scan(scanner: Scanner, *args: Any, **kwargs: Any) -> Any:
            self.times.append(time.time())
            return scan(scanner, *args, **kwargs)

        def first_observed(truth: GroundTruth, now_ms: int, containers: Any) -> None:
            if not self.observed:
                self.observed = True
                self.times.append(now_ms / 1000)
            observe(truth, now_ms, containers)

        monkeypatch.setattr(Scanner, "scan", timed_scan)
        monkeypatch.setattr(GroundTruth, "observe", first_observed)

    def largest_ms(self) -> float:
        times = sorted(self.times)
        return 1000 * max(b - a for a, b in zip(times, times[1:], strict=False))


def test_demo_bills_what_the_simulator_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gaps = ScanGaps(monkeypatch)
    result = asyncio.run(run_demo(DemoSettings(duration_s=6, out=tmp_path)))
    check_against_truth(result, tmp_path, gaps)


@pytest.mark.kafka
def test_demo_through_kafka_bills_what_the_simulator_wrote(
    tmp_path: Path, kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    gaps = ScanGaps(monkeypatch)
    settings = DemoSettings(duration_s=6, out=tmp_path, kafka=kafka_bootstrap)
    check_against_truth(asyncio.run(run_demo(settings)), tmp_path, gaps)


def check_against_truth(result: DemoResult, out: Path, gaps: ScanGaps) -> None:
    billed: dict[tuple[str, str, str], float] = {}
    for row in result.rows:
        key = (row["pod_uid"], row["container"], row["device_uuid"])
        billed[key] = billed.get(key, 0.0) + float(row["memory_byte_seconds"])
    truth = result.truth
    assert len(truth.byte_ms) == 12  # 6 containers x 2 devices
    for key, byte_ms in truth.byte_ms.items():
        exact = byte_ms / 1000
        # The collector sees each change at its next scan: late by at most the gap between two
        # scans per change (interval_ms on a machine that keeps up, more on a loaded one).
        tolerance = truth.abs_delta[key] * max(result.interval_ms, gaps.largest_ms()) / 1000
        assert abs(billed[key] - exact) <= tolerance, (key, billed[key], exact, tolerance)
        assert billed[key] > 0
    kinds = {kind for kind, _, _ in result.anomalies}
    assert {"mislabelled_layout", "proc_num_out_of_range", "invalid_uuid"} <= kinds
    report = format_report(result)
    assert "hostile" in report and "GiB·h" in report and "mislabelled_layout" in report
    assert (out / "billing.csv").read_text().startswith("window_start,window_end,node,")


def test_demo_command_prints_a_bill(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "collector", "demo", "--duration", "5", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "GiB·h" in out.stdout and "SM-hours" in out.stdout
    assert f"billing records in {tmp_path / 'billing.csv'}" in out.stdout
    assert "Traceback" not in out.stderr


def test_every_subcommand_has_complete_help() -> None:
    top = subprocess.run(
        [sys.executable, "-m", "collector", "--help"], capture_output=True, text=True, check=True
    ).stdout
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert sorted(sub.choices) == sorted(
        [
            "inspect",
            "simulate",
            "collect",
            "aggregate",
            "replay",
            "demo",
            "report",
            "schema",
            "topics",
            "decode",
        ]
    )
    for name, subparser in sub.choices.items():
        assert name in top
        for action in subparser._actions:
            assert action.help, f"hami-usage {name} {action.option_strings or action.dest}"
        out = subprocess.run(
            [sys.executable, "-m", "collector", name, "--help"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert out.startswith(f"usage: hami-usage {name}")


def test_demo_rejects_a_too_short_duration() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "collector", "demo", "--duration", "1"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "hami-usage demo: --duration must be at least 5 seconds"
    ]
