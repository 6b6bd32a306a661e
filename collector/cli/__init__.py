"""`hami-usage`: flags -> typed settings -> the stages. No pipeline logic lives here."""

# One module a subcommand; `args`, `settings`, `kafka`, `topics` and `windowing` hold what
# several of them share. The flag lists are exported for the tests that hold README and the
# deploy files to the settings each command really takes.

from __future__ import annotations

import argparse
from collections.abc import Sequence

from . import aggregate, collect, decode, demo, inspect, replay, report, schema, simulate, topics
from .aggregate import AGGREGATE_FLAGS
from .args import Parser, UsageError, say
from .collect import COLLECT_FLAGS
from .inspect import format_table
from .kafka import KAFKA_FLAGS
from .replay import REPLAY_FLAGS
from .topics import TOPICS_FLAGS

__all__ = [
    "AGGREGATE_FLAGS",
    "COLLECT_FLAGS",
    "KAFKA_FLAGS",
    "REPLAY_FLAGS",
    "TOPICS_FLAGS",
    "UsageError",
    "build_parser",
    "format_table",
    "main",
]

# In the order `hami-usage --help` lists them.
COMMANDS = (
    inspect.COMMAND,
    simulate.COMMAND,
    collect.COMMAND,
    aggregate.COMMAND,
    replay.COMMAND,
    demo.COMMAND,
    topics.COMMAND,
    decode.COMMAND,
    report.COMMAND,
    schema.COMMAND,
)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="hami-usage", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help)
        command.arguments(p)
        p.set_defaults(func=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        result: int = args.func(args)
        return result
    except UsageError as exc:
        say(str(exc))
        return 2
