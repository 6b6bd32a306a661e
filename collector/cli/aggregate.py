"""`hami-usage aggregate`: the aggregator's flags, settings and start-up checks."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from ..aggregate.damage import EXIT_CHECKPOINT, CheckpointError
from ..config import AggregateConfig
from ..transport.locallog.checkpoint import CONSUMERS_DIR, GROUP_NAME, GroupInUseError
from .args import Command, UsageError, iso_ms, say, switch
from .kafka import kafka_flags, kafka_security, run_kafka, start_logging
from .replay import REPLAY_FLAGS
from .settings import listener, load_settings, one_source
from .topics import topic_plan
from .windowing import (
    accept_damaged_flag,
    check_outputs,
    damage_exit,
    window_flags,
    window_settings,
)

# The AggregateConfig fields with a flag: `load_settings` takes these from the command line.
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


def _arguments(p: argparse.ArgumentParser) -> None:
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
    window_flags(p)
    p.add_argument("--csv", metavar="FILE", help="append billing records to this CSV file")
    p.add_argument("--jsonl", metavar="FILE", help="append billing records as JSON Lines")
    p.add_argument(
        "--parquet",
        metavar="DIR",
        help="also write billing records as Parquet, partitioned by day (for `report`)",
    )
    otlp = p.add_mutually_exclusive_group()
    otlp.add_argument(
        "--otlp",
        metavar="URL",
        help="push OTLP metrics (http/protobuf), e.g. http://localhost:4318/v1/metrics",
    )
    otlp.add_argument(
        "--no-otlp",
        action="store_true",
        help="push none, even where the config file or $HAMI_USAGE_OTLP names an endpoint (a "
        "one-off --drain in the live aggregator's pod would write the live service's series)",
    )
    switch(p, "--drain", "process what is there, close every window and exit", negatable=False)
    accept_damaged_flag(p)
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
    kafka_flags(p)


def _run(args: argparse.Namespace) -> int:
    from ..aggregate.service import AggregateSettings, OutputError, aggregate
    from ..transport.http import ListenError

    cfg = load_settings(args, AggregateConfig, "aggregate", AGGREGATE_FLAGS)
    one_source("aggregate", args, cfg.kafka)
    # What makes nothing is checked before the outputs (which makes --parquet): a refused run
    # leaves no folder behind.
    start_from = _start_from(cfg.start_from)
    security = kafka_security(cfg, "aggregate")  # (checked even when no broker is given)
    topics = topic_plan(args, "aggregate", cfg.topic, cfg.billing_topic) if cfg.kafka else None
    if not cfg.kafka:
        if not GROUP_NAME.match(cfg.group):  # (its checkpoint file's name)
            raise UsageError(
                "hami-usage aggregate: --group: with a local log, at most 200 of A-Z a-z 0-9 "
                ". _ - (not . or - first)"
            )
        _checkpoint_writable(Path(cfg.log))
        # Its checkpoint moves on past every window closed: records written nowhere were
        # gone for the group (OTLP's counters are not the records).
        if not (cfg.csv or cfg.jsonl or cfg.parquet):
            raise UsageError(
                "hami-usage aggregate: with a local log, give --csv FILE, --jsonl FILE or "
                "--parquet DIR (there is no billing topic)"
            )
    listener("aggregate", "--health-port", cfg.health_bind_address, cfg.health_port)
    check_outputs("aggregate", cfg)
    settings = AggregateSettings(
        window=window_settings(cfg),
        kafka=cfg.kafka,
        topic=cfg.topic,
        billing_topic=cfg.billing_topic,
        group=cfg.group,
        log_dir=Path(cfg.log),
        csv=cfg.csv,
        jsonl=cfg.jsonl,
        parquet=cfg.parquet,
        otlp=None if args.no_otlp else cfg.otlp,
        drain=cfg.drain,
        instance=cfg.instance,
        health_port=cfg.health_port,
        health_bind_address=cfg.health_bind_address,
        billing_format=cfg.billing_format,
        start_from=start_from,
    )
    if topics is not None:
        settings.security = security
        settings.topics = topics.specs()
    start_logging(logging.INFO)
    try:
        run_kafka("aggregate", aggregate(settings))
    except CheckpointError as exc:
        say(f"hami-usage aggregate: {exc}")
        return EXIT_CHECKPOINT
    except ListenError as exc:
        raise UsageError(f"hami-usage aggregate: --health-port {exc}") from None
    except (OutputError, GroupInUseError) as exc:
        say(f"hami-usage aggregate: {exc}")
        return 1
    if cfg.drain and not settings.drained:
        # Stopped by a signal before the end of the input: what is written stands (a later
        # --drain resumes from the commit), but it is not the whole input.
        say("hami-usage aggregate: --drain stopped before the end of the input")
        return 1
    return damage_exit("aggregate", settings.stats.damage, cfg.accept_damaged, cfg.drain)


def _start_from(text: str) -> str | int:
    """Where a group with no committed offset starts: a position, or a time in ms."""
    if text in ("earliest", "latest"):
        return text
    return iso_ms("--start-from", text, "aggregate")


COMMAND = Command(
    "aggregate", "events -> windowed billing records and OTLP metrics", _arguments, _run
)


def _checkpoint_writable(log: Path) -> None:
    """The local log exists (it is the collector's; a missing one is a wrong path) and the
    group's checkpoint can be written in it, in `consumers/` (made at the first start)."""
    if not log.is_dir():
        raise UsageError(f"hami-usage aggregate: --log {log}: not a directory")
    consumers = log / CONSUMERS_DIR
    where = consumers if consumers.is_dir() else log
    if not os.access(where, os.W_OK | os.X_OK):
        raise UsageError(f"hami-usage aggregate: --log {log}: {where} is not writable")
