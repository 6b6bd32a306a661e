"""The operators' tools the tests run for real (promtool, otelcol, helm, compose-check), from
scripts/tools.sh: built or unpacked once into a cache shared by every checkout, then reused."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@functools.cache
def tool(name: str) -> Path:
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "tools.sh"), name],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, f"scripts/tools.sh {name} failed:\n{out.stderr[-4000:]}"
    path = Path(out.stdout.strip().splitlines()[-1])
    assert path.is_file(), out.stderr
    return path


def promtool_check_metrics(exposition: str) -> subprocess.CompletedProcess[str]:
    """`promtool check metrics` on one scrape (stdin); its lint findings are on stderr."""
    return subprocess.run(
        [str(tool("promtool")), "check", "metrics"],
        input=exposition,
        capture_output=True,
        text=True,
        timeout=60,
    )
