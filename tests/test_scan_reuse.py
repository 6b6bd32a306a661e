"""What the collector reuses between scans (ParseMemo's objects, the diff it skips for a file
whose snapshot is made of the same objects) never changes an event: the same simulated node
scanned by a Scanner that reuses and one that parses and diffs everything gives the same
events, scan after scan, on a busy node (every process allocating, exiting, killed, compacted)
and on a quiet one (most files unchanged between scans)."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest

from collector.events import ContainerAppeared, Event, Heartbeat
from collector.node.scan import Scanner
from collector.simulate import NodeSimulator


def timeless(e: Event) -> Event:
    """The heartbeat carries the scan's own duration: not part of the comparison."""
    return msgspec.structs.replace(e, scan_ms=0.0) if isinstance(e, Heartbeat) else e


@pytest.mark.parametrize("busy", [True, False])
def test_reuse_gives_the_same_events(tmp_path: Path, busy: bool) -> None:
    sim = NodeSimulator(tmp_path, 20, "mixed", seed=7, procs_per_container=3)
    sim.step(time.time())
    reusing = Scanner(tmp_path, heartbeat_s=5, inc=1)
    fresh = Scanner(tmp_path, heartbeat_s=5, inc=1, reuse=False)
    now = 1_700_000_000_000
    skipped = 0
    # One file is unusable from scan 10 to 19: scan 20 announces its container again.
    spelled = sim.containers[3].writer
    path, major = str(spelled.path), spelled.region.major_version
    for n in range(40):
        if busy or n % 5 == 0:
            sim.step(time.time())
        elif n % 5 == 1:
            sim.containers[n % 20].writer.kernel_launched(time.time())  # the tail only
        if n in (10, 20):
            spelled.region.major_version = 9 if n == 10 else major
        now += 1000
        a = [timeless(e) for e in reusing.scan(now_ms=now)]
        b = [timeless(e) for e in fresh.scan(now_ms=now)]
        assert a == b, n
        if n == 20:
            assert path in [e.path for e in a if isinstance(e, ContainerAppeared)]
        assert reusing.published == fresh.published
        skipped += reusing.stats.settled
        assert fresh.stats.settled == 0
    assert skipped > (0 if busy else 20 * 20)  # the quiet node did skip most diffs
    sim.close()
