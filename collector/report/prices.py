"""Prices of GPU time, outside the records (`prices.toml`), so that re-pricing a past quarter
never needs a replay.

    currency = "USD"
    default = 1.20                    # per GPU-hour, for a model no entry matches
    [models]                          # per GPU-hour; exact name first, then globs in file order
    "NVIDIA H100 80GB HBM3" = 2.49
    "NVIDIA A100*" = 1.60
    [namespaces]                      # adjustments: -0.2 = 20 % discount, 0.1 = 10 % markup
    research = -0.2
    [labels.team]                     # by the value of the pod label `team`
    vision = 0.1

Money is `decimal.Decimal` throughout; prices are read from the TOML text as decimals, never
through a float. Adjustments that match the same row multiply: (1 + a) (1 + b).
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from fnmatch import fnmatchcase
from fractions import Fraction
from pathlib import Path
from typing import Any

from .. import settings_check as check

__all__ = ["MAX_DIGITS", "MAX_EXPONENT", "PriceError", "Prices"]

MAX_EXPONENT = 30  # of a price or adjustment (`Decimal.adjusted`): 1e-30 up to below 1e31
# Significant digits of a price or adjustment: a million of them made the exact arithmetic
# take 52 s on the demo's records where 15 took 0.46 s.
MAX_DIGITS = 60


class PriceError(Exception):
    """A prices file that cannot be used; the message is one line."""


def _decimal(where: str, value: Any) -> Decimal:
    if isinstance(value, bool) or not isinstance(value, int | float | str | Decimal):
        raise PriceError(f"{where}: a number is needed, got {value!r}")
    try:
        d = value if isinstance(value, Decimal) else Decimal(str(value))
    except InvalidOperation:
        raise PriceError(f"{where}: not a number: {value!r}") from None
    if not d.is_finite():
        raise PriceError(f"{where}: not a finite number: {value!r}")
    if d.is_zero():  # at any exponent: 0e-50 is 0, and the page prints 0, not its 50 places
        return Decimal(0)
    # Money is exact: a price of 1e999999999 would be a Fraction of a billion digits, and the
    # report would never end. Real prices and adjustments are far inside this range.
    if abs(d.adjusted()) > MAX_EXPONENT:
        raise PriceError(
            f"{where}: out of range: the exponent must lie within ±{MAX_EXPONENT} "
            f"(1e-{MAX_EXPONENT} up to below 1e{MAX_EXPONENT + 1})"
        )
    if len(d.as_tuple().digits) > MAX_DIGITS:
        raise PriceError(f"{where}: more than {MAX_DIGITS} significant digits")
    return d


@dataclass(frozen=True)
class Prices:
    currency: str = "USD"
    default: Decimal = Decimal(0)
    models: tuple[tuple[str, Decimal], ...] = ()
    namespaces: dict[str, Decimal] = field(default_factory=dict)
    labels: dict[str, dict[str, Decimal]] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> Prices:
        # As --config is read: a FIFO waited for a writer forever and /dev/zero never ended.
        try:
            text = check.small_file(path).decode("utf-8")
        except OSError as exc:
            raise PriceError(f"prices {path}: {exc.strerror}") from None
        except check.SettingError as exc:
            raise PriceError(f"prices {path}: {exc}") from None
        except UnicodeDecodeError as exc:  # TOML is UTF-8; the bytes are not shown
            raise PriceError(f"prices {path}: not UTF-8 text (byte {exc.start})") from None
        return cls.parse(text, f"prices {path}")

    @classmethod
    def parse(cls, text: str, where: str = "prices") -> Prices:
        try:
            # floats come as Decimal from their own text: 2.49 stays 2.49, not 2.4900000000000002
            data = tomllib.loads(text, parse_float=Decimal)
        except (tomllib.TOMLDecodeError, ValueError) as exc:
            # (an integer over Python's 4300 digits is a ValueError, not a TOML error)
            raise PriceError(f"{where}: {exc}") from None
        except RecursionError:  # (tomllib recurses once per nested array or inline table)
            raise PriceError(f"{where}: values nested too deeply") from None
        unknown = set(data) - {"currency", "default", "models", "namespaces", "labels"}
        if unknown:
            raise PriceError(f"{where}: unknown key {sorted(unknown)[0]!r}")
        currency = data.get("currency", "USD")
        if not isinstance(currency, str) or not re.fullmatch(r"[A-Za-z]{1,8}", currency):
            raise PriceError(f"{where}: currency must be a short code such as USD")
        default = _decimal(f"{where}: default", data.get("default", 0))
        models = []
        for name, price in _table(where, data, "models").items():
            p = _decimal(f"{where}: models.{name!r}", price)
            if p < 0:
                raise PriceError(f"{where}: models.{name!r}: a price cannot be negative")
            models.append((name, p))
        if default < 0:
            raise PriceError(f"{where}: default: a price cannot be negative")
        namespaces = {
            k: _adjustment(f"{where}: namespaces.{k}", v)
            for k, v in _table(where, data, "namespaces").items()
        }
        labels = {}
        for name, values in _table(where, data, "labels").items():
            if not check.label_key(name):  # (it matched no record: an adjustment never applied)
                raise PriceError(f"{where}: labels.{name!r} is not a label key")
            if not isinstance(values, dict):
                raise PriceError(f"{where}: labels.{name} must be a table of value = adjustment")
            if "" in values:
                # A report groups a pod without the label under "" too: it was priced so.
                raise PriceError(
                    f"{where}: labels.{name}: an empty value cannot be told from no label"
                )
            labels[name] = {
                k: _adjustment(f"{where}: labels.{name}.{k}", v) for k, v in values.items()
            }
        return cls(currency.upper(), default, tuple(models), namespaces, labels)

    def price(self, model: str) -> Decimal:
        """Per GPU-hour: the exact name, else the first glob that matches, else the default.
        No model, "" (a GPU without inventory), is matched by no glob (`"*"` took it): by an
        entry `""` only."""
        for name, p in self.models:
            if name == model:
                return p
        if not model:
            return self.default
        for name, p in self.models:
            if any(c in name for c in "*?[") and fnmatchcase(model, name):
                return p
        return self.default

    def factor(self, namespace: str, labels: dict[str, str]) -> Fraction:
        """The product of (1 + adjustment) of the namespace and the labels that match, exact
        (in Decimal's 28 digits, 1 + 1e-30 was 1)."""
        f = Fraction(1)
        a = self.namespaces.get(namespace)
        if a is not None:
            f *= 1 + Fraction(a)
        for name, values in self.labels.items():
            v = labels.get(name)
            if v is not None and v in values:
                f *= 1 + Fraction(values[v])
        return f

    @property
    def adjusts(self) -> bool:
        return bool(self.namespaces or self.labels)


def _table(where: str, data: dict[str, Any], key: str) -> dict[str, Any]:
    t = data.get(key, {})
    if not isinstance(t, dict):
        raise PriceError(f"{where}: [{key}] must be a table")
    return t


def _adjustment(where: str, value: Any) -> Decimal:
    a = _decimal(where, value)
    if a < -1:
        raise PriceError(f"{where}: an adjustment below -1 would make a negative price")
    return a
