"""CSV as the project writes it (the billing sink, `report --csv`): `\\n` line ends, every row
reads back as it was written, and no cell that a spreadsheet would run as a formula."""

from __future__ import annotations

import csv
from collections.abc import Iterable, Sequence
from typing import Any

# What makes a spreadsheet take a cell for a formula (OWASP's list), and the apostrophe that
# defuses them, so that `text` gives back exactly what `cell` was given.
_ACTIVE = ("=", "+", "-", "@", "\t", "\r", "'")


def cell(value: str) -> str:
    """`value` as a text cell: an apostrophe before it when it begins like a formula (or with an
    apostrophe). No name that Kubernetes or NVML gives begins so; a value a tenant wrote can (a
    cache file's UUID `=HYPERLINK(...)` was a live link in the bill)."""
    return "'" + value if value.startswith(_ACTIVE) else value


def text(value: str) -> str:
    """What `cell` was given. Only an apostrophe that `cell` could have added is taken off (one
    before =, +, -, @, a tab, a carriage return or another apostrophe): a file written before
    cells were defused holds values as they were, and one such as `'GPU-x` reads as it did."""
    return value[1:] if value.startswith("'") and value[1:].startswith(_ACTIVE) else value


class Writer:
    """`csv.writer` with `\\n` line ends whose rows read back as written. Minimal quoting leaves
    a field with a carriage return bare when the line end is `\\n` alone, and a reader ends the
    row there (a pod owner's name with one made the billing file unreadable), so a row that
    holds one has every field quoted."""

    def __init__(self, out: Any) -> None:
        self._minimal = csv.writer(out, lineterminator="\n")
        self._quoted = csv.writer(out, lineterminator="\n", quoting=csv.QUOTE_ALL)

    def writerow(self, row: Sequence[object]) -> None:
        cr = any(isinstance(c, str) and "\r" in c for c in row)
        (self._quoted if cr else self._minimal).writerow(row)

    def writerows(self, rows: Iterable[Sequence[object]]) -> None:
        for row in rows:
            self.writerow(row)
