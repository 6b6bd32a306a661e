"""`hami-usage report`: read billing records for [from, to), group, price, write CSV / HTML,
print the bill."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from ..aggregate.records import BillingRecord, from_msgpack
from .bill import Bill, hours, make_bill, money
from .load import from_csv, from_jsonl, from_parquet, from_records
from .prices import Prices
from .summary import Summary, columns_for

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["ReportArgs", "bucket_for", "make_report", "table_text"]


@dataclass
class ReportArgs:
    from_ms: int
    to_ms: int
    by: list[str]
    prices: Prices
    csv: list[Path]
    jsonl: list[Path]
    parquet: Path | None = None
    kafka: str | None = None
    billing_topic: str = "hami.billing.v1"


def bucket_for(from_ms: int, to_ms: int) -> int:
    """Hours for a range of up to three days, else days."""
    return 3_600_000 if to_ms - from_ms <= 3 * 86_400_000 else 86_400_000


def _decode_billing(payload: bytes) -> BillingRecord:
    if payload[:1] == b"{":  # the billing topic as JSON
        return msgspec.json.decode(payload, type=BillingRecord)
    return from_msgpack(payload)


async def _from_kafka(bootstrap: str, topic: str, from_ms: int, to_ms: int) -> pa.Table:
    from aiokafka import AIOKafkaConsumer, TopicPartition

    from ..transport.kafka import wait_for_broker
    from ..transport.security import KafkaSecurity

    security = KafkaSecurity()  # plaintext: report takes no security flags yet
    await wait_for_broker(bootstrap, 10.0, security)
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        isolation_level="read_committed",
        client_id="hami-usage-report",
        **security.client_kwargs(),
    )
    await consumer.start()
    records: list[BillingRecord] = []
    try:
        await consumer._client.force_metadata_update()  # noqa: SLF001
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
        consumer.assign(tps)
        # a window's record is published after the window closed: nothing of [from, to)
        # was published before `from`
        found = await consumer.offsets_for_times({tp: max(from_ms, 0) for tp in tps})
        ends = await consumer.end_offsets(tps)
        for tp in tps:
            f = found.get(tp)
            consumer.seek(tp, f.offset if f else ends[tp])
        while pending := [tp for tp in tps if await consumer.position(tp) < ends[tp]]:
            got = await consumer.getmany(*pending, timeout_ms=1000, max_records=5000)
            for msgs in got.values():
                records += [_decode_billing(m.value) for m in msgs if m.value is not None]
    finally:
        await consumer.stop()
    return from_records(records, from_ms, to_ms)


def make_report(args: ReportArgs) -> tuple[Bill, Summary]:
    label_keys = sorted(args.prices.labels)
    summary = Summary(args.by, bucket_for(args.from_ms, args.to_ms), label_keys)
    tables: list[pa.Table] = []
    if args.csv:
        tables.append(from_csv(args.csv, args.from_ms, args.to_ms))
    if args.jsonl:
        tables.append(from_jsonl(args.jsonl, args.from_ms, args.to_ms))
    if args.kafka:
        tables.append(
            asyncio.run(_from_kafka(args.kafka, args.billing_topic, args.from_ms, args.to_ms))
        )
    for t in tables:
        summary.add(t)
    if args.parquet is not None:
        for table in from_parquet(args.parquet, args.from_ms, args.to_ms, columns_for(args.by)):
            summary.add(table)
    return make_bill(summary, args.prices), summary


def table_text(bill: Bill) -> str:
    """The bill as a text table for the terminal."""
    cur = bill.currency
    head = [", ".join(bill.by), "GPU-h alloc", "GPU-h used", "eff", f"cost {cur}"]
    rows = [
        [" / ".join(k or "(unnamed)" for k in x.key), str(hours(x.allocated_ms)),
         str(hours(x.used_ms)), "" if x.efficiency is None else str(x.efficiency),
         str(money(x.cost))]
        for x in bill.groups
    ]  # fmt: skip
    rows += [
        [
            f"idle: {x.key[0] or '(no model)'}",
            str(hours(x.allocated_ms)),
            "",
            "",
            str(money(x.cost)),
        ]
        for x in bill.idle
    ]
    rows.append(["rounding residue", "", "", "", str(bill.residue)])
    rows.append(["total", "", "", "", str(money(bill.total))])
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    out = []
    for r in [head, *rows]:
        cells = [r[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)
        ]
        out.append("  ".join(cells).rstrip())
    return "\n".join(out) + "\n"
