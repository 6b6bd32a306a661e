"""What every command with `--kafka` shares: the security flags and their settings, a broker's
errors as one line, and log lines that do not repeat a broker's retries."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ..config import KafkaClientConfig
from ..transport.kafka import BrokerUnreachable
from .args import UsageError, say, switch

if TYPE_CHECKING:
    from collections.abc import Coroutine

    from ..transport.consumer import ConsumerSettings
    from ..transport.security import KafkaSecurity

# The KafkaClientConfig fields the security flags set; each command's flag list includes them.
KAFKA_FLAGS = [
    "kafka_security_protocol",
    "kafka_ca_file",
    "kafka_cert_file",
    "kafka_key_file",
    "kafka_check_hostname",
    "kafka_sasl_mechanism",
    "kafka_username",
    "kafka_password_file",
]


def kafka_flags(p: argparse.ArgumentParser) -> None:
    """Security flags, the same for every command with --kafka. The password has none: it
    comes from a file or HAMI_USAGE_KAFKA_PASSWORD (flags show in `ps`)."""
    g = p.add_argument_group("Kafka security")
    g.add_argument(
        "--kafka-security-protocol",
        choices=["PLAINTEXT", "SSL", "SASL_SSL"],
        help="PLAINTEXT (default), SSL (TLS, mutual with a client certificate) or SASL_SSL",
    )
    g.add_argument("--kafka-ca-file", metavar="PEM", help="CA bundle (default: the system's)")
    g.add_argument("--kafka-cert-file", metavar="PEM", help="client certificate (mutual TLS)")
    g.add_argument("--kafka-key-file", metavar="PEM", help="its private key (unencrypted)")
    switch(
        g, "--kafka-check-hostname", "check the broker's certificate names its host (default on)"
    )
    g.add_argument(
        "--kafka-sasl-mechanism",
        choices=["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"],
        help="SASL mechanism (with SASL_SSL)",
    )
    g.add_argument("--kafka-username", help="SASL user name")
    g.add_argument(
        "--kafka-password-file",
        metavar="FILE",
        help="file holding the SASL password (or set HAMI_USAGE_KAFKA_PASSWORD)",
    )


def kafka_security(cfg: KafkaClientConfig, command: str) -> KafkaSecurity:
    """The one place settings become the Kafka clients' security; bad settings exit 2."""
    from ..transport.security import KafkaSecurity, SecurityError

    try:
        security = KafkaSecurity(
            protocol=cfg.kafka_security_protocol,
            ca_file=cfg.kafka_ca_file,
            cert_file=cfg.kafka_cert_file,
            key_file=cfg.kafka_key_file,
            check_hostname=cfg.kafka_check_hostname,
            sasl_mechanism=cfg.kafka_sasl_mechanism,
            username=cfg.kafka_username,
            password=cfg.kafka_password,
            password_file=cfg.kafka_password_file,
        )
        security.client_kwargs()  # unreadable certificate or key files: now, not at connect
    except SecurityError as exc:
        raise UsageError(f"hami-usage {command}: {exc}") from None
    return security


@contextmanager
def kafka_errors(command: str) -> Iterator[None]:
    """A broker that is away or refuses us, or a topic that is not there: one line, exit 1."""
    from aiokafka.errors import KafkaError

    from ..transport.security import classify

    try:
        yield
    except BrokerUnreachable as exc:
        say(f"hami-usage {command}: {exc}")
        raise SystemExit(1) from None
    except KafkaError as exc:
        refusal = classify(exc)
        detail = f"Kafka refused: {refusal}" if refusal else f"Kafka: {exc}"
        cause = exc.__cause__
        if cause is not None and not refusal:
            # aiokafka wraps what stopped its sender ("Unexpected error during batch
            # delivery"): e.g. InvalidProducerIdMapping, a broker that lost its state.
            detail += f" ({type(cause).__name__}: {cause})"
        say(f"hami-usage {command}: {detail}")
        raise SystemExit(1) from None


def run_kafka(command: str, coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a command's Kafka work under `kafka_errors`."""
    import asyncio

    with kafka_errors(command):
        return asyncio.run(coro)


def reader(cfg: KafkaClientConfig, command: str, bootstrap: str | None) -> ConsumerSettings | None:
    """How `replay` and `report` read a topic: no group, the command's security. None without
    a broker, once the security settings are checked all the same (inconsistent ones exit 2
    whether or not they are used)."""
    from ..transport.consumer import ConsumerSettings

    security = kafka_security(cfg, command)
    return ConsumerSettings(bootstrap, f"hami-usage-{command}", security) if bootstrap else None


def start_logging(level: int) -> None:
    """Timestamped log lines; aiokafka's connection errors while a broker is away are
    repeated once per distinct message and period, not forty times a second."""
    from ..transport.kafka import QuietRetries, UnreadKafkaErrors

    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(QuietRetries())
    logging.getLogger("asyncio").addFilter(UnreadKafkaErrors())
