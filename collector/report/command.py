"""`hami-usage report`: read billing records for [from, to), group, price, write CSV / HTML,
print the bill."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from ..aggregate.billing import decode_billing
from ..aggregate.records import BillingRecord
from ..settings_check import one_line
from .bill import Bill, hours, make_bill, money
from .load import (
    LoadError,
    csv_records,
    from_parquet,
    from_records,
    jsonl_records,
)
from .prices import Prices
from .summary import Summary, columns_for

if TYPE_CHECKING:
    from ..transport.consumer import ConsumerSettings

__all__ = ["ReportArgs", "bucket_for", "make_report", "table_text", "unmeasured_note"]


@dataclass
class ReportArgs:
    from_ms: int
    to_ms: int
    by: list[str]
    prices: Prices
    csv: list[Path]
    jsonl: list[Path]
    parquet: Path | None = None
    kafka: ConsumerSettings | None = None  # the billing topic's reader
    billing_topic: str = "hami.billing.v1"


def bucket_for(from_ms: int, to_ms: int) -> int:
    """Hours for a range of up to three days, else days."""
    return 3_600_000 if to_ms - from_ms <= 3 * 86_400_000 else 86_400_000


async def _from_kafka(
    source: ConsumerSettings, topic: str, from_ms: int, keep: Callable[[BillingRecord], None]
) -> None:
    from ..transport.consumer import read_range

    # A record is stamped with its window's start: nothing of [from, to) lies before the
    # offset of time `from`.
    async with read_range(source, topic, from_ms) as reading:
        async for batch in reading.batches():
            for m in batch:
                if m.value is None:
                    continue
                try:
                    record = decode_billing(m.value)
                except (ValueError, msgspec.DecodeError, msgspec.ValidationError) as e:
                    where = f"{topic} partition {m.partition} offset {m.offset}"
                    raise LoadError(f"{where}: not a billing record: {e}") from None
                keep(record)


def make_report(args: ReportArgs) -> tuple[Bill, Summary]:
    label_keys = sorted(args.prices.labels)
    summary = Summary(args.by, bucket_for(args.from_ms, args.to_ms), label_keys)
    # One record per record_id, the last one read: a record can be in the inputs more than
    # once (published again by a second group or a redeployment from `earliest`, where
    # compaction has not run; written again by a second group into the same files, which
    # doubled the bill), and every consumer keeps one (see Consuming the billing topic).
    records: dict[str, BillingRecord] = {}

    def keep(record: BillingRecord) -> None:
        if args.from_ms <= record.window_start_ms < args.to_ms:
            records[record.record_id] = record

    for record in csv_records(args.csv):
        keep(record)
    for record in jsonl_records(args.jsonl):
        keep(record)
    if args.kafka:
        asyncio.run(_from_kafka(args.kafka, args.billing_topic, args.from_ms, keep))
    if args.csv or args.jsonl or args.kafka:
        summary.add(from_records(records.values(), args.from_ms, args.to_ms))
    if args.parquet is not None:
        for table in from_parquet(args.parquet, args.from_ms, args.to_ms, columns_for(args.by),
                                  read_elsewhere=records):  # fmt: skip
            summary.add(table)
    return make_bill(summary, args.prices), summary


def table_text(bill: Bill) -> str:
    """The bill as a text table for the terminal."""
    cur = bill.currency
    head = [
        ", ".join(bill.by),
        "GPU-h alloc",
        "GPU-h used",
        "GPU-h reserved idle",
        "eff",
        f"cost {cur}",
    ]
    # Names are a tenant's to choose (an owner's name, a cache file's UUID): a newline or an
    # escape sequence in one must not forge or rewrite other rows of the bill.
    rows = [
        [one_line(x.name), str(hours(x.allocated_ms)), str(hours(x.used_ms)),
         str(hours(x.reserved_idle_ms)), "" if x.efficiency is None else str(x.efficiency),
         str(money(x.cost))]
        for x in bill.groups
    ]  # fmt: skip
    rows += [
        [one_line(x.name), str(hours(x.allocated_ms)), "", "", "", str(money(x.cost))]
        for x in bill.idle
    ]
    rows.append(["rounding residue", "", "", "", "", str(bill.residue)])
    rows.append(["total", "", "", "", "", str(money(bill.total))])
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    out = []
    for r in [head, *rows]:
        cells = [r[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)
        ]
        out.append("  ".join(cells).rstrip())
    out.append("reserved idle: allocated while the containers had no SM activity on the GPU")
    if bill.unmeasured_ms:
        out.append(unmeasured_note(bill))
    return "\n".join(out) + "\n"


def unmeasured_note(bill: Bill) -> str:
    return (
        f"reserved-idle not measured for {hours(bill.unmeasured_ms)} GPU-h allocated in records "
        "written before it (record version 1): not counted as idle"
    )
