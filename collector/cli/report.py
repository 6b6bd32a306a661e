"""`hami-usage report`: a chargeback over billing records, as a table, CSV and HTML."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import secrets
import sys
from pathlib import Path

from .. import settings_check as check
from ..config import KafkaClientConfig
from .args import Command, UsageError, iso_ms, say
from .kafka import KAFKA_FLAGS, kafka_errors, kafka_flags, reader, start_logging
from .settings import flag_checks, load_settings, machine


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--from", dest="from_", required=True, metavar="ISO", help="first window")
    p.add_argument("--to", required=True, metavar="ISO", help="end, ISO-8601 (exclusive)")
    p.add_argument("--csv", action="append", metavar="FILE", help="billing records (CSV)")
    p.add_argument("--jsonl", action="append", metavar="FILE", help="billing records (JSONL)")
    p.add_argument("--parquet", metavar="DIR", help="billing records (aggregate --parquet)")
    p.add_argument("--kafka", metavar="BOOTSTRAP", help="read the billing topic")
    p.add_argument(
        "--billing-topic", default="hami.billing.v1", help="billing topic (default hami.billing.v1)"
    )
    p.add_argument("--config", type=Path, help="TOML file; Kafka security in its [report] table")
    kafka_flags(p)
    p.add_argument(
        "--by",
        action="append",
        metavar="DIM",
        help="namespace (default), workload, pod, label:NAME, node, gpu-model; repeat to nest",
    )
    p.add_argument("--prices", metavar="FILE", help="prices.toml (default: every price 0)")
    p.add_argument("--out-csv", metavar="FILE", help="write the bill as CSV")
    p.add_argument("--html", metavar="FILE", help="write a self-contained HTML page with charts")


def _run(args: argparse.Namespace) -> int:
    try:
        import matplotlib  # noqa: F401
        import pyarrow  # noqa: F401
    except ImportError as exc:
        raise UsageError(
            f"hami-usage report: needs the report extra (pip install 'hami-usage[report]'): {exc}"
        ) from None
    from ..report.bill import to_csv
    from ..report.command import ReportArgs, make_report, table_text
    from ..report.html import render
    from ..report.load import LoadError
    from ..report.prices import PriceError, Prices
    from ..report.summary import parse_by

    from_ms = iso_ms("--from", args.from_, "report")
    to_ms = iso_ms("--to", args.to, "report")
    if to_ms <= from_ms:
        raise UsageError("hami-usage report: --to must be after --from")
    # The sources and outputs are flags only (README): held to the settings' checks here, so
    # an empty one is refused, never taken for "not given".
    with flag_checks("report"):
        for name in ("csv", "jsonl"):
            for value in getattr(args, name) or []:
                check.path(name, value)
        for name in ("parquet", "prices", "out_csv", "html"):
            check.path(name, getattr(args, name))
        check.bootstrap("kafka", args.kafka)
        check.kafka_name("billing_topic", args.billing_topic)
    if not (args.csv or args.jsonl or args.parquet or args.kafka):
        raise UsageError("hami-usage report: give --csv, --jsonl, --parquet or --kafka")
    try:
        by = parse_by(args.by)
        prices = Prices.load(Path(args.prices)) if args.prices else Prices()
    except (ValueError, PriceError) as exc:
        raise UsageError(f"hami-usage report: {exc}") from None
    cfg = load_settings(args, KafkaClientConfig, "report", KAFKA_FLAGS)
    with machine("report"):  # before the records are read, not after
        # An output that is an input replaced the billing records (or the prices, or the
        # settings) with the bill, exit 0, and an input given twice is billed twice: every file
        # is a different one.
        outputs = [(f"--{n.replace('_', '-')}", getattr(args, n)) for n in ("out_csv", "html")]
        outputs = [(flag, value) for flag, value in outputs if value]
        inputs = [(f"--{n}", v) for n in ("csv", "jsonl") for v in getattr(args, n) or []]
        inputs += [
            (f"--{n}", str(getattr(args, n))) for n in ("prices", "config") if getattr(args, n)
        ]
        check.distinct_files(inputs + outputs)
        if args.parquet:
            check.outside_folder(outputs, "--parquet", args.parquet)
        for flag, value in outputs:
            check.writable_file(flag, value)
    report_args = ReportArgs(
        from_ms=from_ms,
        to_ms=to_ms,
        by=by,
        prices=prices,
        csv=[Path(x) for x in args.csv or []],
        jsonl=[Path(x) for x in args.jsonl or []],
        parquet=Path(args.parquet) if args.parquet else None,
        kafka=reader(cfg, "report", args.kafka),
        billing_topic=args.billing_topic,
    )
    start_logging(logging.WARNING)
    try:
        with kafka_errors("report"):
            bill, summary = make_report(report_args)
    except LoadError as exc:
        say(f"hami-usage report: {exc}")
        return 1
    if args.out_csv and not _write(args.out_csv, to_csv(bill)):
        return 1
    title = f"GPU chargeback {args.from_} .. {args.to}"
    if args.html and not _write(args.html, render(bill, summary, title)):
        return 1
    sys.stdout.write(table_text(bill))
    return 0


def _write(path: str, text: str) -> bool:
    """`text` to `path` whole or not at all (checked at start; a disk that filled up since is
    one line, and no cut-off file)."""
    # The file a symlink names is written, not the link replaced by a file of its own.
    real = os.path.realpath(path)
    # A name of its own, created exclusively: `<output>.part` could be an input (`--csv
    # usage.csv.part --out-csv usage.csv` overwrote the records with the bill, then renamed
    # them away).
    part = f"{real}.{secrets.token_hex(6)}.part"
    created = False
    try:
        with open(part, "x", encoding="utf-8") as f:
            created = True
            f.write(text)
        os.replace(part, real)
    except OSError as exc:
        if created:
            with contextlib.suppress(OSError):
                os.unlink(part)
        say(f"hami-usage report: {path}: {exc.strerror}")
        return False
    return True


COMMAND = Command(
    "report", "chargeback over billing records: CSV, HTML with charts", _arguments, _run
)
