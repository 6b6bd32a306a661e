"""The numbers of a report, accumulated batch by batch (so a month of records never has to be
in memory at once): GPU time per group, idle time per GPU, and what the GPUs were observed.

Times arrive as integer milliseconds (`TIMES`: a record's seconds are n / 1000 for an integer n,
see load.py) and are summed as exact integers, so for every GPU model Σ allocated + idle =
observed holds exactly here as it does in the records, whatever the magnitudes: a record holds
up to 2^63 − 1 ms, so two of them overflow int64: the sums are taken in decimal128(38, 0),
which holds 2^63 such records, and then in Python integers.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from ..aggregate.records import SINCE_VERSION
from ..settings_check import label_key, shown

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["DIMENSIONS", "TIMES", "Summary", "column", "columns_for", "parse_by"]

DIMENSIONS: Final = ("namespace", "workload", "pod", "node", "gpu-model")
# The record fields `Summary.add` takes as int64 milliseconds, not as the records' seconds.
TIMES: Final = frozenset(
    {"observed_seconds", "allocated_gpu_seconds", "used_gpu_seconds", "reserved_idle_gpu_seconds"}
)
RESERVED_IDLE_SINCE: Final = SINCE_VERSION["reserved_idle_gpu_seconds"]
HOUR_MS: Final = 3_600_000


def column(dim: str) -> str:
    """The --out-csv column of a --by value: label:team -> label_team, gpu-model -> gpu_model."""
    return dim.replace("-", "_").replace(":", "_")


def parse_by(values: list[str]) -> list[str]:
    """--by values, each checked: a dimension or label:NAME, each its own CSV column."""
    out: list[str] = []
    for v in values or ["namespace"]:
        for part in v.split(","):
            part = part.strip()
            if not (part in DIMENSIONS or (part.startswith("label:") and label_key(part[6:]))):
                what = f"one of {', '.join(DIMENSIONS)} or label:NAME (NAME a label key)"
                raise ValueError(f"--by {shown(part)}: {what}")
            if column(part) in map(column, out):  # label:a-b and label:a_b too
                raise ValueError(f"--by {part!r}: column {column(part)} given twice")
            out.append(part)
    return out


def columns_for(by: list[str]) -> list[str]:
    """The record columns a report grouped by `by` reads."""
    cols = {
        "window_start_ms", "kind", "gpu_model", "node", "device_uuid", "namespace", "labels",
        "memory_byte_seconds", "observed_seconds", "allocated_gpu_seconds", "used_gpu_seconds",
        "reserved_idle_gpu_seconds", "version",
    }  # fmt: skip
    for d in by:
        if d == "workload":
            cols |= {"workload_kind", "workload"}
        elif d == "pod":
            cols |= {"pod", "pod_uid"}
    return sorted(cols)


@dataclass
class Summary:
    by: list[str]
    bucket_ms: int
    label_keys: list[str]  # labels the prices adjust by
    # (group..., gpu_model, namespace, label values...) -> [allocated ms, used ms, mem B.s,
    # reserved-idle ms, allocated ms of records older than reserved-idle (not measured there)]
    groups: dict[tuple[str, ...], list[float]] = field(default_factory=dict)
    # (bucket, first-dimension group) -> allocated ms
    series: dict[tuple[int, str], int] = field(default_factory=lambda: defaultdict(int))
    # gpu_model -> [observed, allocated, idle, used idle] ms
    models: dict[str, list[int]] = field(default_factory=dict)
    # (node, device_uuid, gpu_model) -> [observed, idle] ms
    gpus: dict[tuple[str, str, str], list[int]] = field(default_factory=dict)
    rows: int = 0

    def add(self, table: pa.Table) -> None:
        """Add `table`'s records: `TIMES` as int64 milliseconds, the rest as `arrow_schema()`."""
        import pyarrow as pa
        import pyarrow.compute as pc

        self.rows += table.num_rows
        exact = pa.decimal128(38, 0)  # int64 sums wrap past 2^63 without a word

        def ms(col: pa.ChunkedArray) -> pa.ChunkedArray:
            return pc.cast(col, exact)

        t = table.select(["kind", "gpu_model", "node", "device_uuid", "window_start_ms"])
        t = t.append_column("alloc", ms(table["allocated_gpu_seconds"]))
        t = t.append_column("used", ms(table["used_gpu_seconds"]))
        t = t.append_column("obs", ms(table["observed_seconds"]))
        t = t.append_column("mem", table["memory_byte_seconds"])
        # Records before version 2 did not measure reserved-idle (Parquet reads it as null):
        # their allocation is counted apart, never as 0 idle.
        old = pc.less(pc.fill_null(table["version"], 1), RESERVED_IDLE_SINCE)
        zero = pa.scalar(0, exact)
        ridle = pc.if_else(old, 0, pc.fill_null(table["reserved_idle_gpu_seconds"], 0))
        t = t.append_column("ridle", ms(ridle))
        t = t.append_column("unmeasured", pc.if_else(old, t["alloc"], zero))
        t = t.append_column("ns", table["namespace"])
        keys = []
        labels: dict[str, pa.ChunkedArray] = {}
        for i, d in enumerate(self.by):
            if d.startswith("label:"):
                col = labels[d[6:]] = _label(table, d[6:])
            else:
                col = self._dimension(table, d)
            t = t.append_column(f"g{i}", col)
            keys.append(f"g{i}")
        for j, name in enumerate(self.label_keys):
            col = labels.get(name)
            t = t.append_column(f"l{j}", col if col is not None else _label(table, name))
        lkeys = [f"l{j}" for j in range(len(self.label_keys))]

        ctr = t.filter(pc.equal(t["kind"], "container"))
        price_keys = [*keys, "gpu_model", "ns", *lkeys]
        agg = ctr.group_by(price_keys).aggregate(
            [("alloc", "sum"), ("used", "sum"), ("mem", "sum"), ("ridle", "sum"),
             ("unmeasured", "sum")]
        )  # fmt: skip
        for row in agg.to_pylist():
            k = tuple(row[c] for c in price_keys)
            acc = self.groups.setdefault(k, [0, 0, 0.0, 0, 0])
            acc[0] += int(row["alloc_sum"])
            acc[1] += int(row["used_sum"])
            acc[2] += row["mem_sum"]
            acc[3] += int(row["ridle_sum"])
            acc[4] += int(row["unmeasured_sum"])
        # integer division: window starts are positive
        bucket = pc.divide(ctr["window_start_ms"], self.bucket_ms)
        s = pa.table({"b": pc.cast(bucket, pa.int64()), "g": ctr["g0"], "a": ctr["alloc"]})
        for row in s.group_by(["b", "g"]).aggregate([("a", "sum")]).to_pylist():
            self.series[(row["b"] * self.bucket_ms, row["g"])] += int(row["a_sum"])

        gpu = t.filter(pc.is_in(t["kind"], pa.array(["gpu", "idle"])))
        per = gpu.group_by(["kind", "node", "device_uuid", "gpu_model"]).aggregate(
            [("obs", "sum"), ("alloc", "sum"), ("used", "sum")]
        )
        for row in per.to_pylist():
            m = self.models.setdefault(row["gpu_model"], [0, 0, 0, 0])
            g = self.gpus.setdefault((row["node"], row["device_uuid"], row["gpu_model"]), [0, 0])
            obs, alloc, used = (int(row[c]) for c in ("obs_sum", "alloc_sum", "used_sum"))
            if row["kind"] == "gpu":
                m[0] += obs
                m[1] += alloc
                g[0] += obs
            else:
                m[2] += alloc
                m[3] += used
                g[1] += alloc

    def _dimension(self, table: pa.Table, d: str) -> pa.ChunkedArray:
        import pyarrow.compute as pc

        if d == "namespace":
            return table["namespace"]
        if d == "node":
            return table["node"]
        if d == "gpu-model":
            return table["gpu_model"]
        if d == "workload":  # kind/name, empty while unknown
            kind, name = _str(table["workload_kind"]), _str(table["workload"])
            joined = pc.binary_join_element_wise(kind, name, "/")
            return pc.if_else(pc.not_equal(name, ""), joined, "")
        if d == "pod":  # the name, the UID while the name is unknown
            pod = _str(table["pod"])
            return pc.if_else(pc.equal(pod, ""), _str(table["pod_uid"]), pod)
        return _label(table, d[6:])


def _str(col: pa.ChunkedArray) -> pa.ChunkedArray:
    """A plain string column (Parquet's are read dictionary-encoded)."""
    import pyarrow as pa

    return col if col.type == pa.string() else col.cast(pa.string())


def _label(table: pa.Table, name: str) -> pa.ChunkedArray:
    """The value of label `name` per row ("" without it), vectorised: the map's entries whose
    key is `name`, scattered back to their rows (`map_lookup` is ten times slower)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    chunks = []
    for m in table["labels"].chunks:
        # (list_parent_indices aborts on a MapArray in pyarrow 26: from the offsets instead)
        offsets = m.offsets.to_numpy()
        parents = np.repeat(np.arange(len(m)), np.diff(offsets))
        first, n = int(offsets[0]), int(offsets[-1] - offsets[0])
        keys, items = m.keys, m.items
        if len(keys) != n:  # the whole child of a sliced map
            keys, items = keys.slice(first, n), items.slice(first, n)
        hit = pc.equal(keys, name)
        rows = parents[hit.to_numpy(zero_copy_only=False)]
        found = pc.filter(items, hit).cast(pa.string())
        values = pa.concat_arrays([found, pa.array([""])])
        pos = np.full(len(m), len(values) - 1, dtype=np.int64)
        pos[rows[::-1]] = np.arange(len(rows) - 1, -1, -1)  # the first entry of a key wins
        chunks.append(values.take(pa.array(pos)))
    return pa.chunked_array(chunks, pa.string())
