"""What `aggregate` and `replay` share: the windowing flags and settings, the checks of their
output files, and the exit status of a run that read damaged input."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from .. import settings_check as check
from ..aggregate.damage import EXIT_DAMAGED, DamageReport
from ..config import AggregateConfig, ReplayConfig
from .args import say, switch
from .settings import machine

if TYPE_CHECKING:
    from ..aggregate.windows import WindowSettings


def window_flags(p: argparse.ArgumentParser) -> None:
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


def window_settings(cfg: AggregateConfig | ReplayConfig) -> WindowSettings:
    """Settings are in seconds (what people type); the windows count whole milliseconds, and
    the settings hold whole milliseconds (config.py: `settings_check.whole_ms`)."""
    from ..aggregate.windows import WindowSettings

    return WindowSettings(
        window_ms=round(cfg.window * 1000),
        lateness_ms=round(cfg.lateness * 1000),
        max_gap_ms=round(cfg.max_gap * 1000),
        max_skew_ms=round(cfg.max_skew * 1000),
        allocation_policy=cfg.allocation_policy,
        idle_ms=round(cfg.idle * 1000),
    )


def check_outputs(section: str, cfg: ReplayConfig) -> None:
    """The record files (and aggregate's Parquet folder) are checked before any input is read:
    an unwritable one is exit 2 now, not a failure after the run has done its work."""
    with machine(section):
        if cfg.kafka is None:  # read from a local log: written among its segments, an output
            # replaced or corrupted one (a CSV over a segment, then exit 3 at every start)
            outputs = [("--csv", cfg.csv), ("--jsonl", cfg.jsonl)]
            if isinstance(cfg, AggregateConfig):
                outputs.append(("--parquet", cfg.parquet))
            check.outside_folder([(f, v) for f, v in outputs if v], "--log", cfg.log)
        if cfg.csv:
            check.writable_file("--csv", cfg.csv)
        if cfg.jsonl:
            check.writable_file("--jsonl", cfg.jsonl)
        if cfg.csv and cfg.jsonl:
            check.distinct_files([("--csv", cfg.csv), ("--jsonl", cfg.jsonl)])
        if isinstance(cfg, AggregateConfig) and cfg.parquet:
            check.writable_dir("--parquet", cfg.parquet)


def accept_damaged_flag(p: argparse.ArgumentParser) -> None:
    """`--accept-damaged`, which `damage_exit` reads."""
    switch(
        p,
        "--accept-damaged",
        f"exit 0 rather than {EXIT_DAMAGED} when the input was damaged (still reported)",
        negatable=False,
    )


def damage_exit(command: str, damage: DamageReport, accept: bool, ends: bool) -> int:
    """EXIT_DAMAGED when a run that ends by itself read damaged input, unless accepted."""
    if not ends or not damage.damaged:
        return 0
    if accept:
        say(f"hami-usage {command}: {damage.line()} (accepted)")
        return 0
    say(
        f"hami-usage {command}: input damaged, records may be incomplete: {damage.line()} "
        f"(exit {EXIT_DAMAGED}; --accept-damaged to accept)",
    )
    return EXIT_DAMAGED
