"""Drive the single-node test broker of scripts/kafka.sh from tests."""

from __future__ import annotations

import os
import random
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "kafka.sh"
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


def shared_home() -> Path:
    return Path(os.environ.get("KAFKA_HOME", REPO / ".kafka"))


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


def _free_ports(n: int) -> list[int]:
    """`n` distinct ports free now, below the kernel's range of ephemeral ports: one from that
    range could be taken by some client's connection while the broker is stopped, and the
    restart would find it in use."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    ports: list[int] = []
    while len(ports) < n:
        port = rng.randrange(max(1024, low - 12_000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port not in ports:
            ports.append(port)
    return ports


@dataclass(frozen=True)
class PrivateBroker:
    """A broker of scripts/kafka.sh that only one test uses: its own home and ports, so the
    test may stop and start it without taking the shared broker away from tests running in
    parallel (other sessions on the same machine, whose clients would fail meanwhile)."""

    home: Path
    port: int
    controller_port: int

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _env(self) -> dict[str, str]:
        return {
            "KAFKA_HOME": str(self.home),
            "KAFKA_PORT": str(self.port),
            "KAFKA_CONTROLLER_PORT": str(self.controller_port),
            "KAFKA_SECURE": "0",
            # Beside the shared broker for the rest of the session, with a topic or two.
            "KAFKA_HEAP_OPTS": "-Xms64m -Xmx256m",
        }

    def start(self) -> str:
        return _run("start", self._env())

    def stop(self) -> None:
        _run("stop", self._env())


@contextmanager
def private_broker(home: Path) -> Iterator[PrivateBroker]:
    """A started PrivateBroker under `home` (stopped on exit). It uses the shared home's jars
    (a link, so nothing is fetched twice): start the shared broker first, which installs them."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "libs").symlink_to(shared_home().resolve() / "libs", target_is_directory=True)
    broker = PrivateBroker(home, *_free_ports(2))
    try:
        assert broker.start() == broker.bootstrap
        yield broker
    finally:
        broker.stop()
