"""Drive the single-node test broker of scripts/kafka.sh from tests."""

from __future__ import annotations

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "kafka.sh"
# Generous: the very first start may download the jars from Maven Central.
_TIMEOUT_S = 600


class BrokerError(RuntimeError):
    pass


def _run(command: str) -> str:
    try:
        proc = subprocess.run(
            ["bash", str(SCRIPT), command],
            capture_output=True,
            text=True,
            timeout=_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise BrokerError(f"scripts/kafka.sh {command} timed out after {_TIMEOUT_S}s") from exc
    if proc.returncode != 0:
        # stderr carries the tail of .kafka/kafka.log on a failed start.
        raise BrokerError(
            f"scripts/kafka.sh {command} failed (exit {proc.returncode}):\n{proc.stderr}"
        )
    return proc.stdout.strip()


def start_broker() -> str:
    """Start the broker if it is not running, wait until it serves requests, return its address."""
    return _run("start")


def stop_broker() -> None:
    """Stop the broker, keeping its data dir, so start_broker() brings back topics and offsets."""
    _run("stop")


def bootstrap() -> str:
    """Bootstrap address of a running, ready broker (started here if needed)."""
    return start_broker()
