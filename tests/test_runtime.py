"""The collector service's garbage-collector settings (collector/runtime.py), each in a process
of its own: they are process-wide and must not change this test process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from collector.layout.declarations import LAYOUTS
from collector.runtime import YOUNG_THRESHOLD
from collector.simulate import CacheWriter, SimDevice

# Prints, at exit, the process's collector settings and how many objects are frozen.
REPORT = (
    "import atexit, gc, json, sys\n"
    "atexit.register(lambda: print(json.dumps({'threshold': gc.get_threshold(), "
    "'frozen': gc.get_freeze_count()}), file=sys.stderr))\n"
)


def _run(code: str) -> tuple[subprocess.CompletedProcess[str], dict[str, object]]:
    proc = subprocess.run(
        [sys.executable, "-c", REPORT + code], capture_output=True, text=True, timeout=120
    )
    return proc, json.loads(proc.stderr.strip().splitlines()[-1])


def test_tune_gc_freezes_start_up_and_collects_the_young_less_often_once() -> None:
    default = _run("")[1]
    assert default["threshold"] == [700, 10, 10]
    assert default["frozen"] == 0
    code = (
        "import gc\n"
        "from collector.runtime import tune_gc\n"
        "tune_gc()\n"
        "frozen = gc.get_freeze_count()\n"
        "keep = [[i] for i in range(1000)]  # new objects after start-up\n"
        "tune_gc()  # once per process: these are not frozen\n"
        "assert gc.get_freeze_count() == frozen, (gc.get_freeze_count(), frozen)\n"
        "assert frozen > 1000, frozen  # the modules imported so far\n"
    )
    proc, tuned = _run(code)
    assert proc.returncode == 0, proc.stderr
    assert tuned["threshold"] == [YOUNG_THRESHOLD, 10, 10]
    assert YOUNG_THRESHOLD == 50_000


def test_the_collect_service_runs_with_them(tmp_path: Path) -> None:
    root = tmp_path / "containers"
    folder = root / "pod-a_main"
    folder.mkdir(parents=True)
    writer = CacheWriter(folder / "0.cache", LAYOUTS["v1.2"], [SimDevice("GPU-0000-runtime")])
    try:
        args = [
            "collect", "--root", str(root), "--log", str(tmp_path / "log"), "--node", "n1",
            "--max-scans", "2", "--interval", "0.05", "--no-nvml", "--no-kubernetes",
        ]  # fmt: skip
        code = f"from collector.cli import main\nraise SystemExit(main({args!r}))\n"
        proc, report = _run(code)
    finally:
        writer.close()
    assert proc.returncode == 0, proc.stderr
    assert report["threshold"] == [YOUNG_THRESHOLD, 10, 10]
    assert isinstance(report["frozen"], int) and report["frozen"] > 1000
    assert list((tmp_path / "log").iterdir())  # it did scan and log
