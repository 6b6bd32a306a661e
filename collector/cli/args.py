"""How the command line is read: the parser, the one error a bad flag raises, and the value
types several subcommands share. Every subcommand module declares itself as a `Command`."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from .. import settings_check as check


def say(message: str) -> None:
    """A command's line on stderr: one line, whatever a path or a key in it holds."""
    print(check.one_line(message), file=sys.stderr)


class UsageError(Exception):
    """Bad flags or config: one line on stderr, exit status 2."""


@dataclass(frozen=True)
class Command:
    """One subcommand: `main` builds its parser from this and runs `run` with what it parsed."""

    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


class Parser(argparse.ArgumentParser):
    """No abbreviated options: `--kafka-password S` would be taken for `--kafka-password-file`
    and its value echoed as a file name. An unknown option's values are not echoed either: they
    may be secrets typed to an option that does not exist."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.register("action", None, _Once)
        self.register("action", "store", _Once)

    def error(self, message: str) -> NoReturn:
        head, _, rest = message.partition(": ")
        if head == "unrecognized arguments":
            names = [a.partition("=")[0] for a in rest.split()]
            shown = " ".join(n for n in names if _OPTION.fullmatch(n)) or "(values not shown)"
            message = f"{head}: {shown}"
        elif head == "argument command":
            # A stray value where the subcommand goes: the value of an option given before it.
            message = _CHOICE.sub("invalid choice (choose", message)
        else:
            # `--drain=S3cret`: a value given to an on/off flag is named by argparse.
            message = _IGNORED.sub("ignored explicit argument (value not shown)", message)
        raise UsageError(f"{self.prog}: {message}")


class _Once(argparse._StoreAction):
    """An option of one value refuses a second: argparse keeps the last one given, so
    `report --parquet A --parquet B` billed B alone, and `--kafka`, `--prices` or an output
    given twice lost all but the last without a word. (Options that take several say so:
    `--csv` of `report`, `--by`.)"""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        given: set[str] = namespace.__dict__.setdefault("_given_once", set())
        if self.dest in given:
            raise argparse.ArgumentError(self, "given more than once (it takes one value)")
        given.add(self.dest)
        super().__call__(parser, namespace, values, option_string)


# What is shown of an unrecognised argument: a long option's name, never anything else (a value
# typed after an option that does not exist, `-S3cret`, is not an option name).
_OPTION = re.compile(r"--[a-z][a-z0-9]*(?:-[a-z0-9]+)*")
_CHOICE = re.compile(r"invalid choice: .*? \(choose")
_IGNORED = re.compile(r"ignored explicit argument .*", re.DOTALL)


def positive(kind: Callable[[str], float], most: float = 86400.0) -> Callable[[str], float]:
    """A number in (0, most]: finite, so no loop waits forever on it."""

    def parse(text: str) -> float:
        value = kind(text)
        if not 0 < value <= most:  # NaN fails too
            raise argparse.ArgumentTypeError(f"must be > 0 and <= {most:g}, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def switch(p: argparse._ActionsContainer, flag: str, help: str, *, negatable: bool = True) -> None:
    """An on/off flag whose default is None, not False: only a flag given on the command line
    overrides the config file and the environment."""
    action = argparse.BooleanOptionalAction if negatable else "store_true"
    p.add_argument(flag, action=action, default=None, help=help)


def iso_ms(flag: str, text: str, command: str = "replay") -> int:
    """A flag's ISO-8601 time as epoch milliseconds (`records.iso_ms`: UTC without an offset,
    a time within a millisecond the next one)."""
    from ..aggregate.records import TimeOutOfRange
    from ..aggregate.records import iso_ms as epoch_ms

    try:
        return epoch_ms(text)
    except TimeOutOfRange as e:
        raise UsageError(f"hami-usage {command}: {flag} {text!r}: {e}") from None
    except ValueError:
        raise UsageError(
            f"hami-usage {command}: {flag} {text!r}: not an ISO-8601 time"
            + (" (or earliest, latest)" if command == "aggregate" else "")
        ) from None
