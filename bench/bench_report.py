"""`hami-usage report` over a month of Parquet billing records, on one core.

    .venv/bin/python bench/bench_report.py [--days 30] [--nodes 100] [--gpus 8] [--containers 4]
                                           [--window-min 5] [--parts-per-day 1] [--dir DIR] [--keep]

Writes what `aggregate --parquet` would have written for that fleet (per node, GPU and
5-minute window: 4 container records at 25 % each, the GPU's record and its idle record; a
namespace, workload and `team` label per container), generated column-wise with numpy, then
runs `hami-usage report --parquet DIR --by namespace --by label:team --out-csv --html` pinned
to one core (`taskset -c 0`) and reports its wall time and peak RSS (the child's ru_maxrss).
Goals: <= 60 s and <= 2 GiB for 100 nodes x 8 GPUs x 4 containers x 30 days (~28 M container
records).
"""

from __future__ import annotations

import argparse
import datetime as dt
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from collector.aggregate.columns import arrow_schema
from collector.aggregate.records import RECORD_VERSION

ROOT = Path(__file__).resolve().parent.parent
T0 = 1_793_491_200_000  # 2026-11-01T00:00:00Z
DAY = 86_400_000


def day_table(day: int, nodes: int, gpus: int, ctrs: int, window_ms: int) -> pa.Table:
    windows = DAY // window_ms
    per_gpu = ctrs + 2  # containers, then the gpu and idle records
    n_gpu = nodes * gpus
    rows = windows * n_gpu * per_gpu
    w = np.repeat(np.arange(windows, dtype=np.int64), n_gpu * per_gpu)
    start = T0 + day * DAY + w * window_ms
    g = np.tile(np.repeat(np.arange(n_gpu), per_gpu), windows)
    slot = np.tile(np.arange(per_gpu), windows * n_gpu)
    is_ctr = slot < ctrs
    kind_idx = np.where(is_ctr, 0, slot - ctrs + 1)  # 0 container, 1 gpu, 2 idle
    window_s = window_ms / 1000
    quarter = window_s / ctrs
    node = g // gpus
    ctr_id = g * ctrs + np.where(is_ctr, slot, 0)
    team_idx = ctr_id % 7

    def dict_col(indices: np.ndarray, values: list[str]) -> pa.Array:
        return pa.DictionaryArray.from_arrays(pa.array(indices, pa.int32()), pa.array(values))

    nodes_v = [f"node-{i:03d}" for i in range(nodes)]
    uuid_v = [f"GPU-{i:08d}-0000-4000-8000-000000000000" for i in range(n_gpu)]
    pod_v = [f"{i:08d}-1111-4000-8000-000000000000" for i in range(n_gpu * ctrs)]
    ns_v = [f"team-{i}" for i in range(7)] + [""]
    ns_idx = np.where(is_ctr, team_idx, 7)
    cols = {
        "window_start_ms": start,
        "window_end_ms": start + window_ms,
        "node": dict_col(node, nodes_v),
        "pod_uid": dict_col(np.where(is_ctr, ctr_id, 0), pod_v),
        "container": dict_col(np.where(is_ctr, 0, 1), ["main", ""]),
        "device_uuid": dict_col(g, uuid_v),
        "memory_byte_seconds": np.where(is_ctr, 8.0 * 2**30 * window_s, 0.0),
        "memory_limit_byte_seconds": np.where(is_ctr, 20.0 * 2**30 * window_s, 0.0),
        "nvml_memory_byte_seconds": np.zeros(rows),
        "sm_percent_seconds": np.where(is_ctr, 10.0 * window_s, 0.0),
        "sm_limit_percent_seconds": np.where(is_ctr, 25.0 * window_s, 0.0),
        "peak_memory_bytes": np.zeros(rows, dtype=np.int64),
        "observed_seconds": np.where(kind_idx == 2, 0.0, window_s),
        "samples": np.zeros(rows, dtype=np.int64),
        # unique, 32 hex digits long like the aggregator's (`report` keeps one per id)
        "record_id": pc.utf8_lpad(
            pc.cast(pa.array(np.arange(rows, dtype=np.int64) + day * rows), pa.string()), 32, "0"
        ),
        "namespace": dict_col(ns_idx, ns_v),
        "pod": dict_col(np.where(is_ctr, ctr_id, 0), [f"p-{i}" for i in range(n_gpu * ctrs)]),
        "workload_kind": dict_col(np.where(is_ctr, 0, 1), ["Deployment", ""]),
        "workload": dict_col(np.where(is_ctr, team_idx, 7), [f"w{i}" for i in range(7)] + [""]),
        "revision": np.zeros(rows, dtype=np.int64),
        "kind": dict_col(kind_idx, ["container", "gpu", "idle"]),
        "gpu_model": dict_col(np.zeros(rows, dtype=np.int64), ["NVIDIA H100 80GB HBM3"]),
        "gpu_memory_bytes": np.full(rows, 80 * 2**30, dtype=np.int64),
        "allocated_gpu_seconds": np.where(is_ctr, quarter, np.where(kind_idx == 1, window_s, 0.0)),
        "used_gpu_seconds": np.where(
            is_ctr, quarter / 2, np.where(kind_idx == 1, window_s / 2, window_s / 2)
        ),
        "overcommitted": np.zeros(rows, dtype=bool),
        "reserved_idle_gpu_seconds": np.where(is_ctr, quarter / 4, 0.0),
        "version": np.full(rows, RECORD_VERSION, dtype=np.int64),
    }
    # one label, `team`, on the containers
    counts = is_ctr.astype(np.int32)
    offsets = pa.array(np.concatenate([[0], np.cumsum(counts)]).astype(np.int32))
    keys = pa.array(np.full(int(counts.sum()), "team", dtype=object), pa.string())
    items = pa.array([f"t{i}" for i in team_idx[is_ctr]], pa.string())
    schema = arrow_schema()
    arrays = []
    for f in schema:
        if f.name == "labels":
            arrays.append(pa.MapArray.from_arrays(offsets, keys, items))
            continue
        a = cols.get(f.name)
        if a is None:  # a field this generator does not know: its zero value
            zero = {pa.string(): "", pa.bool_(): False, pa.float64(): 0.0}.get(f.type, 0)
            a = pa.array([zero] * rows, f.type)
        a = a if isinstance(a, pa.Array) else pa.array(a)
        arrays.append(a.cast(f.type) if not pa.types.is_dictionary(a.type) else a)
    fields = [pa.field(f.name, arrays[i].type) for i, f in enumerate(schema)]
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--days", type=int, default=30)
    ap.add_argument("--nodes", type=int, default=100)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--containers", type=int, default=4)
    ap.add_argument("--window-min", type=int, default=5)
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument(
        "--parts-per-day",
        type=int,
        default=1,
        help="parts a day is written in (the aggregator writes about one per window closed)",
    )
    args = ap.parse_args(argv)
    root = args.dir or Path(tempfile.mkdtemp(prefix="bench-report-"))
    window_ms = args.window_min * 60_000
    gen = time.perf_counter()
    rows = ctr_rows = 0
    for d in range(args.days):
        day = dt.datetime.fromtimestamp((T0 + d * DAY) / 1000, tz=dt.UTC).strftime("%Y-%m-%d")
        folder = root / "pq" / f"day={day}"
        folder.mkdir(parents=True, exist_ok=True)
        t = day_table(d, args.nodes, args.gpus, args.containers, window_ms)
        step = -(-t.num_rows // args.parts_per_day)
        for k, at in enumerate(range(0, t.num_rows, step)):
            part = folder / f"part-0-{d * args.parts_per_day + k:010d}.parquet"
            pq.write_table(t.slice(at, step), part, compression="zstd")
        rows += t.num_rows
        ctr_rows += t.num_rows * args.containers // (args.containers + 2)
    gen_s = time.perf_counter() - gen
    size = sum(f.stat().st_size for f in root.rglob("*.parquet"))
    prices = root / "prices.toml"
    prices.write_text('currency = "USD"\ndefault = 1.0\n[models]\n"NVIDIA H100*" = 2.49\n')
    frm = dt.datetime.fromtimestamp(T0 / 1000, tz=dt.UTC).isoformat()
    to = dt.datetime.fromtimestamp((T0 + args.days * DAY) / 1000, tz=dt.UTC).isoformat()
    cmd = [
        "taskset", "-c", "0", str(Path(sys.executable).parent / "hami-usage"), "report",
        "--from", frm, "--to", to, "--parquet", str(root / "pq"), "--by", "namespace",
        "--by", "label:team", "--prices", str(prices),
        "--out-csv", str(root / "bill.csv"), "--html", str(root / "r.html"),
    ]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    if proc.returncode:
        print(proc.stderr, file=sys.stderr)
        return 1
    print(
        f"report bench: {args.days} days x {args.nodes} nodes x {args.gpus} GPUs x "
        f"{args.containers} containers, {args.window_min}-minute windows, "
        f"{args.parts_per_day} parts a day"
    )
    print(
        f"  records  {rows:>12,} ({ctr_rows:,} container records), "
        f"parquet {size / 2**20:,.0f} MiB, generated in {gen_s:.1f} s"
    )
    print(f"  report   {wall:8.1f} s wall on one core, peak RSS {rss / 2**30:.2f} GiB")
    ok = wall <= 60 and rss <= 2 * 2**30
    print(f"  goal <= 60 s and <= 2 GiB: {'met' if ok else 'NOT met'}")
    print(proc.stdout.splitlines()[-1])
    if not args.keep and args.dir is None:
        shutil.rmtree(root)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
