"""`hami-usage topics`, and the topic plan `collect` and `aggregate` check at start: the same
`[topics]` settings describe the topics whichever command reads them."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import ConfigError, TopicsConfig, load
from .args import Command, UsageError
from .kafka import KAFKA_FLAGS, kafka_flags, kafka_security, run_kafka, start_logging
from .settings import load_settings

if TYPE_CHECKING:
    from ..transport.topics import TopicPlan

# The TopicsConfig fields with a flag: `load_settings` takes these from the command line.
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


def topic_plan(args: argparse.Namespace, command: str, usage: str, billing: str) -> TopicPlan:
    """The `[topics]` table of the same config file (and env), for `command`'s start-up
    check (an error in it is that command's)."""
    try:
        t = load(TopicsConfig, "topics", config_file=args.config)
    except ConfigError as exc:
        raise UsageError(f"hami-usage {command}: {exc}") from None
    return plan_of(t, usage, billing)


def plan_of(t: TopicsConfig, usage: str, billing: str) -> TopicPlan:
    """The topics `[topics]` settings describe, named `usage` and `billing`."""
    from ..transport.topics import TopicPlan

    return TopicPlan(
        usage,
        billing,
        t.usage_partitions,
        t.billing_partitions,
        t.replication_factor,
        t.min_insync_replicas,
        t.usage_retention_days,
    )


def _arguments(p: argparse.ArgumentParser) -> None:
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
    kafka_flags(p)


def _run(args: argparse.Namespace) -> int:
    from ..transport.topics import apply_plan

    cfg = load_settings(args, TopicsConfig, "topics", TOPICS_FLAGS)
    if not cfg.kafka:
        raise UsageError("hami-usage topics: --kafka BOOTSTRAP is required")
    plan = plan_of(cfg, cfg.topic, cfg.billing_topic)
    security = kafka_security(cfg, "topics")
    start_logging(logging.WARNING)
    ok: bool = run_kafka("topics", apply_plan(cfg.kafka, security, plan, args.apply, sys.stdout))
    return 0 if ok else 1


COMMAND = Command("topics", "print, check and (--apply) create the Kafka topics", _arguments, _run)
