"""The report as one self-contained HTML page: matplotlib charts inlined as SVG, tables, a
stylesheet in the page; no script, no network, readable in any browser or mail client.

Charts: GPU-hours per group over time (stacked), allocated against used per group, each
group's allocation as used / reserved but idle / the rest, idle share per GPU, and the
reconciliation table (per GPU model: observed = allocated + idle, its cost)."""

from __future__ import annotations

import html
import io
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

from .bill import Bill, Line, hours, model_name, money, part_name
from .summary import Summary

__all__ = ["render"]

TOP = 8  # groups drawn by name in the chart over time; the rest are one "other (N groups)"
SHOWN = 15  # groups in the per-group charts: the largest by allocation


def _svg(fig: Any) -> str:
    import matplotlib.pyplot as plt

    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg") :]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.fonttype"] = "none"  # text stays text: small and searchable
    plt.rcParams["svg.hashsalt"] = "hami-usage"  # the same ids every time
    # Labels carry names and device UUIDs from the records, which tenants can write: `$...$`
    # in one is text to show, never TeX to parse (a parse error would lose the whole page).
    plt.rcParams["text.parse_math"] = False
    return plt


def _legend(ax: Any, **kw: Any) -> None:
    """A legend when the chart has something to name (an empty range has nothing: matplotlib
    would warn on stderr)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kw)


def _legend_label(name: str) -> str:
    """`name` as a legend entry: matplotlib leaves out a label that begins with `_` (a tenant's
    UUID can), so such a one starts with a zero-width space, which shows nothing."""
    return "\u200b" + name if name.startswith("_") else name


def _over_time(summary: Summary) -> str:
    import datetime as dt

    plt = _pyplot()
    per: dict[str, int] = defaultdict(int)
    for (_, g), ms in summary.series.items():
        per[g] += ms
    top = [g for g, _ in sorted(per.items(), key=lambda x: -x[1])[:TOP]]
    buckets = sorted({b for b, _ in summary.series})
    # The rest is keyed None: a group may be called "other" (a namespace can), and its stack
    # took in every group outside the top, ns8 unnamed in the legend.
    stacks: dict[str | None, list[float]] = {g: [0.0] * len(buckets) for g in [*top, None]}
    index = {b: i for i, b in enumerate(buckets)}
    for (b, g), ms in summary.series.items():
        stacks[g if g in stacks else None][index[b]] += ms / 3_600_000
    rest = len(per) - len(top)
    if not any(stacks[None]):
        del stacks[None]
    fig, ax = plt.subplots(figsize=(9, 3.6))
    xs = [dt.datetime.fromtimestamp(b / 1000, tz=dt.UTC) for b in buckets]
    width = summary.bucket_ms / 86_400_000 * 0.9
    bottom = [0.0] * len(buckets)
    for group, ys in stacks.items():
        label = f"other ({rest} groups)" if group is None else _legend_label(part_name(group))
        ax.bar(xs, ys, width=width, bottom=bottom, label=label, align="edge")
        bottom = [a + b for a, b in zip(bottom, ys, strict=True)]
    ax.set_ylabel("GPU-hours allocated")
    ax.set_title(f"GPU-hours per {summary.by[0]} over time")
    _legend(ax, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.autofmt_xdate()
    return _svg(fig)


def _largest(bill: Bill) -> tuple[list[Line], str]:
    """The groups a per-group chart draws, and what its title says of the rest: the largest by
    allocation (the bill lists by cost, and without prices every cost is 0: the first 15 names
    were drawn, and a group with 10 times the GPU-hours of any other was left out)."""
    lines = sorted(bill.groups, key=lambda x: (-x.allocated_ms, x.name))[:SHOWN]
    more = len(bill.groups) - len(lines)
    return lines, f" (the {SHOWN} largest of {len(bill.groups)} by allocation)" if more else ""


def _allocated_vs_used(bill: Bill) -> str:
    plt = _pyplot()
    lines, of = _largest(bill)
    labels = [x.name for x in lines][::-1]
    alloc = [x.allocated_ms / 3_600_000 for x in lines][::-1]
    used = [x.used_ms / 3_600_000 for x in lines][::-1]
    fig, ax = plt.subplots(figsize=(9, 0.4 * len(lines) + 1.2))
    ys = range(len(lines))
    ax.barh([y + 0.2 for y in ys], alloc, height=0.4, label="allocated")
    ax.barh([y - 0.2 for y in ys], used, height=0.4, label="used")
    ax.set_yticks(list(ys), labels, fontsize=8)
    ax.set_xlabel("GPU-hours")
    ax.set_title(f"Allocated against used, per group{of}")
    _legend(ax, fontsize=8)
    return _svg(fig)


def _reserved_idle(bill: Bill) -> str:
    """Per group, its allocation split three ways: used, reserved but idle, and the rest.
    Used is drawn up to the allocation's active part (allocated - reserved idle); what it
    uses beyond that (a memory share while SMs idle, SM time beyond a limit) is marked."""
    plt = _pyplot()
    lines, of = _largest(bill)
    labels = [x.name for x in lines][::-1]
    h = 3_600_000
    idle = [x.reserved_idle_ms / h for x in lines][::-1]
    active = [(x.allocated_ms - x.reserved_idle_ms) / h for x in lines][::-1]
    used = [x.used_ms / h for x in lines][::-1]
    inside = [min(u, a) for u, a in zip(used, active, strict=True)]
    rest = [a - u for a, u in zip(active, inside, strict=True)]
    fig, ax = plt.subplots(figsize=(9, 0.4 * len(lines) + 1.4))
    ys = list(range(len(lines)))
    ax.barh(ys, inside, height=0.6, color="#2a7", label="used")
    ax.barh(ys, idle, height=0.6, left=inside, color="#d62", label="reserved but idle")
    left = [a + b for a, b in zip(inside, idle, strict=True)]
    ax.barh(ys, rest, height=0.6, left=left, color="#bbb", label="rest of allocated")
    beyond = [(y, u) for y, u, a in zip(ys, used, active, strict=True) if u > a]
    if beyond:
        ax.scatter([u for _, u in beyond], [y for y, _ in beyond], marker="|", s=200,
                   color="#064", label="used (beyond the active allocation)", zorder=3)  # fmt: skip
    ax.set_yticks(ys, labels, fontsize=8)
    ax.set_xlabel("GPU-hours allocated")
    ax.set_title(f"Used, reserved but idle (no SM activity) and the rest of the allocation{of}")
    _legend(ax, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _svg(fig)


def _idle_share(summary: Summary) -> str:
    plt = _pyplot()
    gpus = [(k, idle / obs) for k, (obs, idle) in summary.gpus.items() if obs]
    # The whole UUID: MIG instances of one GPU (`MIG-GPU-<parent>/gi/ci`) share any prefix. The
    # same node and UUID under two model names (an inventory that came late) adds the model.
    seen = Counter((node, uuid) for (node, uuid, _), _ in gpus)

    def label(node: str, uuid: str, model: str) -> str:
        return (
            f"{node} {uuid} ({model or 'no model'})" if seen[node, uuid] > 1 else f"{node} {uuid}"
        )

    shares = sorted(((label(*k), share) for k, share in gpus), key=lambda x: -x[1])
    if len(shares) <= 40:
        fig, ax = plt.subplots(figsize=(9, 0.3 * len(shares) + 1.2))
        # One bar per position, not per label text: two GPUs are never drawn as one bar.
        ys = list(range(len(shares)))
        ax.barh(ys, [100 * s[1] for s in shares][::-1], color="#999")
        ax.set_yticks(ys, [s[0] for s in shares][::-1])
        ax.set_xlabel("idle, % of observed time")
        ax.set_xlim(0, 100)
        ax.tick_params(axis="y", labelsize=7)
    else:
        fig, ax = plt.subplots(figsize=(9, 3))
        ax.hist([100 * s[1] for s in shares], bins=20, range=(0, 100), color="#999")
        ax.set_xlabel("idle, % of observed time")
        ax.set_ylabel("GPUs")
    ax.set_title(f"Idle share per GPU ({len(shares)} GPUs)")
    return _svg(fig)


def _table(head: list[str], rows: Sequence[Sequence[object]], cls: str) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows
    )
    return f'<table class="{cls}"><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>'


CSS = """
body{font-family:system-ui,sans-serif;margin:2em;color:#222;max-width:70em}
table{border-collapse:collapse;margin:1em 0;font-size:.9em}
td,th{border:1px solid #ccc;padding:.25em .6em;text-align:right}
td:first-child,th:first-child{text-align:left}
figure{margin:1.5em 0}svg{max-width:100%;height:auto}
.ok{color:#080}.bad{color:#b00}
"""


def render(bill: Bill, summary: Summary, title: str) -> str:
    cur = bill.currency
    unmeasured = ""
    if bill.unmeasured_ms:
        unmeasured = (
            f" Not measured for {hours(bill.unmeasured_ms)} GPU-h allocated in records written "
            "before it (record version 1): not counted as idle."
        )
    groups = [
        [x.name, hours(x.allocated_ms), hours(x.used_ms),
         hours(x.reserved_idle_ms), "" if x.efficiency is None else x.efficiency, money(x.cost)]
        for x in bill.groups
    ]  # fmt: skip
    groups += [[x.name, hours(x.allocated_ms), "", "", "", money(x.cost)] for x in bill.idle]
    groups.append(["rounding residue", "", "", "", "", bill.residue])
    groups.append(["total", "", "", "", "", money(bill.total)])
    # The price as prices.toml states it: a sub-cent list price rounded to the cent would
    # misstate what every cost is computed from.
    recon = [
        [model_name(m.model), hours(m.observed_ms), hours(m.allocated_ms), hours(m.idle_ms),
         "yes" if m.balanced else "NO", f"{m.price:f}", money(m.observed_cost)]
        for m in bill.models
    ]  # fmt: skip
    head = [
        "group (" + ", ".join(bill.by) + ")",
        "GPU-h allocated",
        "GPU-h used",
        "GPU-h reserved idle",
        "efficiency",
        f"cost ({cur})",
    ]
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f"<p>{summary.rows} billing records. Costs are rounded once, half-even; the rounding "
        "residue makes the lines add up to the total. "
        f"Adjustments: {money(bill.adjustments)} {cur}.</p>",
        "<h2>Bill</h2>",
        _table(head, groups, "bill"),
        "<h2>Reconciliation</h2><p>Per GPU model, every observed millisecond is either "
        "allocated to a container or idle.</p>",
        _table(
            [
                "GPU model",
                "observed GPU-h",
                "allocated GPU-h",
                "idle GPU-h",
                "balanced",
                f"price ({cur}/GPU-h)",
                f"observed cost ({cur})",
            ],
            recon,
            "reconciliation",
        ),  # fmt: skip
        f'<figure id="chart-over-time">{_over_time(summary)}</figure>',
        f'<figure id="chart-allocated-used">{_allocated_vs_used(bill)}</figure>',
        "<h2>Reserved but idle</h2><p>GPU time allocated to a group while its containers had "
        "no SM activity on the GPU (no process, or every process at 0 %): it holds a GPU and "
        f"does nothing.{unmeasured}</p>",
        f'<figure id="chart-reserved-idle">{_reserved_idle(bill)}</figure>',
        f'<figure id="chart-idle">{_idle_share(summary)}</figure>',
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"
