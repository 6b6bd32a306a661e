"""`hami-usage demo`: a simulated node through the whole pipeline, and the bill it makes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .. import settings_check as check
from ..config import KafkaClientConfig
from .args import Command, UsageError, positive
from .kafka import KAFKA_FLAGS, kafka_flags, kafka_security, run_kafka
from .settings import flag_checks, load_settings, machine


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--duration", type=positive(float), help="seconds of simulated usage (default 20)"
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
    kafka_flags(p)


def _run(args: argparse.Namespace) -> int:
    from ..demo import OUTPUTS, DemoSettings, format_report, run_demo

    if args.duration is not None and args.duration < 5:
        raise UsageError("hami-usage demo: --duration must be at least 5 seconds")
    with flag_checks("demo"):
        check.path("out", args.out)
        check.bootstrap("kafka", args.kafka)
    cfg = load_settings(args, KafkaClientConfig, "demo", KAFKA_FLAGS)
    security = kafka_security(cfg, "demo")
    with machine("demo"):
        check.writable_dir("--out", args.out)
        for name in OUTPUTS:  # (a folder or a FIFO there failed or hung after the run)
            check.writable_file("--out", str(Path(args.out) / name))
    settings = DemoSettings(
        duration_s=args.duration or DemoSettings.duration_s,
        out=Path(args.out),
        kafka=args.kafka,
        security=security,
    )
    result = run_kafka("demo", run_demo(settings))
    sys.stdout.write(format_report(result))
    return 0


COMMAND = Command(
    "demo", "simulate a node and run the whole pipeline; print the bill", _arguments, _run
)
