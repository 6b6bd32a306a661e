"""Prices applied to a `Summary`: the bill, exact until the end.

Every amount is an exact fraction (milliseconds × price per hour / 3 600 000 × adjustments)
until it is shown: then each line's cost is rounded once, half-even, to the currency's cents,
and so is the total of the exact amounts. The lines' rounded costs and the rounded total can
differ by a few cents: that difference is the stated **rounding residue**, so that the lines
plus the residue are the total to the cent. Without adjustments the total is exactly the GPUs'
observed hours × their prices (every millisecond of a GPU is either allocated or idle).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from typing import Final

from ..csvtext import Writer, cell
from .prices import Prices
from .summary import HOUR_MS, Summary, column

__all__ = ["Bill", "Line", "make_bill", "model_name", "money", "part_name", "to_csv"]

GIB: Final = 1 << 30


def _rounded(x: Fraction, places: int) -> Decimal:
    """`x` half-even to `places` decimals (Python's round of a Fraction is half-even), from
    text: exact at any size (Decimal arithmetic rounds to the context's 28 digits, and its
    quantize beyond them raises)."""
    return Decimal(f"{round(x * 10**places)}e-{places}")


def money(x: Fraction) -> Decimal:
    """Half-even to the cent."""
    return _rounded(x, 2)


def hours(ms: int | Fraction) -> Decimal:
    """GPU-hours shown with six decimals (3.6 ms); the sums behind them are exact."""
    return _rounded(Fraction(ms) / HOUR_MS, 6)


def part_name(value: str) -> str:
    """One --by value as the bill shows it: empty (no namespace, no such label) is named."""
    return value or "(unnamed)"


def model_name(model: str) -> str:
    """A GPU model as the bill shows it: empty while no inventory named it."""
    return model or "(no model)"


@dataclass
class Line:
    kind: str  # group | idle
    key: tuple[str, ...]  # the --by values (group) or (gpu model,) (idle)
    allocated_ms: int
    used_ms: int
    memory_byte_seconds: float
    list_cost: Fraction  # at the list price
    cost: Fraction  # after the adjustments
    reserved_idle_ms: int = 0  # allocated while its containers had no SM activity
    unmeasured_ms: int = 0  # allocated in records older than reserved-idle (not in the above)

    @property
    def name(self) -> str:
        """The line's first column, in the terminal and on the page alike: each --by value
        named on its own (a nested key of two empty values is two names, never " / ")."""
        if self.kind == "idle":
            return f"idle: {model_name(self.key[0])}"
        return " / ".join(map(part_name, self.key))

    @property
    def efficiency(self) -> Decimal | None:
        if not self.allocated_ms:
            return None
        return _rounded(Fraction(self.used_ms, self.allocated_ms), 4)


@dataclass
class ModelRow:
    """One GPU model's reconciliation: observed = allocated + idle, and its cost."""

    model: str
    price: Decimal  # per GPU-hour, as prices.toml states it
    observed_ms: int
    allocated_ms: int
    idle_ms: int

    @property
    def balanced(self) -> bool:
        return self.observed_ms == self.allocated_ms + self.idle_ms

    @property
    def observed_cost(self) -> Fraction:
        return self.observed_ms * Fraction(self.price) / HOUR_MS


@dataclass
class Bill:
    by: list[str]
    currency: str
    groups: list[Line]
    idle: list[Line]
    models: list[ModelRow]

    @property
    def lines(self) -> list[Line]:
        return self.groups + self.idle

    @property
    def total(self) -> Fraction:
        return sum((x.cost for x in self.lines), Fraction(0))

    @property
    def adjustments(self) -> Fraction:
        return sum((x.cost - x.list_cost for x in self.lines), Fraction(0))

    @property
    def unmeasured_ms(self) -> int:
        """Allocated ms whose reserved-idle part the records did not measure (version 1)."""
        return sum(x.unmeasured_ms for x in self.groups)

    @property
    def residue(self) -> Decimal:
        """Rounded total minus the sum of the rounded lines."""
        cents = round(self.total * 100) - sum(round(x.cost * 100) for x in self.lines)
        return money(Fraction(cents, 100))


def make_bill(summary: Summary, prices: Prices) -> Bill:
    n = len(summary.by)
    groups: dict[tuple[str, ...], Line] = {}
    for k, (alloc, used, mem, ridle, unmeasured) in summary.groups.items():
        dims, model, ns, labels = k[:n], k[n], k[n + 1], k[n + 2 :]
        price = Fraction(prices.price(model))
        factor = prices.factor(ns, dict(zip(summary.label_keys, labels, strict=True)))
        list_cost = int(alloc) * price / HOUR_MS
        line = groups.get(dims)
        if line is None:
            line = groups[dims] = Line("group", dims, 0, 0, 0.0, Fraction(0), Fraction(0))
        line.allocated_ms += int(alloc)
        line.used_ms += int(used)
        line.memory_byte_seconds += mem
        line.reserved_idle_ms += int(ridle)
        line.unmeasured_ms += int(unmeasured)
        line.list_cost += list_cost
        line.cost += list_cost * factor
    idle = []
    models = []
    for model, (observed, allocated, idle_ms, _) in sorted(summary.models.items()):
        listed = prices.price(model)
        cost = idle_ms * Fraction(listed) / HOUR_MS
        idle.append(Line("idle", (model,), idle_ms, 0, 0.0, cost, cost))
        models.append(ModelRow(model, listed, observed, allocated, idle_ms))
    ordered = sorted(groups.values(), key=lambda x: (-x.cost, x.key))
    return Bill(summary.by, prices.currency, ordered, idle, models)


def csv_header(bill: Bill) -> list[str]:
    """The --by columns, then gpu_model (the idle rows'), unless --by gpu-model already made
    a gpu_model column: that one then holds the idle rows' model too (no name twice)."""
    dims = [column(d) for d in bill.by]
    model = [] if "gpu-model" in bill.by else ["gpu_model"]
    return [
        "kind", *dims, *model, "gpu_hours_allocated", "gpu_hours_used",
        "gpu_hours_reserved_idle", "efficiency", "memory_gib_hours", "cost", "currency",
    ]  # fmt: skip


def to_csv(bill: Bill) -> str:
    """One row per group, one idle row per GPU model, the rounding residue and the total."""
    buf = io.StringIO()
    out = Writer(buf)
    n = len(bill.by)
    at = bill.by.index("gpu-model") if "gpu-model" in bill.by else None

    def write(row: list[object]) -> None:
        """A row laid out as kind, --by values, gpu_model, numbers: the gpu_model value moves
        into the --by gpu-model column when there is one (csv_header)."""
        row[1 : 2 + n] = [cell(str(v)) for v in row[1 : 2 + n]]  # (names, a tenant's UUID)
        if at is not None:
            model = row.pop(1 + n)
            if model:
                row[1 + at] = model
        out.writerow(row)

    out.writerow(csv_header(bill))
    blank = [""] * n
    cur = bill.currency
    for x in bill.groups:
        eff = x.efficiency
        write([
            "group", *x.key, "", hours(x.allocated_ms), hours(x.used_ms),
            hours(x.reserved_idle_ms), "" if eff is None else eff,
            f"{x.memory_byte_seconds / GIB / 3600:.3f}", money(x.cost), cur,
        ])  # fmt: skip
    for x in bill.idle:
        write(["idle", *blank, x.key[0], hours(x.allocated_ms), "", "", "", "", money(x.cost), cur])
    write(["rounding_residue", *blank, "", "", "", "", "", "", bill.residue, cur])
    alloc = sum(x.allocated_ms for x in bill.lines)
    used = sum(x.used_ms for x in bill.groups)
    ridle = sum(x.reserved_idle_ms for x in bill.groups)
    write([
        "total", *blank, "", hours(alloc), hours(used), hours(ridle), "", "", money(bill.total),
        cur,
    ])  # fmt: skip
    return buf.getvalue()
