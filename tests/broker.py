"""Drive the single-node test broker of scripts/kafka.sh from tests."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "kafka.sh"
# Generous: the very first start may download the jars from Maven Central.
_TIMEOUT_S = 600


class BrokerError(RuntimeError):
    pass


def _run(command: str, env: dict[str, str] | None = None) -> str:
    try:
        proc = subprocess.run(
            ["bash", str(SCRIPT), command],
            capture_output=True,
            text=True,
            timeout=_TIMEOUT_S,
            check=False,
            env={**os.environ, **(env or {})},
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


@dataclass(frozen=True)
class SecureBroker:
    """The secured broker of `KAFKA_SECURE=1 scripts/kafka.sh` (see scripts/kafka-secure.sh)."""

    sasl_ssl: str  # TLS + SASL
    ssl: str  # TLS with required client certificates
    internal: str  # plaintext super-user listener (set-up only)
    certs: Path
    secrets: Path

    def password_file(self, user: str) -> Path:
        return self.secrets / f"{user}.password"


def secure_broker() -> SecureBroker:
    """Start the secured broker beside the plaintext one (its own home and ports)."""
    out = _run("start", {"KAFKA_SECURE": "1"})
    fields = dict(line.split("=", 1) for line in out.splitlines())
    return SecureBroker(
        fields["sasl_ssl"],
        fields["ssl"],
        fields["internal"],
        Path(fields["certs"]),
        Path(fields["secrets"]),
    )
