"""Typed settings from defaults < TOML file < `HAMI_USAGE_*` environment < flags.

Each command's settings are one msgspec Struct: its fields are the TOML keys (in the section
named after the command), the env vars (`HAMI_USAGE_` + upper-case name) and the flags
(`--` + name with '-' for '_'). Validation errors become one line and exit status 2.
"""

from __future__ import annotations

import os
import tomllib
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

from . import settings_check as check

# Every number has a range: finite, and far from where arithmetic on it (seconds * 1000, sums of
# byte counts) could overflow or a loop could never end.
HOUR = 3600.0
DAY = 86400.0
Positive = Annotated[float, Meta(gt=0, le=DAY)]
PositiveInt = Annotated[int, Meta(gt=0, le=2**31 - 1)]
NonNegativeInt = Annotated[int, Meta(ge=0, le=2**31 - 1)]
Bytes = Annotated[int, Meta(ge=0, le=2**62)]
ENV_PREFIX = "HAMI_USAGE_"
# The tables of a `--config` file, one a command (README: Commands and configuration).
SECTIONS = ("collect", "aggregate", "replay", "topics", "demo", "report")


class ConfigError(Exception):
    """A setting that cannot be used; the message is one line for stderr."""


class KafkaClientConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How a command connects to Kafka (collector/transport/security.py). The password has no
    flag (flags show in `ps`): it comes from `kafka_password_file` or HAMI_USAGE_KAFKA_PASSWORD."""

    kafka_security_protocol: Literal["PLAINTEXT", "SSL", "SASL_SSL"] = "PLAINTEXT"
    kafka_ca_file: str | None = None  # PEM CA bundle; none: the system's trusted CAs
    kafka_cert_file: str | None = None  # PEM client certificate for mutual TLS ...
    kafka_key_file: str | None = None  # ... and its unencrypted PEM key
    kafka_check_hostname: bool = True
    kafka_sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    kafka_username: str | None = None
    kafka_password_file: str | None = None
    kafka_password: str | None = None  # env HAMI_USAGE_KAFKA_PASSWORD; a file is preferred

    def __post_init__(self) -> None:
        for name in ("kafka_ca_file", "kafka_cert_file", "kafka_key_file", "kafka_password_file"):
            check.path(name, getattr(self, name))
        if self.kafka_username is not None:
            check.printable("kafka_username", self.kafka_username)


class CollectConfig(KafkaClientConfig, frozen=True, kw_only=True, forbid_unknown_fields=True):
    root: str = "/usr/local/vgpu/containers"
    node: str | None = None  # none: $NODE_NAME, else the host name; "" is refused
    kafka: str | None = None  # bootstrap servers; none: the embedded local log
    topic: str = "hami.usage.v1"
    log: str = "/var/lib/hami-usage/events"  # the embedded log, or the spool with --kafka
    log_max_bytes: Annotated[int, Meta(gt=0, le=2**50)] = 256 * 1024 * 1024
    fsync: bool = False
    interval: Annotated[float, Meta(gt=0, le=HOUR)] = 1.0
    heartbeat: Positive = 30.0
    host_proc: str | None = None  # e.g. /proc with hostPID, or /host/proc
    # When a container counts as present (its limits billed): while its folder exists, or while
    # it has a live process (README: Lifecycles, Presence).
    presence: Literal["folder", "processes"] = "folder"
    linger_ms: Annotated[int, Meta(ge=0, le=60_000)] = 50
    compression: str = "gzip"
    max_scans: PositiveInt | None = None
    nvml: bool = True  # off by itself, with one log line, where there is no driver
    nvml_timeout: Annotated[float, Meta(gt=0, le=HOUR)] = 2.0
    drift_tolerance_bytes: Bytes = 64 * 1024 * 1024
    drift_tolerance_ratio: Annotated[float, Meta(ge=0, le=1000)] = 0.05
    metrics_port: Annotated[int, Meta(ge=0, le=65535)] | None = None
    metrics_bind_address: str = "0.0.0.0"
    metrics_hami: bool = False
    metrics_hami_legacy: bool = False
    # Bounded directory work: a container directory with more entries than this is listed at
    # most once per dir_relist seconds; listings stop for a scan once it spent listing_budget.
    dir_max_entries: Annotated[int, Meta(gt=0, le=10_000_000)] = 1000
    dir_relist: Positive = 60.0
    listing_budget: Annotated[float, Meta(gt=0, le=60)] = 0.2
    # Descriptors (container folders and cache files) kept open across scans; 0 keeps none.
    open_files: Annotated[int, Meta(ge=0, le=1_000_000)] = 16384
    # A slot whose seqlock stays odd, its bytes unchanged, on two scans this far apart (0: on
    # two consecutive scans): a writer killed mid-update.
    stuck_seqlock_after: Annotated[float, Meta(ge=0, le=HOUR)] = 0.0
    kubernetes: bool = True  # the pod watch (names); off by itself, one line, outside a cluster
    kubeconfig: str | None = None  # default: $KUBECONFIG, else the in-cluster service account
    pod_labels: list[str] = []  # pod labels copied into every record (e.g. team, cost-center)
    namespace_labels: list[str] = []  # namespace labels likewise; a pod label of a key wins
    kube_backoff_max: Positive = 30.0  # longest wait between retries of the API server
    kube_watch_timeout: PositiveInt = 300  # timeoutSeconds of one watch request

    def __post_init__(self) -> None:
        super().__post_init__()
        check.path("root", self.root)
        if self.node == "":  # (what deploy/config.toml set before 2026-12-01, for the default)
            raise ValueError("node: must not be empty (leave it out: $NODE_NAME, else host name)")
        if self.node is not None:
            check.node_name("node", self.node)
        check.bootstrap("kafka", self.kafka)
        check.kafka_name("topic", self.topic)
        check.path("log", self.log)
        check.path("host_proc", self.host_proc)
        check.compression("compression", self.compression)
        check.address("metrics_bind_address", self.metrics_bind_address)
        check.path("kubeconfig", self.kubeconfig)


class ReplayConfig(KafkaClientConfig, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What reading and windowing the usage events takes: replay's settings, and the
    aggregator's (which adds its outputs and group below)."""

    kafka: str | None = None  # bootstrap servers; none: the local log `log`
    topic: str = "hami.usage.v1"
    log: str = "/var/lib/hami-usage/events"
    # A record holds integrals of at most 2**63 - 1 milli-units (byte-ms): an hour holds 2.5 TB
    # used all along, a day only 106 GB, so a day's record of a busy 141 GB GPU was refused.
    window: Annotated[float, Meta(gt=0, le=HOUR)] = 60.0
    lateness: Annotated[float, Meta(ge=0, le=DAY)] = 10.0
    max_gap: Annotated[float, Meta(gt=0, le=7 * DAY)] = 90.0
    max_skew: Annotated[float, Meta(gt=0, le=7 * DAY)] = 300.0
    allocation_policy: Literal["cores", "memory", "max", "usage"] = "max"
    idle: Annotated[float, Meta(gt=0, le=7 * DAY)] = 600.0
    csv: str | None = None
    jsonl: str | None = None
    # exit 0 rather than 3 when the input was damaged (the damage is still reported)
    accept_damaged: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check.bootstrap("kafka", self.kafka)
        check.kafka_name("topic", self.topic)
        check.path("log", self.log)
        check.path("csv", self.csv)
        check.path("jsonl", self.jsonl)
        # The windows count milliseconds (cli/windowing.py): a duration is never rounded.
        for name in ("window", "lateness", "max_gap", "max_skew", "idle"):
            check.whole_ms(name, getattr(self, name))


class AggregateConfig(ReplayConfig, frozen=True, kw_only=True, forbid_unknown_fields=True):
    billing_topic: str = "hami.billing.v1"
    parquet: str | None = None  # columnar billing sink, partitioned by day (the report extra)
    group: str = "hami-usage-aggregator"
    otlp: str | None = None  # e.g. http://otel-collector:4318/v1/metrics
    drain: bool = False
    instance: str = "0"  # transactional.id suffix: unique per replica (e.g. the pod name)
    health_port: Annotated[int, Meta(ge=0, le=65535)] | None = None  # /healthz; None: off
    health_bind_address: str = "0.0.0.0"
    billing_format: Literal["json", "msgpack"] = "json"  # billing topic values
    # Where a group with no committed offset starts: earliest, latest or an ISO-8601 time.
    start_from: str = "earliest"

    def __post_init__(self) -> None:
        super().__post_init__()
        check.kafka_name("billing_topic", self.billing_topic)
        check.billing_topic("billing_topic", self.billing_topic, self.topic)
        check.path("parquet", self.parquet)
        check.kafka_name("group", self.group)
        check.http_url("otlp", self.otlp)
        # it names this replica's Parquet parts too: no `/`, nothing a file name cannot hold
        check.kafka_name("instance", self.instance)
        check.address("health_bind_address", self.health_bind_address)


class TopicsConfig(KafkaClientConfig, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The usage and billing topics as `hami-usage topics` creates them and the services expect
    them (`[topics]`; the services read this table of the same file to check the topics)."""

    kafka: str | None = None
    topic: str = "hami.usage.v1"
    billing_topic: str = "hami.billing.v1"
    usage_partitions: PositiveInt = 6
    billing_partitions: PositiveInt = 3
    # Kafka's CreateTopics field is an int16: a larger one was a traceback from the encoder.
    replication_factor: Annotated[int, Meta(gt=0, le=2**15 - 1)] = 3
    min_insync_replicas: Annotated[int, Meta(gt=0, le=2**15 - 1)] = 2
    usage_retention_days: Positive = 400.0  # the replay horizon

    def __post_init__(self) -> None:
        super().__post_init__()
        check.bootstrap("kafka", self.kafka)
        check.kafka_name("topic", self.topic)
        check.kafka_name("billing_topic", self.billing_topic)
        check.billing_topic("billing_topic", self.billing_topic, self.topic)
        check.retention("usage_retention_days", self.usage_retention_days)
        # (here, not in `topics` alone: the services check their topics by this table too)
        if self.min_insync_replicas > self.replication_factor:
            raise ValueError(
                f"min_insync_replicas: {self.min_insync_replicas} is more than "
                f"replication_factor {self.replication_factor}"
            )


C = TypeVar("C", bound=msgspec.Struct)


def _from_env(cls: type[msgspec.Struct], env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in msgspec.structs.fields(cls):
        value = env.get(ENV_PREFIX + f.name.upper())
        if value is not None:
            # A list setting is a comma-separated value in the environment.
            is_list = typing.get_origin(f.type) is list
            out[f.name] = [v.strip() for v in value.split(",") if v.strip()] if is_list else value
    return out


def _from_toml(path: Path, section: str) -> dict[str, Any]:
    try:
        data = tomllib.loads(check.small_file(path).decode("utf-8"))
    except OSError as exc:
        raise ConfigError(f"config {path}: {exc.strerror}") from None
    except check.SettingError as exc:
        raise ConfigError(f"config {path}: {exc}") from None
    except UnicodeDecodeError as exc:  # TOML is UTF-8; the bytes are not shown
        raise ConfigError(f"config {path}: not UTF-8 text (byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config {path}: {exc}") from None
    except ValueError:  # (the one ValueError tomllib lets out: int() refusing the digits)
        raise ConfigError(f"config {path}: an integer of more than 4300 digits") from None
    except RecursionError:  # (tomllib recurses once per nested array or inline table)
        raise ConfigError(f"config {path}: values nested too deeply") from None
    table = data.get(section, {})
    if not isinstance(table, dict):
        raise ConfigError(f"config {path}: [{section}] must be a table")
    # A key outside the tables, or a misspelled table ([colect]), would be ignored silently.
    for key, value in data.items():
        if key not in SECTIONS or not isinstance(value, dict):
            raise ConfigError(
                f"config {path}: {check.shown(key)} is not one of the tables {', '.join(SECTIONS)}"
            )
    return table


def load(
    cls: type[C],
    section: str,
    *,
    config_file: Path | None = None,
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> C:
    """Merge the sources (later wins) and validate into `cls`."""
    merged: dict[str, Any] = {}
    if config_file is not None:
        merged.update(_from_toml(config_file, section))
    env_values = _from_env(cls, os.environ if env is None else env)
    merged.update(env_values)
    merged.update({k: v for k, v in (flags or {}).items() if v is not None})
    try:
        # strict=False: environment values are strings ("5", "true") to be converted.
        return msgspec.convert(merged, cls, strict=False)
    except msgspec.ValidationError as exc:
        message = str(exc)
        # "... - at `$.name[0]`" names the setting; an unknown key (a name of anyone's choosing,
        # "`$.y" included) is quoted in the message itself, which has no such suffix.
        head, sep, where = message.rpartition(" - at `$.")
        if sep:
            message = f"{where.rstrip('`').split('[')[0].split('.')[0]}: {head}"
        # msgspec quotes an unknown key as it is: a newline in it would make two lines.
        shown = check.one_line(message)
        raise ConfigError(f"invalid setting {shown}") from None
