"""Flags and the config file become one command's typed settings; the checks of the machine
at start. Either failing is a `UsageError`: one line, exit 2, before anything starts."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

import msgspec

from .. import settings_check as check
from ..config import ConfigError, load
from .args import UsageError

C = TypeVar("C", bound=msgspec.Struct)


def load_settings(args: argparse.Namespace, cls: type[C], section: str, names: list[str]) -> C:
    """The `section` table of `--config`, the environment and the flags in `names`, merged."""
    flags = {name: getattr(args, name) for name in names}
    try:
        return load(cls, section, config_file=args.config, flags=flags)
    except ConfigError as exc:
        raise UsageError(f"hami-usage {section}: {exc}") from None


def one_source(section: str, args: argparse.Namespace, kafka: str | None) -> None:
    """`--log` on the command line with a broker to read (a flag, the config or the
    environment): which one was meant is not known, and reading the other would go unnoticed."""
    if args.log is not None and kafka:
        raise UsageError(
            f"hami-usage {section}: --log reads the local log and --kafka the usage topic: "
            "give one of them"
        )


@contextmanager
def machine(section: str) -> Iterator[None]:
    """Checks of the machine at start (outputs writable, roots allowed): each failure is one
    line and exit 2, before anything starts."""
    try:
        yield
    except check.SettingError as exc:
        raise UsageError(f"hami-usage {section}: {exc}") from None


@contextmanager
def flag_checks(section: str) -> Iterator[None]:
    """The syntax checks of `settings_check` on flags that are no field of a settings struct
    (report's sources, demo's --kafka, an output folder): the same one line, exit 2, as the
    same value gets as a setting."""
    try:
        yield
    except ValueError as exc:
        raise UsageError(f"hami-usage {section}: invalid setting {exc}") from None


def listener(section: str, flag: str, host: str, port: int | None) -> None:
    """The listener `flag` asks for can start (tried: `try_listen`), before anything is made;
    else one line, exit 2. None: no listener."""
    from ..transport.http import ListenError, try_listen

    if port is None:
        return
    try:
        try_listen(host, port)
    except ListenError as exc:
        raise UsageError(f"hami-usage {section}: {flag} {exc}") from None
