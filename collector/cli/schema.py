"""`hami-usage schema`: the JSON Schemas in schemas/, generated from the one declaration."""

from __future__ import annotations

import argparse
from pathlib import Path

import msgspec

from .. import settings_check as check
from .args import Command
from .settings import flag_checks, machine


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="schemas", help="folder (default schemas)")


def _run(args: argparse.Namespace) -> int:
    from ..aggregate import billing
    from ..events import json_schema

    with flag_checks("schema"):
        check.path("out", args.out)
    out = Path(args.out)
    schemas = (
        ("events.schema.json", json_schema()),
        ("billing.schema.json", billing.json_schema()),
    )
    with machine("schema"):
        check.writable_dir("--out", args.out)  # made if missing
        for name, _ in schemas:  # a folder of that name, say: before either is written
            check.writable_file("--out", str(out / name))
    for name, schema in schemas:
        target = out / name
        target.write_bytes(msgspec.json.format(msgspec.json.encode(schema), indent=2) + b"\n")
        print(f"wrote {target}")
    return 0


COMMAND = Command("schema", "write the event and billing JSON Schemas (schemas/)", _arguments, _run)
