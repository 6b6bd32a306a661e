"""The progress's per-node bookkeeping (active nodes, the heap of times they turn idle, the
smallest newest event of the active nodes, the idle nodes' last events, the node of the largest
offset) against its definition over every node seen, after every step of random input: many
nodes that come and go, skewed clocks, rewound offsets, events without one, idle calls."""

from __future__ import annotations

import random

import pytest

from collector.aggregate.windows.progress import Progress
from collector.aggregate.windows.settings import NEVER


def check(p: Progress, idle: int) -> None:
    for s in p._src.values():
        active = {k: n for k, n in s.nodes.items() if n.active}
        assert s.active == active
        low = min((n.top for n in active.values()), default=NEVER)
        assert s.low is None or s.low == low
        assert sorted(name for _, name in s.due) == sorted(active)
        for at, name in s.due:
            assert at <= s.nodes[name].rec + idle
        if s.due:  # exact when it was made: never after the time it stands for
            assert s.next_idle <= min(n.rec + idle for n in active.values())
        idle_lasts = [n.last for n in s.nodes.values() if not n.active]
        for last in range(-1, max([0, *idle_lasts]) + 2):
            assert s.idle_after(last) == any(x > last for x in idle_lasts)
        if s.latest is not None and s.latest.last == s.latest_at:
            assert s.latest_at == max(n.last for n in s.nodes.values())


@pytest.mark.parametrize("seed", range(40))
def test_the_bookkeeping_is_its_definition(seed: int) -> None:
    r = random.Random(seed)
    skew, idle, extra, late = r.choice([(300, 600, 900, 10), (5000, 3000, 4000, 1000)])
    p = Progress(skew, idle, extra, late)
    nodes = [f"n{i}" for i in range(r.randint(1, 30))]
    clock = {n: r.randint(-skew, skew) for n in nodes}
    offsets = {0: 0, 1: 0}
    node_at: dict[tuple[int, int], str] = {}  # a record's node is its own when read again
    t = 1_000_000
    for _ in range(300):
        if r.random() < 0.85:
            src = r.choice([0, 0, 1])
            t += r.choice([0, 1, 10, 100, idle // 3, idle, 2 * idle])
            if r.random() < 0.05:
                offsets[src] = max(0, offsets[src] - r.randint(1, 20))
            off = offsets[src] if r.random() > 0.05 else -1
            offsets[src] += 1
            node = r.choice(nodes)
            if off >= 0:
                node = node_at.setdefault((src, off), node)
            ts = t + clock[node] + r.randint(-50, 50)
            rec = None if r.random() < 0.1 else t
            p.offset(src, max(off, 0))
            if not p.too_far_ahead(node, ts, rec):
                p.event(src, node, ts, rec, off)
        else:
            t += r.choice([1, idle // 2, idle, 3 * idle])
            p.idle(t)
        check(p, idle)
        p.watermark_top()
        check(p, idle)
