"""For random lifecycles of a container under the pod watch, billed presence never exceeds its
running time (beyond what the aggregator counts as clamped), and is exactly that when the watch
sees every second.

A lifecycle: runs of random length with random gaps (none: a restart at once), each run's process
live while it runs; the pod's status as Kubernetes would write it (running with `startedAt`,
`restartCount` and `lastState`; between runs terminated or waiting in back-off; `Succeeded`
after the last), read by the watch only at random seconds (a status it does not read is missed,
restarts included, but never two restarts between two reads, and the last second is read);
maybe deleted, after which no run
starts. The real Scanner over a real cache file (the simulator's writer), one scan a second,
and the Aggregator over what it sends.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from collector.aggregate.windows import Aggregator, WindowSettings
from collector.events import Event, Identity
from collector.layout.declarations import V12
from collector.node.identity import IdentityStage
from collector.node.pods import PodView, Run
from collector.node.presence import PresenceStage
from collector.node.scan import Scanner
from collector.simulate import GiB, SimDevice, new_cache_file

UID = "0b8e6a43-2f7e-4a6c-9d1e-6f5e1c0a9b11"
T0 = 1_795_991_820_000  # 2026-11-29T22:37:00Z, a whole minute
SECONDS = 60
LIMIT = 4 * GiB


def iso(second: int) -> str:
    return f"2026-11-29T22:{37 + second // 60:02d}:{second % 60:02d}Z"


@st.composite
def lifecycles(draw: st.DrawFn) -> tuple[list[tuple[int, int]], set[int], int | None, bool]:
    """(runs [start, end), the seconds the watch reads, the deletion second, back-off)."""
    deleted = draw(st.none() | st.integers(1, SECONDS - 1))
    runs: list[tuple[int, int]] = []
    t = 0
    while t < SECONDS and (deleted is None or t < deleted or not runs):
        end = t + draw(st.integers(1, 15))
        runs.append((t, end))
        t = end + draw(st.integers(0, 8))
    reads = draw(st.sets(st.integers(0, SECONDS - 1)))
    if draw(st.booleans()):
        reads = set(range(SECONDS))
    # Every change reaches the watch in the end (the last second), and at least one read
    # falls in each run, so that no two restarts fall between two reads.
    reads.add(SECONDS - 1)
    for a, b in runs:
        if a < SECONDS:
            reads.add(min(a + draw(st.integers(0, b - a - 1)), SECONDS - 1))
    return runs, reads, deleted, draw(st.booleans())


def status(runs: list[tuple[int, int]], s: int, backoff: bool) -> tuple[Run, str]:
    """The container's status at second `s`, and the pod's phase."""
    done = [i for i, (_, b) in enumerate(runs) if b <= s]
    last = iso(runs[done[-1] - 1][1]) if len(done) > 1 else ""
    for i, (a, b) in enumerate(runs):
        if a <= s < b:
            before = iso(runs[i - 1][1]) if i else ""
            return Run("main", "running", iso(a), "", before, i), "Running"
    j = done[-1]
    phase = "Succeeded" if j == len(runs) - 1 else "Running"
    if backoff and phase == "Running":
        return Run("main", "waiting", "", "", iso(runs[j][1]), j + 1), phase
    return Run("main", "terminated", iso(runs[j][0]), iso(runs[j][1]), last, j), phase


@settings(max_examples=40, deadline=None)
@given(lifecycles())
def test_billed_presence_never_exceeds_running_time(
    life: tuple[list[tuple[int, int]], set[int], int | None, bool],
) -> None:
    runs, reads, deleted, backoff = life
    identity = Identity(UID, "ml", "eval-q9w8e", "Job", "eval", {})
    view: dict[str, PodView] = {}
    clock = [0.0]
    events: list[Event] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        w = new_cache_file(root, UID, "main", V12, [SimDevice("GPU-a", LIMIT, 100)])
        presence = PresenceStage(lambda: view, monotonic=lambda: clock[0])
        scanner = Scanner(root, heartbeat_s=10, inc=1, identity=IdentityStage(lambda: view),
                          presence=presence)  # fmt: skip
        seen_deleted = False
        for s in range(SECONDS):
            clock[0] = float(s)
            for i, (a, b) in enumerate(runs):
                if b == s:
                    w.exit(100 + i)
                    w.compact()  # HAMi-core compacts exited slots away
                if a == s:
                    w.add_process(100 + i, 0)
            if s in reads and not seen_deleted:
                run, phase = status(runs, s, backoff)
                gone = deleted is not None and s >= deleted
                view = {UID: PodView(identity, ("main",), None, None, deleted=gone,
                                     deleted_at=float(s), phase=phase, runs=(run,))}  # fmt: skip
                seen_deleted = gone
            events += scanner.scan(now_ms=T0 + s * 1000)
        w.close()
    agg = Aggregator(WindowSettings(window_ms=SECONDS * 1000, lateness_ms=10_000))
    for i, e in enumerate(events):
        agg.add("n1", e, offset=i)
    records = [r for r in agg.flush() if r.window_start_ms == T0 and r.kind == "container"]
    billed_ms = int(sum(r.memory_limit_byte_seconds for r in records) * 1000 / LIMIT)
    running_ms = 1000 * sum(min(b, SECONDS) - a for a, b in runs if a < SECONDS)
    assert billed_ms <= running_ms + agg.stats.presence_clamped_ms
    if len(reads) == SECONDS:  # the watch reads every second: exact
        assert agg.stats.presence_clamped_ms == 0
        assert billed_ms == running_ms
