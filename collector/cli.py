"""`hami-usage`: flags -> typed settings -> the stages. No pipeline logic lives here."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

import msgspec

from .layout.declarations import LAYOUTS
from .layout.reader import read_snapshot
from .layout.snapshot import Snapshot


class UsageError(Exception):
    """Bad flags or config: one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


def _positive(kind: Callable[[str], float]) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def _cmd_inspect(args: argparse.Namespace) -> int:
    path = Path(args.path)
    if path.is_dir():
        print(f"hami-usage inspect: {path}: is a directory, not a cache file", file=sys.stderr)
        return 1
    try:
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

    steps = run(
        Path(args.root), args.containers, args.layout, args.duration, args.interval, args.seed
    )
    print(f"simulated {args.containers} containers for {steps} steps under {args.root}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hami-usage", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("inspect", help="parse one cache file read-only and print what it holds")
    p.add_argument("path", help="a HAMi-core .cache file")
    p.add_argument("--json", action="store_true", help="print one JSON object (a stable contract)")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("simulate", help="write cache files the way HAMi-core does (tests, demo)")
    p.add_argument("--root", required=True, help="folder to create <podUID>_<container>/ in")
    p.add_argument("--containers", type=int, default=4, help="number of containers (default 4)")
    p.add_argument(
        "--layout", choices=[*LAYOUTS, "mixed"], default="v1.2", help="layout of the files"
    )
    p.add_argument("--duration", type=_positive(float), default=10.0, help="seconds (default 10)")
    p.add_argument("--interval", type=_positive(float), default=0.5, help="seconds between steps")
    p.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    p.set_defaults(func=_cmd_simulate)
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
