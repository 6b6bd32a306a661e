"""The `presence` policy without Kubernetes: a container's limits are billed while its folder
exists (`folder`) or while its file has a live process (`processes`, host_proc deciding
liveness where set), checked against the exact integral of each policy on a schedule where
processes exit and the folder stays; and, for random lifecycles, billed presence never exceeds
running time.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lifecycle import SETTINGS, Lab, billed, nonzero, wave
from streams import msg, reference

from collector.events import ContainerAppeared, ContainerGone
from collector.node.diff import Presence
from collector.simulate import GiB

SECONDS = 240


def schedule(lab: Lab, s: int) -> None:
    """`a`: two processes; one exits at 30, the other at 60; the folder stays; a new process at
    120, SIGKILLed at 170 (its slot stays). `b`: a file with no process until 20, one from 20
    to 100; its folder stays too. Both folders stay to the end."""
    if s == 0:
        a = lab.container("a")
        lab.spawn(a, 1, 4001)
        lab.spawn(a, 2, 4002)
        lab.container("b")
    a, b = lab.ctrs["a"], lab.ctrs["b"]
    if s == 30:
        a.w.exit(1)
    if s == 60:
        a.w.exit(2)
        a.w.compact()
    if s == 120:
        lab.spawn(a, 3, 4003)
    if s == 170:
        lab.kill(a, 3)
    if s == 20:
        lab.spawn(b, 1, 5001)
    if s == 100:
        b.w.exit(1)
    for c in (a, b):
        for pid, _ in c.live():
            lab.set_data(c, pid, 0, wave(s, pid))


@pytest.mark.parametrize("presence", ["folder", "processes"])
def test_each_policy_bills_its_exact_integral(tmp_path: Path, presence: Presence) -> None:
    lab = Lab(tmp_path, f"presence-{presence}", host_proc=True, presence=presence)
    lab.run(SECONDS, schedule)
    records = reference([msg(lab.name, e) for e in lab.events], SETTINGS)
    assert billed(records, lab.name) == nonzero(lab.truth)
    limits = billed(records, lab.name, "memory_limit_byte_seconds")
    assert limits == nonzero(lab.limit_truth)
    # Seconds present, per container (device 0's limit is 4 GiB).
    present: dict[str, int] = {}
    for (_, name, uuid, _), v in limits.items():
        if uuid.startswith("GPU-00000000"):
            present[name] = present.get(name, 0) + v // (4 * GiB)
    if presence == "folder":
        assert present == {"a": SECONDS * 1000, "b": SECONDS * 1000}
    else:
        assert present == {"a": (60 + 50) * 1000, "b": 80 * 1000}
        a_events = [
            (type(e).__name__, e.ts - lab.events[0].ts)
            for e in lab.events
            if isinstance(e, ContainerAppeared | ContainerGone) and e.cid == 0
        ]
        assert a_events == [
            ("ContainerAppeared", 0),
            ("ContainerGone", 60_000),
            ("ContainerAppeared", 120_000),
            ("ContainerGone", 170_000),
        ]


Action = tuple[int, str]  # (second, "start" | "exit" | "kill")


@settings(max_examples=12, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 89), st.sampled_from(["start", "exit", "kill"])), max_size=12
    ),
    st.booleans(),
)
def test_billed_presence_never_exceeds_running_time(actions: list[Action], host_proc: bool) -> None:
    """Random lifecycles of one container: processes start, exit and are SIGKILLed at random
    seconds (SIGKILLs only with host_proc). Billed presence (limit-seconds / limit) is never
    more than the seconds in which a process was really running; it is exactly that."""
    plan: dict[int, list[str]] = {}
    for s, what in actions:
        plan.setdefault(s, []).append(what)
    running: list[int] = []
    pids = iter(range(100, 10_000))

    def script(lab: Lab, s: int) -> None:
        if s == 0:
            lab.container("main", devices=1)
        c = lab.ctrs["main"]
        for what in plan.get(s, []):
            alive = [pid for pid, _ in c.live()]
            if what == "start":
                pid = next(pids)
                lab.spawn(c, pid, 40_000 + pid)
            elif alive and what == "exit":
                c.w.exit(alive[0])
            elif alive and what == "kill" and host_proc:
                # Without host_proc a SIGKILLed slot looks live until a later process compacts
                # it: the collector cannot tell, and neither can this property.
                lab.kill(c, alive[-1])
        running.append(1 if c.live() else 0)
        for pid, _ in c.live():
            lab.set_data(c, pid, 0, wave(s, pid))

    with tempfile.TemporaryDirectory() as tmp:
        lab = Lab(Path(tmp), "prop", host_proc=host_proc, presence="processes")
        lab.run(90, script)
    records = reference([msg(lab.name, e) for e in lab.events], SETTINGS)
    limit = 4 * GiB
    present_ms = sum(billed(records, lab.name, "memory_limit_byte_seconds").values()) // limit
    running_ms = sum(running) * 1000
    assert present_ms <= running_ms
    assert present_ms == running_ms  # and exactly that
