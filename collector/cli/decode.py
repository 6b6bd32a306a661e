"""`hami-usage decode`: raw usage or billing messages, as any Kafka tool dumps them, to JSON."""

from __future__ import annotations

import argparse
import os
import sys

from .args import Command, say


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--framing",
        choices=["length", "base64", "lines"],
        default="length",
        help="length: each value after its length, a 4-byte big-endian int (kcat -f '%%R%%s'); "
        "base64: one base64 value a line; lines: one raw value a line (JSON billing only)",
    )


def _run(args: argparse.Namespace) -> int:
    from ..decode import decode_stream

    try:
        return decode_stream(sys.stdin.buffer, sys.stdout.buffer, sys.stderr, args.framing)
    except BrokenPipeError:
        # The reader took what it wanted (`| head -1`) and closed the pipe: done, as Unix tools
        # are. Python flushes stdout again at exit, which would fail the same way.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:  # a full disk, an I/O error: one line, not a traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        say(f"hami-usage decode: {exc.strerror or exc}")
        return 1


COMMAND = Command(
    "decode", "raw usage or billing messages on stdin -> JSON lines", _arguments, _run
)
