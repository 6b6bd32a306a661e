"""`hami-usage replay`: billing records recomputed for a past time range, from the usage
topic or the local log."""

from __future__ import annotations

import argparse
import logging
import os
import stat
from pathlib import Path

from ..config import ReplayConfig
from .args import Command, UsageError, iso_ms, say
from .kafka import KAFKA_FLAGS, kafka_flags, reader, run_kafka, start_logging
from .settings import load_settings, one_source
from .windowing import (
    accept_damaged_flag,
    check_outputs,
    damage_exit,
    window_flags,
    window_settings,
)

# The ReplayConfig fields with a flag: `load_settings` takes these from the command line.
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


def _arguments(p: argparse.ArgumentParser) -> None:
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
    window_flags(p)
    p.add_argument("--csv", metavar="FILE", help="write the records to this CSV file")
    p.add_argument("--jsonl", metavar="FILE", help="write the records as JSON Lines")
    accept_damaged_flag(p)
    kafka_flags(p)


def _run(args: argparse.Namespace) -> int:
    from ..replay import ReplayRange, replay_kafka, replay_local

    cfg = load_settings(args, ReplayConfig, "replay", REPLAY_FLAGS)
    one_source("replay", args, cfg.kafka)
    rng = ReplayRange(iso_ms("--from", args.from_), iso_ms("--to", args.to))
    if rng.to_ms <= rng.from_ms:
        raise UsageError("hami-usage replay: --to must be after --from")
    if not cfg.csv and not cfg.jsonl:
        raise UsageError("hami-usage replay: give --csv FILE or --jsonl FILE")
    for flag, value, given in (("--csv", cfg.csv, args.csv), ("--jsonl", cfg.jsonl, args.jsonl)):
        # Replay replaces its output; one named by the environment or the config is likely a
        # running aggregator's, which it cut to the range's records unsaid.
        if value and given is None and _holds_something(value):
            raise UsageError(
                f"hami-usage replay: {flag} {value} (from the environment or --config) is not "
                f"empty: replay replaces its output, so only one given as {flag}"
            )
    check_outputs("replay", cfg)
    window = window_settings(cfg)
    start_logging(logging.WARNING)
    source = reader(cfg, "replay", cfg.kafka)
    if source is not None:
        line, stats = run_kafka(
            "replay", replay_kafka(source, cfg.topic, window, rng, cfg.csv, cfg.jsonl)
        )
    else:
        if not Path(cfg.log).is_dir():
            raise UsageError(f"hami-usage replay: --log {cfg.log}: not a directory")
        line, stats = replay_local(Path(cfg.log), window, rng, cfg.csv, cfg.jsonl)
    say(line)
    return damage_exit("replay", stats.damage, cfg.accept_damaged, True)


def _holds_something(path: str) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False  # (missing: nothing to replace; unreadable: check_outputs says so)
    return stat.S_ISREG(st.st_mode) and st.st_size > 0


COMMAND = Command("replay", "recompute billing records for a past time range", _arguments, _run)
