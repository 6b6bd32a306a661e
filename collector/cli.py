"""`hami-usage`: flags -> typed settings -> the stages. No pipeline logic lives here."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import msgspec

from . import settings_check as check
from .aggregate.damage import EXIT_CHECKPOINT, EXIT_DAMAGED, CheckpointError, DamageReport
from .config import (
    AggregateConfig,
    CollectConfig,
    ConfigError,
    KafkaClientConfig,
    ReplayConfig,
    TopicsConfig,
    load,
)
from .layout.declarations import LAYOUTS
from .layout.reader import read_snapshot
from .layout.snapshot import Snapshot
from .transport.kafka import BrokerUnreachable
from .transport.locallog import LogLockedError

C = TypeVar("C", bound=msgspec.Struct)

if TYPE_CHECKING:
    from collections.abc import Coroutine

    from .aggregate.windows import WindowSettings
    from .node.podwatch import KubeSettings
    from .transport.consumer import ConsumerSettings
    from .transport.security import KafkaSecurity
    from .transport.topics import TopicPlan


class UsageError(Exception):
    """Bad flags or config: one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """No abbreviated options: `--kafka-password S` would be taken for `--kafka-password-file`
    and its value echoed as a file name. An unknown option's values are not echoed either: they
    may be secrets typed to an option that does not exist."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        head, _, rest = message.partition(": ")
        if head == "unrecognized arguments":
            options = [a for a in rest.split() if a.startswith("-")]
            shown = " ".join(a.partition("=")[0] for a in options) or "(values not shown)"
            message = f"{head}: {shown}"
        raise UsageError(f"{self.prog}: {message}")


def _positive(kind: Callable[[str], float], most: float = 86400.0) -> Callable[[str], float]:
    """A number in (0, most]: finite, so no loop waits forever on it."""

    def parse(text: str) -> float:
        value = kind(text)
        if not 0 < value <= most:  # NaN fails too
            raise argparse.ArgumentTypeError(f"must be > 0 and <= {most:g}, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def _faults(text: str) -> frozenset[str]:
    from .simulate_faults import parse_faults

    try:
        return parse_faults(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _cmd_inspect(args: argparse.Namespace) -> int:
    path = Path(args.path)
    try:
        # Inside the try: is_dir() raises PermissionError under a directory we cannot search.
        if path.is_dir():
            print(f"hami-usage inspect: {path}: is a directory, not a cache file", file=sys.stderr)
            return 1
        if path.exists() and not path.is_file():
            print(f"hami-usage inspect: {path}: not a regular file", file=sys.stderr)
            return 1
        snap = read_snapshot(path)
    except FileNotFoundError:
        print(f"hami-usage inspect: {path}: no such file", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"hami-usage inspect: {path}: cannot open: {exc.strerror}", file=sys.stderr)
        return 1
    if args.json:
        sys.stdout.buffer.write(msgspec.json.encode(snap) + b"\n")
    else:
        sys.stdout.write(format_table(snap))
    return 0


def format_table(snap: Snapshot) -> str:
    version = "" if snap.major is None else f" (header {snap.major}.{snap.minor})"
    lines = [
        f"{snap.path}: {snap.size} bytes, layout {snap.layout or 'unknown'}{version}",
        f"initialized {snap.initialized}  device_num {snap.device_num}  proc_num {snap.proc_num}"
        f"  priority {snap.priority}  utilization_switch {snap.utilization_switch}"
        f"  recent_kernel {snap.recent_kernel}  last_kernel_time {snap.last_kernel_time}",
        "",
        f"{'dev':>3}  {'uuid':<44} {'limit MiB':>10} {'sm %':>5}",
    ]
    for d in snap.devices:
        lines.append(f"{d.index:>3}  {d.uuid:<44} {d.limit_bytes / 2**20:>10.1f} {d.sm_limit:>5}")
    lines += [
        "",
        f"{'slot':>4} {'pid':>7} {'hostpid':>8} {'st':>2} {'dev':>3} "
        f"{'total MiB':>10} {'ctx MiB':>8} {'data MiB':>9} {'nvml MiB':>9} {'sm %':>5}",
    ]
    for p in snap.procs:
        for u in p.devices:
            lines.append(
                f"{p.slot:>4} {p.pid:>7} {p.hostpid:>8} {p.status:>2} {u.index:>3} "
                f"{u.total / 2**20:>10.1f} {u.context / 2**20:>8.1f} {u.data / 2**20:>9.1f} "
                f"{u.monitor / 2**20:>9.1f} {u.sm_util:>5}"
            )
    lines.append("")
    lines += [f"anomaly {a.kind}: {a.detail}" for a in snap.anomalies] or ["no anomalies"]
    return "\n".join(lines) + "\n"


def _cmd_simulate(args: argparse.Namespace) -> int:
    from .simulate import run

    root = Path(args.root)
    if root.exists() and not root.is_dir():
        raise UsageError(f"hami-usage simulate: --root {root}: not a directory")
    steps = run(
        Path(args.root),
        args.containers,
        args.layout,
        args.duration,
        args.interval,
        args.seed,
        args.faults or frozenset(),
    )
    print(f"simulated {args.containers} containers for {steps} steps under {args.root}")
    return 0


def _settings(args: argparse.Namespace, cls: type[C], section: str, names: list[str]) -> C:
    flags = {name: getattr(args, name) for name in names}
    try:
        return load(cls, section, config_file=args.config, flags=flags)
    except ConfigError as exc:
        raise UsageError(f"hami-usage {section}: {exc}") from None


@contextmanager
def _machine(section: str) -> Iterator[None]:
    """Checks of the machine at start (outputs writable, roots allowed): each failure is one
    line and exit 2, before anything starts."""
    try:
        yield
    except check.SettingError as exc:
        raise UsageError(f"hami-usage {section}: {exc}") from None


def _outputs(section: str, cfg: ReplayConfig) -> None:
    with _machine(section):
        if cfg.csv:
            check.writable_file("--csv", cfg.csv)
        if cfg.jsonl:
            check.writable_file("--jsonl", cfg.jsonl)


def _security(cfg: KafkaClientConfig, command: str) -> KafkaSecurity:
    """The one place settings become the Kafka clients' security; bad settings exit 2."""
    from .transport.security import KafkaSecurity, SecurityError, read_password

    try:
        security = KafkaSecurity(
            protocol=cfg.kafka_security_protocol,
            ca_file=cfg.kafka_ca_file,
            cert_file=cfg.kafka_cert_file,
            key_file=cfg.kafka_key_file,
            check_hostname=cfg.kafka_check_hostname,
            sasl_mechanism=cfg.kafka_sasl_mechanism,
            username=cfg.kafka_username,
            password=read_password(cfg.kafka_password_file, cfg.kafka_password),
        )
        security.client_kwargs()  # unreadable certificate or key files: now, not at connect
    except SecurityError as exc:
        raise UsageError(f"hami-usage {command}: {exc}") from None
    return security


def _topic_plan(args: argparse.Namespace, usage: str, billing: str) -> TopicPlan:
    """The `[topics]` table of the same config file (and env), for the start-up check."""
    try:
        t = load(TopicsConfig, "topics", config_file=args.config)
    except ConfigError as exc:
        raise UsageError(f"hami-usage topics: {exc}") from None
    return _plan(t, usage, billing)


def _plan(t: TopicsConfig, usage: str, billing: str) -> TopicPlan:
    from .transport.topics import TopicPlan

    return TopicPlan(
        usage,
        billing,
        t.usage_partitions,
        t.billing_partitions,
        t.replication_factor,
        t.min_insync_replicas,
        t.usage_retention_days,
    )


@contextmanager
def _kafka_errors(command: str) -> Iterator[None]:
    """A broker that is away or refuses us, or a topic that is not there: one line, exit 1."""
    from aiokafka.errors import KafkaError

    from .transport.security import classify

    try:
        yield
    except BrokerUnreachable as exc:
        print(f"hami-usage {command}: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    except KafkaError as exc:
        refusal = classify(exc)
        detail = f"Kafka refused: {refusal}" if refusal else f"Kafka: {exc}"
        print(f"hami-usage {command}: {detail}", file=sys.stderr)
        raise SystemExit(1) from None


def _run_kafka(command: str, coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a command's Kafka work under `_kafka_errors`."""
    import asyncio

    with _kafka_errors(command):
        return asyncio.run(coro)


def _reader(cfg: KafkaClientConfig, command: str, bootstrap: str) -> ConsumerSettings:
    """How `replay` and `report` read a topic: no group, the command's security."""
    from .transport.consumer import ConsumerSettings

    return ConsumerSettings(bootstrap, f"hami-usage-{command}", _security(cfg, command))


def _logging(level: int) -> None:
    """Timestamped log lines; aiokafka's connection errors while a broker is away are
    repeated once per distinct message and period, not forty times a second."""
    from .transport.kafka import QuietRetries

    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(QuietRetries())


def _cmd_collect(args: argparse.Namespace) -> int:
    import asyncio
    import os
    import socket

    from .node.crosscheck import DriftTolerance
    from .node.discover import ListingLimits
    from .node.podwatch import KubeConfigError
    from .node.service import CollectSettings, collect
    from .node.writer_faults import WriterFaultSettings
    from .transport.http import ListenError
    from .transport.kafka import ProducerSettings

    if args.node == "":
        raise UsageError("hami-usage collect: --node must not be empty")
    cfg = _settings(args, CollectConfig, "collect", COLLECT_FLAGS)
    root = Path(cfg.root)
    node = cfg.node or os.environ.get("NODE_NAME") or socket.gethostname()
    with _machine("collect"):
        check.cache_root("--root", cfg.root)
        check.writable_dir("--log", cfg.log)
        if cfg.host_proc is not None and not os.path.isdir(cfg.host_proc):
            raise check.SettingError(f"--host-proc {cfg.host_proc}: not a directory")
        if cfg.kafka:
            check.compression_available("--compression", cfg.compression)
        try:
            check.node_name("node", node)
        except ValueError as exc:
            raise check.SettingError(f"{exc} (from $NODE_NAME or the host name)") from None
    kafka = None
    if cfg.kafka:
        kafka = ProducerSettings(
            cfg.kafka,
            topic=cfg.topic,
            linger_ms=cfg.linger_ms,
            compression=cfg.compression,
            security=_security(cfg, "collect"),
            expect=(_topic_plan(args, cfg.topic, "").usage(),),
        )
    settings = CollectSettings(
        root=root,
        node=node,
        log_dir=Path(cfg.log),
        kafka=kafka,
        interval_s=cfg.interval,
        heartbeat_s=cfg.heartbeat,
        host_proc=cfg.host_proc,
        presence=cfg.presence,
        log_max_bytes=cfg.log_max_bytes,
        fsync=cfg.fsync,
        max_scans=cfg.max_scans,
        nvml=cfg.nvml,
        nvml_timeout_s=cfg.nvml_timeout,
        drift=DriftTolerance(cfg.drift_tolerance_bytes, cfg.drift_tolerance_ratio),
        metrics_port=cfg.metrics_port,
        metrics_bind_address=cfg.metrics_bind_address,
        metrics_hami=cfg.metrics_hami,
        metrics_hami_legacy=cfg.metrics_hami_legacy,
        listing=ListingLimits(
            cfg.dir_max_entries, cfg.dir_relist, cfg.listing_budget, cfg.open_files
        ),
        writer_faults=WriterFaultSettings(cfg.stuck_seqlock_after),
        kube=_kube(cfg),
    )
    _logging(logging.INFO)
    if cfg.kubernetes and settings.kube is None:
        logging.getLogger("collector.node.podwatch").info(
            "not in a cluster and no --kubeconfig or $KUBECONFIG: pod names are off"
        )
    try:
        asyncio.run(collect(settings))
    except KubeConfigError as exc:
        raise UsageError(f"hami-usage collect: {exc}") from None
    except LogLockedError as exc:
        print(f"hami-usage collect: {exc}", file=sys.stderr)
        return 1
    except ListenError as exc:
        raise UsageError(f"hami-usage collect: --metrics-port {exc}") from None
    return 0


def _kube(cfg: CollectConfig) -> KubeSettings | None:
    """The pod watch's settings; None when it is off or there is nothing to connect with."""
    import os

    from .node.podwatch import KubeSettings

    if not cfg.kubernetes:
        return None
    kubeconfig = cfg.kubeconfig or os.environ.get("KUBECONFIG") or None
    if kubeconfig is not None:
        kubeconfig = kubeconfig.split(os.pathsep)[0]  # kubectl merges a list; the first here
        if not Path(kubeconfig).is_file():
            raise UsageError(f"hami-usage collect: --kubeconfig {kubeconfig}: no such file")
    elif not os.environ.get("KUBERNETES_SERVICE_HOST"):
        return None
    for name in (*cfg.pod_labels, *cfg.namespace_labels):
        if not name or len(name) > 317 or any(c.isspace() or c == "," for c in name):
            raise UsageError(f"hami-usage collect: {name!r} is not a label key")
    return KubeSettings(
        kubeconfig=kubeconfig,
        pod_labels=tuple(cfg.pod_labels),
        namespace_labels=tuple(cfg.namespace_labels),
        backoff_max_s=cfg.kube_backoff_max,
        backoff_initial_s=min(0.5, cfg.kube_backoff_max),
        watch_timeout_s=cfg.kube_watch_timeout,
    )


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import DemoSettings, format_report, run_demo

    if args.duration is not None and args.duration < 5:
        raise UsageError("hami-usage demo: --duration must be at least 5 seconds")
    cfg = _settings(args, KafkaClientConfig, "demo", KAFKA_FLAGS)
    settings = DemoSettings(
        duration_s=args.duration or DemoSettings.duration_s,
        out=Path(args.out),
        kafka=args.kafka,
        security=_security(cfg, "demo"),
    )
    result = _run_kafka("demo", run_demo(settings))
    sys.stdout.write(format_report(result))
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    try:
        import matplotlib  # noqa: F401
        import pyarrow  # noqa: F401
    except ImportError as exc:
        raise UsageError(
            f"hami-usage report: needs the report extra (pip install 'hami-usage[report]'): {exc}"
        ) from None
    from .report.bill import to_csv
    from .report.command import ReportArgs, make_report, table_text
    from .report.html import render
    from .report.load import LoadError
    from .report.prices import PriceError, Prices
    from .report.summary import parse_by

    from_ms = _iso_ms("--from", args.from_, "report")
    to_ms = _iso_ms("--to", args.to, "report")
    if to_ms <= from_ms:
        raise UsageError("hami-usage report: --to must be after --from")
    if not (args.csv or args.jsonl or args.parquet or args.kafka):
        raise UsageError("hami-usage report: give --csv, --jsonl, --parquet or --kafka")
    try:
        by = parse_by(args.by)
        prices = Prices.load(Path(args.prices)) if args.prices else Prices()
    except (ValueError, PriceError) as exc:
        raise UsageError(f"hami-usage report: {exc}") from None
    cfg = _settings(args, KafkaClientConfig, "report", KAFKA_FLAGS)
    report_args = ReportArgs(
        from_ms=from_ms,
        to_ms=to_ms,
        by=by,
        prices=prices,
        csv=[Path(x) for x in args.csv or []],
        jsonl=[Path(x) for x in args.jsonl or []],
        parquet=Path(args.parquet) if args.parquet else None,
        kafka=_reader(cfg, "report", args.kafka) if args.kafka else None,
        billing_topic=args.billing_topic,
    )
    _logging(logging.WARNING)
    try:
        with _kafka_errors("report"):
            bill, summary = make_report(report_args)
    except LoadError as exc:
        print(f"hami-usage report: {exc}", file=sys.stderr)
        return 1
    if args.out_csv:
        Path(args.out_csv).write_text(to_csv(bill))
    if args.html:
        title = f"GPU chargeback {args.from_} .. {args.to}"
        Path(args.html).write_text(render(bill, summary, title))
    sys.stdout.write(table_text(bill))
    return 0


def _cmd_schema(args: argparse.Namespace) -> int:
    from .aggregate import billing
    from .events import json_schema

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, schema in (
        ("events.schema.json", json_schema()),
        ("billing.schema.json", billing.json_schema()),
    ):
        target = out / name
        target.write_bytes(msgspec.json.format(msgspec.json.encode(schema), indent=2) + b"\n")
        print(f"wrote {target}")
    return 0


def _window(cfg: AggregateConfig | ReplayConfig) -> WindowSettings:
    from .aggregate.windows import WindowSettings

    return WindowSettings(
        window_ms=round(cfg.window * 1000),
        lateness_ms=round(cfg.lateness * 1000),
        max_gap_ms=round(cfg.max_gap * 1000),
        max_skew_ms=round(cfg.max_skew * 1000),
        allocation_policy=cfg.allocation_policy,
        idle_ms=round(cfg.idle * 1000),
    )


def _cmd_aggregate(args: argparse.Namespace) -> int:
    from .aggregate.service import AggregateSettings, aggregate
    from .transport.http import ListenError

    cfg = _settings(args, AggregateConfig, "aggregate", AGGREGATE_FLAGS)
    if cfg.window * 1000 % 1:
        raise UsageError("hami-usage aggregate: --window must be a whole number of milliseconds")
    _outputs("aggregate", cfg)
    settings = AggregateSettings(
        window=_window(cfg),
        kafka=cfg.kafka,
        topic=cfg.topic,
        billing_topic=cfg.billing_topic,
        group=cfg.group,
        log_dir=Path(cfg.log),
        csv=cfg.csv,
        jsonl=cfg.jsonl,
        parquet=cfg.parquet,
        otlp=cfg.otlp,
        drain=cfg.drain,
        instance=cfg.instance,
        health_port=cfg.health_port,
        health_bind_address=cfg.health_bind_address,
        billing_format=cfg.billing_format,
        start_from=_start_from(cfg.start_from),
    )
    if cfg.kafka:
        settings.security = _security(cfg, "aggregate")
        settings.topics = _topic_plan(args, cfg.topic, cfg.billing_topic).specs()
    if not cfg.kafka and not Path(cfg.log).is_dir():
        raise UsageError(f"hami-usage aggregate: --log {cfg.log}: not a directory")
    _logging(logging.INFO)
    try:
        _run_kafka("aggregate", aggregate(settings))
    except CheckpointError as exc:
        print(f"hami-usage aggregate: {exc}", file=sys.stderr)
        return EXIT_CHECKPOINT
    except ListenError as exc:
        raise UsageError(f"hami-usage aggregate: --health-port {exc}") from None
    return _damage_exit("aggregate", settings.stats.damage, cfg.accept_damaged, cfg.drain)


def _damage_exit(command: str, damage: DamageReport, accept: bool, ends: bool) -> int:
    """EXIT_DAMAGED when a run that ends by itself read damaged input, unless accepted."""
    if not ends or not damage.damaged:
        return 0
    if accept:
        print(f"hami-usage {command}: {damage.line()} (accepted)", file=sys.stderr)
        return 0
    print(
        f"hami-usage {command}: input damaged, records may be incomplete: {damage.line()} "
        f"(exit {EXIT_DAMAGED}; --accept-damaged to accept)",
        file=sys.stderr,
    )
    return EXIT_DAMAGED


def _start_from(text: str) -> str | int:
    if text in ("earliest", "latest"):
        return text
    return _iso_ms("--start-from", text, "aggregate")


def _cmd_topics(args: argparse.Namespace) -> int:
    from .transport.topics import apply_plan

    cfg = _settings(args, TopicsConfig, "topics", TOPICS_FLAGS)
    if not cfg.kafka:
        raise UsageError("hami-usage topics: --kafka BOOTSTRAP is required")
    if cfg.min_insync_replicas > cfg.replication_factor:
        raise UsageError(
            "hami-usage topics: --min-insync-replicas must not exceed --replication-factor"
        )
    plan = _plan(cfg, cfg.topic, cfg.billing_topic)
    security = _security(cfg, "topics")
    ok: bool = _run_kafka("topics", apply_plan(cfg.kafka, security, plan, args.apply, sys.stdout))
    return 0 if ok else 1


def _cmd_decode(args: argparse.Namespace) -> int:
    from .decode import decode_stream

    return decode_stream(sys.stdin.buffer, sys.stdout.buffer, sys.stderr, args.framing)


def _iso_ms(flag: str, text: str, command: str = "replay") -> int:
    from datetime import UTC, datetime

    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise UsageError(
            f"hami-usage {command}: {flag} {text!r}: not an ISO-8601 time"
            + (" (or earliest, latest)" if command == "aggregate" else "")
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return round(when.timestamp() * 1000)


def _cmd_replay(args: argparse.Namespace) -> int:
    from .replay import ReplayRange, replay_kafka, replay_local

    cfg = _settings(args, ReplayConfig, "replay", REPLAY_FLAGS)
    rng = ReplayRange(_iso_ms("--from", args.from_), _iso_ms("--to", args.to))
    if rng.to_ms <= rng.from_ms:
        raise UsageError("hami-usage replay: --to must be after --from")
    if not cfg.csv and not cfg.jsonl:
        raise UsageError("hami-usage replay: give --csv FILE or --jsonl FILE")
    _outputs("replay", cfg)
    window = _window(cfg)
    _logging(logging.WARNING)
    if cfg.kafka:
        source = _reader(cfg, "replay", cfg.kafka)
        written, stats = _run_kafka(
            "replay", replay_kafka(source, cfg.topic, window, rng, cfg.csv, cfg.jsonl)
        )
    else:
        if not Path(cfg.log).is_dir():
            raise UsageError(f"hami-usage replay: --log {cfg.log}: not a directory")
        written, stats = replay_local(Path(cfg.log), window, rng, cfg.csv, cfg.jsonl)
    print(
        f"replay: {written} records; undecodable={stats.undecodable} "
        f"unknown_schema={stats.unknown_schema}; {stats.damage.line()}",
        file=sys.stderr,
    )
    return _damage_exit("replay", stats.damage, cfg.accept_damaged, True)


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
REPLAY_FLAGS = [
    "accept_damaged",
    "kafka",
    "topic",
    "log",
    "window",
    "lateness",
    "max_gap",
    "max_skew",
    "allocation_policy",
    "idle",
    "csv",
    "jsonl",
    *KAFKA_FLAGS,
]
AGGREGATE_FLAGS = [
    *REPLAY_FLAGS,
    "parquet",
    "billing_topic",
    "group",
    "otlp",
    "drain",
    "instance",
    "health_port",
    "health_bind_address",
    "billing_format",
    "start_from",
]
TOPICS_FLAGS = [
    "kafka",
    "topic",
    "billing_topic",
    "usage_partitions",
    "billing_partitions",
    "replication_factor",
    "min_insync_replicas",
    "usage_retention_days",
    *KAFKA_FLAGS,
]
COLLECT_FLAGS = [
    "root",
    "node",
    "kafka",
    "topic",
    "log",
    "log_max_bytes",
    "fsync",
    "interval",
    "heartbeat",
    "host_proc",
    "presence",
    "linger_ms",
    "compression",
    "max_scans",
    "nvml",
    "nvml_timeout",
    "drift_tolerance_bytes",
    "drift_tolerance_ratio",
    "metrics_port",
    "metrics_bind_address",
    "metrics_hami",
    "metrics_hami_legacy",
    "dir_max_entries",
    "dir_relist",
    "listing_budget",
    "open_files",
    "stuck_seqlock_after",
    "kubernetes",
    "kubeconfig",
    "pod_labels",
    "namespace_labels",
    "kube_backoff_max",
    "kube_watch_timeout",
    *KAFKA_FLAGS,
]


def _window_flags(p: argparse.ArgumentParser) -> None:
    """The windowing settings `aggregate` and `replay` share (WindowSettings)."""
    p.add_argument("--window", type=float, help="window length in seconds (default 60)")
    p.add_argument("--lateness", type=float, help="allowed lateness in seconds (default 10)")
    p.add_argument("--max-gap", type=float, help="longest a sample holds, seconds (default 90)")
    p.add_argument(
        "--max-skew", type=float, help="events this far ahead of their record time are future"
    )
    p.add_argument(
        "--allocation-policy",
        metavar="{cores,memory,max,usage}",
        help="how a GPU's time is shared out among its containers (default max)",
    )
    p.add_argument(
        "--idle", type=float, help="a node silent this long no longer holds windows open"
    )


def _kafka_flags(p: argparse.ArgumentParser) -> None:
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
    g.add_argument(
        "--kafka-check-hostname",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="check the broker's certificate names its host (default on)",
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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hami-usage", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("inspect", help="parse one cache file read-only and print what it holds")
    p.add_argument("path", help="a HAMi-core .cache file")
    p.add_argument("--json", action="store_true", help="print one JSON object (a stable contract)")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("simulate", help="write cache files the way HAMi-core does (tests, demo)")
    p.add_argument("--root", required=True, help="folder to create <podUID>_<container>/ in")
    p.add_argument(
        "--containers",
        type=_positive(int, 4096),
        default=4,
        help="number of containers (default 4)",
    )
    p.add_argument(
        "--layout", choices=[*LAYOUTS, "mixed"], default="v1.2", help="layout of the files"
    )
    p.add_argument("--duration", type=_positive(float), default=10.0, help="seconds (default 10)")
    p.add_argument("--interval", type=_positive(float), default=0.5, help="seconds between steps")
    p.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    p.add_argument(
        "--faults",
        type=_faults,
        metavar="F[,F...]",
        help="inject the real library's failure modes: killed-mid-update, stale-pointer, "
        "stale-util, real-semaphores",
    )
    p.set_defaults(func=_cmd_simulate)

    p = sub.add_parser("collect", help="node collector: cache files -> events (local log, Kafka)")
    p.add_argument("--config", type=Path, help="TOML file; settings in its [collect] table")
    p.add_argument(
        "--root", help="folder of <podUID>_<container>/ (default /usr/local/vgpu/containers)"
    )
    p.add_argument("--node", help="node name, the Kafka key (default $NODE_NAME, else host name)")
    p.add_argument(
        "--kafka", metavar="BOOTSTRAP", help="Kafka bootstrap servers; default: no broker"
    )
    p.add_argument("--topic", help="usage topic (default hami.usage.v1)")
    p.add_argument(
        "--log",
        metavar="DIR",
        help="local log: the events with no broker, the spool "
        "with --kafka (default /var/lib/hami-usage/events)",
    )
    p.add_argument("--log-max-bytes", type=int, help="bound of the local log (default 256 MiB)")
    p.add_argument("--fsync", action="store_true", default=None, help="fsync the log every scan")
    p.add_argument("--interval", type=float, help="seconds between scans (default 1)")
    p.add_argument("--heartbeat", type=float, help="seconds between heartbeats (default 30)")
    p.add_argument(
        "--host-proc",
        metavar="DIR",
        help="the host's /proc (hostPID): report stale_process for slots whose host pid is gone",
    )
    p.add_argument(
        "--presence",
        metavar="{folder,processes}",
        help="a container is present (its limits billed) while its folder exists, or while it "
        "has a live process (default folder)",
    )
    p.add_argument("--linger-ms", type=int, help="Kafka producer linger (default 50)")
    p.add_argument("--compression", help="Kafka producer compression (default gzip)")
    p.add_argument("--max-scans", type=int, help="stop after this many scans")
    p.add_argument(
        "--nvml",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="NVML inventory and cross-check (default on; off by itself without a driver)",
    )
    p.add_argument(
        "--nvml-timeout", type=float, help="bound on one interval's NVML calls (default 2 s)"
    )
    p.add_argument(
        "--drift-tolerance-bytes",
        type=int,
        help="accounting_drift beyond max(this, ratio x NVML) (default 64 MiB)",
    )
    p.add_argument("--drift-tolerance-ratio", type=float, help="see above (default 0.05)")
    p.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus /metrics (hami_usage_* names) and /healthz on this port; "
        "default off",
    )
    p.add_argument(
        "--metrics-bind-address",
        metavar="ADDRESS",
        help="address the metrics port listens on (default 0.0.0.0)",
    )
    p.add_argument(
        "--metrics-hami",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also serve HAMi's vGPU monitor metrics (names, labels) to replace its monitor",
    )
    p.add_argument(
        "--metrics-hami-legacy",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also serve the metric names HAMi's monitor used before it renamed them",
    )
    p.add_argument(
        "--dir-max-entries",
        type=int,
        help="a container folder with more entries is listed at most once per --dir-relist "
        "seconds, and reported (default 1000)",
    )
    p.add_argument("--dir-relist", type=float, help="see above (default 60 s)")
    p.add_argument(
        "--listing-budget",
        type=float,
        help="seconds of folder listing per scan; the rest waits for the next (default 0.2)",
    )
    p.add_argument(
        "--open-files",
        type=int,
        help="descriptors of container folders and cache files kept open across scans "
        "(default 16384; 0: open and close each file every scan)",
    )
    p.add_argument(
        "--stuck-seqlock-after",
        type=float,
        help="a slot whose seqlock stays odd and its bytes unchanged on two scans this far "
        "apart is read as it stands, with a stuck_seqlock anomaly (default 0: two scans)",
    )
    p.add_argument(
        "--kubernetes",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="watch this node's pods for names, workloads and labels (default on; off by "
        "itself outside a cluster without a kubeconfig)",
    )
    p.add_argument(
        "--kubeconfig",
        metavar="PATH",
        help="kubeconfig to use (default $KUBECONFIG, else the in-cluster service account)",
    )
    p.add_argument(
        "--pod-labels",
        type=_names,
        metavar="KEY,...",
        help="pod labels to copy into the records, e.g. team,cost-center",
    )
    p.add_argument(
        "--namespace-labels", type=_names, metavar="KEY,...", help="namespace labels likewise"
    )
    p.add_argument(
        "--kube-backoff-max", type=float, help="longest wait between API retries (default 30 s)"
    )
    p.add_argument(
        "--kube-watch-timeout", type=int, help="seconds of one watch request (default 300)"
    )
    _kafka_flags(p)
    p.set_defaults(func=_cmd_collect)

    p = sub.add_parser("aggregate", help="events -> windowed billing records and OTLP metrics")
    p.add_argument("--config", type=Path, help="TOML file; settings in its [aggregate] table")
    p.add_argument("--kafka", metavar="BOOTSTRAP", help="consume from Kafka (consumer group)")
    p.add_argument(
        "--log",
        metavar="DIR",
        help="consume the local log instead (default /var/lib/hami-usage/events)",
    )
    p.add_argument("--topic", help="usage topic (default hami.usage.v1)")
    p.add_argument("--billing-topic", help="billing topic (default hami.billing.v1)")
    p.add_argument("--group", help="consumer group (default hami-usage-aggregator)")
    p.add_argument(
        "--health-port", type=int, help="serve /healthz (the input loop turns) on this port"
    )
    p.add_argument(
        "--health-bind-address",
        metavar="ADDRESS",
        help="address the health port listens on (default 0.0.0.0)",
    )
    p.add_argument("--instance", help="replica id for the transactional id (default 0)")
    _window_flags(p)
    p.add_argument("--csv", metavar="FILE", help="append billing records to this CSV file")
    p.add_argument("--jsonl", metavar="FILE", help="append billing records as JSON Lines")
    p.add_argument(
        "--parquet",
        metavar="DIR",
        help="also write billing records as Parquet, partitioned by day (for `report`)",
    )
    p.add_argument(
        "--otlp",
        metavar="URL",
        help="push OTLP metrics (http/protobuf), e.g. http://localhost:4318/v1/metrics",
    )
    p.add_argument(
        "--drain",
        action="store_true",
        default=None,
        help="process what is there, close every window and exit",
    )
    p.add_argument(
        "--accept-damaged",
        action="store_true",
        default=None,
        help=f"exit 0 rather than {EXIT_DAMAGED} when the input was damaged (still reported)",
    )
    p.add_argument(
        "--billing-format",
        choices=["json", "msgpack"],
        help="billing topic values (default json)",
    )
    p.add_argument(
        "--start-from",
        metavar="WHEN",
        help="where a group with no committed offset starts: earliest (default), latest or "
        "an ISO-8601 time",
    )
    _kafka_flags(p)
    p.set_defaults(func=_cmd_aggregate)

    p = sub.add_parser("replay", help="recompute billing records for a past time range")
    p.add_argument("--config", type=Path, help="TOML file; settings in its [replay] table")
    p.add_argument("--kafka", metavar="BOOTSTRAP", help="read the usage topic from Kafka")
    p.add_argument("--log", metavar="DIR", help="read the local log instead")
    p.add_argument("--topic", help="usage topic (default hami.usage.v1)")
    p.add_argument(
        "--from",
        dest="from_",
        required=True,
        metavar="ISO",
        help="start, ISO-8601 (UTC if no offset)",
    )
    p.add_argument("--to", required=True, metavar="ISO", help="end, ISO-8601 (exclusive)")
    _window_flags(p)
    p.add_argument("--csv", metavar="FILE", help="write the records to this CSV file")
    p.add_argument("--jsonl", metavar="FILE", help="write the records as JSON Lines")
    p.add_argument(
        "--accept-damaged",
        action="store_true",
        default=None,
        help=f"exit 0 rather than {EXIT_DAMAGED} when the input was damaged (still reported)",
    )
    _kafka_flags(p)
    p.set_defaults(func=_cmd_replay)

    p = sub.add_parser("demo", help="simulate a node and run the whole pipeline; print the bill")
    p.add_argument(
        "--duration", type=_positive(float), help="seconds of simulated usage (default 20)"
    )
    p.add_argument(
        "--out",
        default="hami-usage-demo",
        help="folder for billing.csv (default ./hami-usage-demo)",
    )
    p.add_argument(
        "--kafka", metavar="BOOTSTRAP", help="go through this Kafka broker instead of the local log"
    )
    p.add_argument("--config", type=Path, help="TOML file; Kafka security in its [demo] table")
    _kafka_flags(p)
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("topics", help="print, check and (--apply) create the Kafka topics")
    p.add_argument("--config", type=Path, help="TOML file; settings in its [topics] table")
    p.add_argument("--kafka", metavar="BOOTSTRAP", help="Kafka bootstrap servers (required)")
    p.add_argument("--topic", help="usage topic (default hami.usage.v1)")
    p.add_argument("--billing-topic", help="billing topic (default hami.billing.v1)")
    p.add_argument("--usage-partitions", type=int, help="usage topic partitions (default 6)")
    p.add_argument("--billing-partitions", type=int, help="billing topic partitions (default 3)")
    p.add_argument("--replication-factor", type=int, help="replicas per partition (default 3)")
    p.add_argument("--min-insync-replicas", type=int, help="min.insync.replicas (default 2)")
    p.add_argument(
        "--usage-retention-days",
        type=float,
        help="usage topic retention = the replay horizon (default 400)",
    )
    p.add_argument(
        "--apply", action="store_true", help="create the topics that are missing, then check"
    )
    _kafka_flags(p)
    p.set_defaults(func=_cmd_topics)

    p = sub.add_parser("decode", help="raw usage or billing messages on stdin -> JSON lines")
    p.add_argument(
        "--framing",
        choices=["length", "base64", "lines"],
        default="length",
        help="length: each value after its length, a 4-byte big-endian int (kcat -f '%%R%%s'); "
        "base64: one base64 value a line; lines: one raw value a line (JSON billing only)",
    )
    p.set_defaults(func=_cmd_decode)

    p = sub.add_parser("report", help="chargeback over billing records: CSV, HTML with charts")
    p.add_argument("--from", dest="from_", required=True, metavar="ISO", help="first window")
    p.add_argument("--to", required=True, metavar="ISO", help="end, ISO-8601 (exclusive)")
    p.add_argument("--csv", action="append", metavar="FILE", help="billing records (CSV)")
    p.add_argument("--jsonl", action="append", metavar="FILE", help="billing records (JSONL)")
    p.add_argument("--parquet", metavar="DIR", help="billing records (aggregate --parquet)")
    p.add_argument("--kafka", metavar="BOOTSTRAP", help="read the billing topic")
    p.add_argument(
        "--billing-topic", default="hami.billing.v1", help="billing topic (default hami.billing.v1)"
    )
    p.add_argument("--config", type=Path, help="TOML file; Kafka security in its [report] table")
    _kafka_flags(p)
    p.add_argument(
        "--by",
        action="append",
        metavar="DIM",
        help="namespace (default), workload, pod, label:NAME, node, gpu-model; repeat to nest",
    )
    p.add_argument("--prices", metavar="FILE", help="prices.toml (default: every price 0)")
    p.add_argument("--out-csv", metavar="FILE", help="write the bill as CSV")
    p.add_argument("--html", metavar="FILE", help="write a self-contained HTML page with charts")
    p.set_defaults(func=_cmd_report)

    p = sub.add_parser("schema", help="write the event and billing JSON Schemas (schemas/)")
    p.add_argument("--out", default="schemas", help="folder (default schemas)")
    p.set_defaults(func=_cmd_schema)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        result: int = args.func(args)
        return result
    except UsageError as exc:
        print(str(exc), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
