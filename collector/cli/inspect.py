"""`hami-usage inspect`: one cache file, read read-only, printed as a table or as JSON."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import msgspec

from .. import settings_check as check
from ..layout.reader import read_snapshot
from ..layout.snapshot import Snapshot, shown_path
from ..settings_check import one_line
from .args import Command, say
from .settings import flag_checks


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="a HAMi-core .cache file")
    p.add_argument("--json", action="store_true", help="print one JSON object (a stable contract)")


def _run(args: argparse.Namespace) -> int:
    # An empty path is refused as every empty path is (README), not read as `.` (Path("")).
    with flag_checks("inspect"):
        check.path("path", args.path)
    path = Path(args.path)
    shown = shown_path(args.path)  # a name that is not UTF-8 as `\xff`, as the snapshot has it
    try:
        # Inside the try: is_dir() raises PermissionError under a directory we cannot search.
        if path.is_dir():
            say(f"hami-usage inspect: {shown}: is a directory, not a cache file")
            return 1
        if path.exists() and not path.is_file():
            say(f"hami-usage inspect: {shown}: not a regular file")
            return 1
        snap = read_snapshot(path)
    except FileNotFoundError:
        say(f"hami-usage inspect: {shown}: no such file")
        return 1
    except OSError as exc:
        say(f"hami-usage inspect: {shown}: cannot open: {exc.strerror}")
        return 1
    if args.json:
        sys.stdout.buffer.write(msgspec.json.encode(snap) + b"\n")
    else:
        sys.stdout.write(format_table(snap))
    return 0


def format_table(snap: Snapshot) -> str:
    version = "" if snap.major is None else f" (header {snap.major}.{snap.minor})"
    lines = [
        # A tenant names its cache files: a newline or an escape sequence in one must not forge
        # or hide lines (`\x1b[8m` hid the anomalies), so the table shows them escaped.
        f"{one_line(snap.path)}: {snap.size} bytes, layout {snap.layout or 'unknown'}{version}",
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
    lines += [f"anomaly {a.kind}: {one_line(a.detail)}" for a in snap.anomalies] or ["no anomalies"]
    return "\n".join(lines) + "\n"


COMMAND = Command(
    "inspect", "parse one cache file read-only and print what it holds", _arguments, _run
)
