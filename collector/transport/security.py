"""How every Kafka client of hami-usage connects: TLS, mutual TLS and SASL over TLS.

One `KafkaSecurity` is built from the settings (collector/config.py `KafkaClientConfig`) and its
`client_kwargs()` are passed to every aiokafka producer, consumer and admin client, so all of
them connect the same way. The password is read from a file or an environment variable, never
a flag, and is kept out of every repr and log line.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from aiokafka.errors import (
    ClusterAuthorizationFailedError,
    GroupAuthorizationFailedError,
    SaslAuthenticationFailed,
    TopicAuthorizationFailedError,
    TransactionalIdAuthorizationFailed,
)

from .. import settings_check as check

Protocol = Literal["PLAINTEXT", "SSL", "SASL_SSL"]
Mechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]

__all__ = [
    "KafkaSecurity",
    "Mechanism",
    "Protocol",
    "Refusal",
    "SecurityError",
    "classify",
    "read_password",
]


class SecurityError(Exception):
    """Settings that cannot make a secured connection; one line for stderr. `kind` is what a
    running service counts it as when files it reads again at each connection break: the TLS
    files (`certificate`) or the password file (`authentication`)."""

    def __init__(
        self, message: str, kind: Literal["certificate", "authentication"] = "certificate"
    ):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class KafkaSecurity:
    protocol: Protocol = "PLAINTEXT"
    ca_file: str | None = None  # none: the system's trusted CAs
    cert_file: str | None = None  # client certificate (mutual TLS), with key_file
    key_file: str | None = None
    check_hostname: bool = True
    sasl_mechanism: Mechanism | None = None
    username: str | None = None
    password: str | None = field(default=None, repr=False)  # from the environment
    # Read again for every client made, as the TLS files are: a Secret fixed or rotated in
    # place is used at the next reconnect, not at the next restart.
    password_file: str | None = None

    def __post_init__(self) -> None:
        if self.password is not None and not check.utf8(self.password):  # its bytes: never shown
            raise SecurityError("HAMI_USAGE_KAFKA_PASSWORD: not UTF-8 text")
        tls = self.protocol in ("SSL", "SASL_SSL")
        if not tls and (self.ca_file or self.cert_file or self.key_file):
            raise SecurityError(
                "kafka_ca_file/kafka_cert_file/kafka_key_file need kafka_security_protocol "
                "SSL or SASL_SSL"
            )
        if bool(self.cert_file) != bool(self.key_file):
            raise SecurityError("kafka_cert_file and kafka_key_file go together")
        if self.protocol == "SASL_SSL":
            if self.sasl_mechanism is None:
                raise SecurityError("kafka_security_protocol SASL_SSL needs kafka_sasl_mechanism")
            if self.password_file and (self.password or "").strip():
                raise SecurityError(
                    "set kafka_password_file or HAMI_USAGE_KAFKA_PASSWORD, not both"
                )
            # An empty password file (or one of only white space: a newline) is no password.
            if not self.username or not (self.current_password() or "").strip():
                raise SecurityError(
                    "SASL needs kafka_username and a password (kafka_password_file or "
                    "HAMI_USAGE_KAFKA_PASSWORD)"
                )
        else:
            # Without SASL they would be ignored: a protocol left at its default, unnoticed.
            # (An empty password is none, as with SASL.)
            sasl = {
                "kafka_sasl_mechanism": self.sasl_mechanism is not None,
                "kafka_username": self.username is not None,
                "kafka_password_file": self.password_file is not None,
                "kafka_password": bool((self.password or "").strip()),
            }
            given = next((name for name, set_ in sasl.items() if set_), None)
            if given is not None:
                raise SecurityError(f"{given} needs kafka_security_protocol SASL_SSL")
        for name in ("ca_file", "cert_file", "key_file"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise SecurityError(f"kafka_{name} {path}: no such file")

    def ssl_context(self) -> ssl.SSLContext:
        try:
            ctx = ssl.create_default_context(cafile=self.ca_file)
            if self.cert_file and self.key_file:
                # Without a callback OpenSSL asks for a passphrase on the terminal (the CLI hung).
                ctx.load_cert_chain(self.cert_file, self.key_file, password=_no_passphrase)
        except (OSError, ssl.SSLError) as exc:
            raise SecurityError(f"kafka TLS files: {exc}") from None
        ctx.check_hostname = self.check_hostname
        return ctx

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for AIOKafkaProducer, AIOKafkaConsumer and AIOKafkaAdminClient."""
        kwargs: dict[str, Any] = {"security_protocol": self.protocol}
        if self.protocol != "PLAINTEXT":
            kwargs["ssl_context"] = self.ssl_context()
        if self.protocol == "SASL_SSL":
            kwargs["sasl_mechanism"] = self.sasl_mechanism
            kwargs["sasl_plain_username"] = self.username
            kwargs["sasl_plain_password"] = self.current_password()
        return kwargs

    def current_password(self) -> str | None:
        """The password as its file holds it now, else the environment's."""
        return read_password(self.password_file, self.password)

    def describe(self) -> str:
        """For log lines: how this client connects, never the secret."""
        if self.protocol == "SASL_SSL":
            return f"SASL_SSL {self.sasl_mechanism} as {self.username}"
        if self.protocol == "SSL" and self.cert_file:
            return "SSL with a client certificate"
        return self.protocol


def _no_passphrase() -> str:
    raise SecurityError("kafka_key_file is encrypted: give an unencrypted PEM key")


def read_password(path: str | None, env_value: str | None) -> str | None:
    """The password from its file (one trailing line end, LF or CRLF, dropped) or, failing
    that, the env. A file saved on Windows ends in CRLF; a password ending in CR is no one's."""
    if path:
        try:
            text = check.small_file(path).decode("utf-8")
        except OSError as exc:
            why = exc.strerror
        except check.SettingError as exc:
            why = str(exc)
        except UnicodeDecodeError:  # its bytes are the secret: never shown
            why = "not UTF-8 text"
        else:
            return text.removesuffix("\n").removesuffix("\r") if text.endswith("\n") else text
        raise SecurityError(f"kafka_password_file {path}: {why}", "authentication")
    return env_value


_AUTHZ = (
    TopicAuthorizationFailedError,
    GroupAuthorizationFailedError,
    TransactionalIdAuthorizationFailed,
    ClusterAuthorizationFailedError,
)


@dataclass(frozen=True)
class Refusal:
    """Why the broker refused this client, when retrying cannot fix it."""

    kind: Literal["authentication", "certificate", "tls", "authorization"]
    detail: str  # one line

    def __str__(self) -> str:
        return self.detail


def classify(exc: BaseException) -> Refusal | None:
    """A refusal (bad credentials, an untrusted or rejected certificate, a missing ACL), or
    None for errors that retrying can fix (broker away, leader moving)."""
    if isinstance(exc, _AUTHZ):
        what = f" {exc.args[0]}" if exc.args else ""
        return Refusal(
            "authorization", f"not authorized: {type(exc).__name__}{what}: an ACL is missing"
        )
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ssl.SSLCertVerificationError):
            return Refusal("certificate", f"broker certificate not trusted: {cause.verify_message}")
        if isinstance(cause, ssl.SSLError):
            return Refusal("tls", f"TLS handshake refused: {cause.reason or cause}")
        cause = cause.__cause__ or cause.__context__
    if isinstance(exc, SaslAuthenticationFailed) or "authentication failed" in str(exc).lower():
        detail = exc.args[0] if exc.args else exc
        return Refusal("authentication", f"SASL authentication failed: {detail}")
    return None
