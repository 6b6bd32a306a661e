"""What the fair-share allocation costs the aggregator: the windowing benchmark
(`bench_windows.py`, the aggregator's core, with no transport around it) on this tree with the
allocation on, and on a copy of this same tree with the allocation cut out, alternately in fresh
processes, side by side in one run.

    .venv/bin/python bench/bench_allocation.py [--repeat 5] [-- bench_windows args]

"Off" is this tree's `collector/` copied to a temporary folder with `OFF_EDITS` applied: no
observed-time intervals in `integrate`, no present time per limits (`Device.settle`, `pres`, and
the reserved-idle `ipres`/`imem`), no shares merged in `Output.emit`, no
`observed_ms`/`fit`/`allocated_ms`/`used_ms`/`idle_part` and no `gpu` and `idle` records in
`Output._gpu`. Everything else is the same code, so the difference is the
allocation alone. An edit that no longer matches the code stops the bench with its name.
The end-to-end path adds decoding and Kafka around the same code, so the share measured here is
an upper bound for the end-to-end figure. Goal: allocation costs <= 15 % of the throughput.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GOAL = 0.15
_RATE = re.compile(r"add\+advance\s+[\d.]+ s\s+([\d,]+) rows/s")
_CPU_RATE = re.compile(r"cpu\s+[\d.]+ s\s+([\d,]+) rows/s per CPU second")

W = "collector/aggregate/windows/"
# (file, what, the code with the allocation, the code without it)
OFF_EDITS: list[tuple[str, str, str, str]] = [
    (
        W + "integrate.py",
        "presence intervals",
        "                tr.obs += pdt\n"
        "                ivs = tr.ivs\n"
        "                if ivs and ivs[-1][1] == a:\n"
        "                    ivs[-1][1] = a + pdt\n"
        "                else:\n"
        "                    ivs.append([a, a + pdt])\n",
        "                tr.obs += pdt\n",
    ),
    (
        W + "integrate.py",
        "present time",
        "                    d.pres += pdt\n"
        "                    if not d.sm:  # reserved but idle: no SM activity, or no live key\n"
        "                        d.ipres += pdt\n",
        "",
    ),
    (
        W + "integrate.py",
        "reserved-idle memory",
        "                    if not d.sm:\n                        d.imem += total * dt\n",
        "",
    ),
    (
        W + "integrate.py",
        "node-row intervals",
        "                    if node:\n"
        "                        div = d.ivs\n"
        "                        if div and div[-1][1] == a:\n"
        "                            div[-1][1] = c\n"
        "                        else:\n"
        "                            div.append([a, c])\n",
        "",
    ),
    (
        W + "apply.py",
        "settle at forget",
        "        d.settle()\n        d.uuid = None\n",
        "        d.uuid = None\n",
    ),
    (W + "apply.py", "settle at limits", "    for d in devs.values():\n        d.settle()\n", ""),
    (W + "output.py", "settle at emit", "            d.settle()\n", ""),
    (
        W + "output.py",
        "shares and intervals merged",
        "                shares = row.shares\n"
        "                for lk, ms in d.shares.items():\n"
        "                    shares[lk] = shares.get(lk, 0) + ms\n"
        "                ishares = row.ishares\n"
        "                for lk, ms in d.ishares.items():\n"
        "                    ishares[lk] = ishares.get(lk, 0) + ms\n"
        "                row.imem += d.imem\n"
        "                if ivs:\n"
        "                    gpus.setdefault((ws, tr.node, d.uuid), []).extend(ivs)\n",
        "",
    ),
    (
        W + "output.py",
        "allocation of a GPU",
        "        observed = observed_ms(ivs)\n"
        "        policy = self._policy\n"
        '        if memory <= 0 and policy in ("memory", "max"):\n'
        "            self._stats.allocation_fallbacks += 1\n"
        "        ctrs = [k for k in keys if k[2]]  # node rows (empty pod_uid) are allocated nothing\n"  # noqa: E501
        "        used_raw = [used_ms(out[k].sm, out[k].mem, memory) for k in ctrs]\n"
        "        used, _ = fit(used_raw, observed)\n"
        '        if policy == "usage":\n'
        "            alloc, over, raw = list(used), False, used_raw\n"
        "            idle_raw = [used_ms(0, out[k].imem, memory) for k in ctrs]\n"
        "        else:\n"
        "            raw = [allocated_ms(policy, out[k].shares, memory) for k in ctrs]\n"
        "            alloc, over = fit(raw, observed)\n"
        "            idle_raw = [allocated_ms(policy, out[k].ishares, memory) for k in ctrs]\n"
        "        reserved_idle = idle_part(alloc, idle_raw, raw)\n"
        "        if over:\n"
        "            self._stats.overcommitted += 1\n"
        "        share = {\n"
        "            k: (a, u, ri) for k, a, u, ri in zip(ctrs, alloc, used, reserved_idle, strict=True)\n"  # noqa: E501
        "        }\n",
        "        over = False\n        share: dict[Any, Any] = {}\n",
    ),
    (
        W + "output.py",
        "gpu and idle records",
        "        sa = sum(alloc)\n",
        "        return records\n",
    ),
]


def off_tree(tmp: Path) -> Path:
    """This tree's collector with the allocation cut out (`OFF_EDITS`)."""
    tree = tmp / "off"
    shutil.copytree(ROOT / "collector", tree / "collector")
    for name, what, old, new in OFF_EDITS:
        path = tree / name
        text = path.read_text()
        if text.count(old) != 1:
            raise SystemExit(f"bench_allocation: edit {what!r} no longer matches {name}")
        path.write_text(text.replace(old, new))
    return tree


def rates(tree: Path, extra: list[str]) -> tuple[float, float]:
    """(rows/s by the wall clock, rows/s per CPU second) of one bench_windows.py run."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_windows.py"), *extra],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=tree,
    ).stdout
    found = [r.search(out) for r in (_RATE, _CPU_RATE)]
    assert all(found), out
    wall, cpu = (float(m.group(1).replace(",", "")) for m in found if m)
    return wall, cpu


def summary(name: str, on: list[float], off: list[float]) -> float:
    """Print one clock's figures; return the cost by the medians."""
    ratios = [a / b for a, b in zip(on, off, strict=True)]
    n, b = statistics.median(on), statistics.median(off)
    cost = 1 - n / b
    print(f"  {name}:")
    print(f"    allocation off  median {b:>12,.0f} rows/s  {[round(x) for x in off]}")
    print(f"    allocation on   median {n:>12,.0f} rows/s  {[round(x) for x in on]}")
    print(
        f"    on/off per pair {[round(r, 3) for r in ratios]}, "
        f"median {statistics.median(ratios):.3f}"
    )
    # The best run of each is the one the machine's other load disturbed least (timeit's rule).
    print(
        f"    cost {100 * cost:.1f} % of the throughput (medians), "
        f"{100 * (1 - statistics.median(ratios)):.1f} % (median pair), "
        f"{100 * (1 - max(on) / max(off)):.1f} % (best of each)"
    )
    return cost


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("extra", nargs="*", help="arguments for bench_windows.py")
    args = ap.parse_args(argv)
    runs: dict[str, list[tuple[float, float]]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory() as tmp:
        trees = [("on", ROOT), ("off", off_tree(Path(tmp)))]
        for i in range(args.repeat):
            # alternate which goes first, so a drift in the machine's load favours neither
            for name, tree in trees if i % 2 == 0 else reversed(trees):
                runs[name].append(rates(tree, args.extra))
    load = os.getloadavg()
    print(f"allocation bench: bench_windows.py {' '.join(args.extra)} x {args.repeat}, interleaved")
    summary("wall clock", [w for w, _ in runs["on"]], [w for w, _ in runs["off"]])
    cost = summary("per CPU second", [c for _, c in runs["on"]], [c for _, c in runs["off"]])
    verdict = "met" if cost <= GOAL else "NOT met"
    print(f"  goal <= {100 * GOAL:.0f} % (per CPU second, medians): {verdict}")
    print(f"  load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
