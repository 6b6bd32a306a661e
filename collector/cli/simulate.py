"""`hami-usage simulate`: cache files written the way HAMi-core writes them (tests, demo)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import settings_check as check
from ..layout.declarations import LAYOUTS
from .args import Command, positive, say
from .settings import flag_checks, machine


def _faults(text: str) -> frozenset[str]:
    from ..simulate_faults import parse_faults

    try:
        return parse_faults(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--root", required=True, help="folder to create <podUID>_<container>/ in")
    p.add_argument(
        "--containers",
        type=positive(int, 4096),
        default=4,
        help="number of containers (default 4)",
    )
    p.add_argument(
        "--layout", choices=[*LAYOUTS, "mixed"], default="v1.2", help="layout of the files"
    )
    p.add_argument("--duration", type=positive(float), default=10.0, help="seconds (default 10)")
    p.add_argument("--interval", type=positive(float), default=0.5, help="seconds between steps")
    p.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    p.add_argument(
        "--faults",
        type=_faults,
        metavar="F[,F...]",
        help="inject the real library's failure modes: killed-mid-update, stale-pointer, "
        "stale-util, real-semaphores",
    )


def _run(args: argparse.Namespace) -> int:
    from ..simulate import run

    with flag_checks("simulate"):
        check.path("root", args.root)
    with machine("simulate"):
        check.writable_dir("--root", args.root)  # made if missing
    try:
        steps = run(
            Path(args.root),
            args.containers,
            args.layout,
            args.duration,
            args.interval,
            args.seed,
            args.faults or frozenset(),
        )
    except OSError as exc:  # below the root, found while writing: a file where a folder goes
        say(f"hami-usage simulate: {exc.filename}: {exc.strerror}")
        return 1
    print(f"simulated {args.containers} containers for {steps} steps under {args.root}")
    return 0


COMMAND = Command(
    "simulate", "write cache files the way HAMi-core does (tests, demo)", _arguments, _run
)
