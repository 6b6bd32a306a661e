"""The identity processor in the scan: `PodIdentity` events when a pod's identity becomes known or
changes, restated in heartbeats, kept after the pod is deleted while its container is tracked;
`allocation_mismatch` once while HAMi's annotation and the cache file disagree.

Real cache files (the simulator's writer) and the real Scanner; the pod watch's view is given
as the plain mapping the watch publishes.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from collector.events import Heartbeat, Identity, LayoutAnomaly, PodIdentity, decode, encode
from collector.layout.declarations import V12
from collector.node.allocation import AllocatedDevice
from collector.node.identity import DETAIL_MAX, IdentityStage
from collector.node.pods import PodView
from collector.node.scan import Scanner
from collector.simulate import GiB, SimDevice, new_cache_file, pod_dir

POD_A = "0b8e6a43-2f7e-4a6c-9d1e-6f5e1c0a9b11"
POD_B = "7c1d2e3f-4a5b-4c6d-8e9f-0a1b2c3d4e5f"


def ident(uid: str, ns: str, name: str, **labels: str) -> Identity:
    return Identity(uid, ns, name, "Deployment", "trainer", dict(sorted(labels.items())))


def view_of(identity: Identity, alloc: list[list[AllocatedDevice]] | None = None,
            containers: tuple[str, ...] = ("main",), deleted: bool = False,
            error: str | None = None) -> PodView:  # fmt: skip
    return PodView(identity, containers, alloc, error, deleted)


def test_identity_events_heartbeats_deletion_and_allocation(tmp_path: Path) -> None:
    root = tmp_path / "root"
    writers = [
        new_cache_file(root, POD_A, "main", V12, [SimDevice("GPU-a", 4 * GiB, 30)]),
        new_cache_file(root, POD_B, "main", V12, [SimDevice("GPU-b", 2 * GiB, 100)]),
    ]
    view: dict[str, PodView] = {}
    scanner = Scanner(root, heartbeat_s=10, inc=1, identity=IdentityStage(lambda: view))
    stage = scanner.identity
    assert stage is not None

    events = scanner.scan(now_ms=1_000)  # nothing known yet: billed, counted as unnamed
    assert not [e for e in events if isinstance(e, PodIdentity)]
    hb = [e for e in events if isinstance(e, Heartbeat)]
    assert hb[0].pods == [] and stage.unnamed == 2

    a = ident(POD_A, "ml", "trainer-5d8f7c9b4-x7k2p", team="vision")
    good = [[AllocatedDevice("GPU-a", "NVIDIA", 4096, 30)]]
    view = {POD_A: view_of(a, good)}
    events = scanner.scan(now_ms=2_000)
    assert [e.identity for e in events if isinstance(e, PodIdentity)] == [a]
    assert not [e for e in events if isinstance(e, LayoutAnomaly)]
    assert stage.unnamed == 1
    assert scanner.scan(now_ms=3_000) == []  # unchanged: not sent again

    relabelled = ident(POD_A, "ml", "trainer-5d8f7c9b4-x7k2p", team="speech")
    view = {POD_A: view_of(relabelled, good)}
    (event,) = scanner.scan(now_ms=4_000)
    assert isinstance(event, PodIdentity) and event.identity == relabelled and event.ts == 4_000

    # The annotation says 8000 MiB, the file 4 GiB: reported once while it persists.
    view = {POD_A: view_of(relabelled, [[AllocatedDevice("GPU-a", "NVIDIA", 8000, 30)]])}
    (anomaly,) = scanner.scan(now_ms=5_000)
    assert isinstance(anomaly, LayoutAnomaly) and anomaly.anomaly == "allocation_mismatch"
    assert anomaly.detail == (
        "container main (index 0): GPU-a memory limit 4294967296 B, allocated 8000 MiB"
    )
    assert anomaly.path == str(writers[0].path)
    assert scanner.scan(now_ms=6_000) == []
    view = {POD_A: view_of(relabelled, None, error="container 0: empty device UUID")}
    (anomaly,) = scanner.scan(now_ms=7_000)
    assert isinstance(anomaly, LayoutAnomaly)
    assert anomaly.detail == (
        "hami.io/vgpu-devices-allocated does not parse: container 0: empty device UUID"
    )

    # Deleted and then forgotten by the watch while the container runs: the identity stays.
    view = {POD_A: view_of(relabelled, good, deleted=True)}
    assert scanner.scan(now_ms=8_000) == []
    view = {}
    events = scanner.scan(now_ms=12_000)  # a heartbeat is due
    (hb0,) = [e for e in events if isinstance(e, Heartbeat)]
    assert hb0.pods == [relabelled]
    assert stage.unnamed == 1  # POD_B only

    # The container goes: its pod's identity is forgotten with it.
    shutil.rmtree(pod_dir(root, POD_A, "main"))
    scanner.scan(now_ms=13_000)
    assert stage.sent == {}
    for w in writers:
        w.close()


def test_presence_by_processes_keeps_and_restates_the_identity_between_processes(
    tmp_path: Path,
) -> None:
    """`presence = processes`: the container is absent while it has no process, and its file
    still tracked. Its pod's identity was forgotten with the last process, so once the watch
    had forgotten the (deleted) pod, the next process was billed with no namespace."""
    root = tmp_path / "root"
    writer = new_cache_file(root, POD_A, "main", V12, [SimDevice("GPU-a", 4 * GiB, 30)])
    a = ident(POD_A, "ml", "trainer-5d8f7c9b4-x7k2p", team="vision")
    view: dict[str, PodView] = {POD_A: view_of(a)}
    stage = IdentityStage(lambda: view)
    scanner = Scanner(root, heartbeat_s=10, inc=1, identity=stage, presence_policy="processes")
    writer.add_process(101)
    events = scanner.scan(now_ms=1_000)
    assert [e.identity for e in events if isinstance(e, PodIdentity)] == [a]

    writer.exit(101)  # absent: no process left
    events = scanner.scan(now_ms=2_000)
    assert [type(e).__name__ for e in events] == ["ProcessExited", "ContainerGone"]
    view = {}  # the pod deleted, and forgotten by the watch
    assert scanner.scan(now_ms=3_000) == []
    assert stage.sent == {POD_A: a}

    writer.add_process(102)  # present again: announced, and named, as before
    events = scanner.scan(now_ms=4_000)
    assert [type(e).__name__ for e in events][:2] == ["ContainerAppeared", "ProcessStarted"]
    assert [e.identity for e in events if isinstance(e, PodIdentity)] == [a]
    assert stage.unnamed == 0
    (hb,) = [e for e in scanner.scan(now_ms=12_000) if isinstance(e, Heartbeat)]
    assert hb.pods == [a]

    shutil.rmtree(pod_dir(root, POD_A, "main"))  # no longer tracked: forgotten
    scanner.scan(now_ms=13_000)
    assert stage.sent == {}
    writer.close()


def test_an_allocation_mismatch_of_a_whole_annotation_is_cut_to_a_decodable_detail(
    tmp_path: Path,
) -> None:
    """An annotation of 1 000 allocated devices (57 000 characters, within the 64 KiB the
    parser takes) gave a detail of 79 067 characters, one problem each: more than an event's
    detail may hold, so the anomaly was undecodable and its seq a gap."""
    root = tmp_path / "root"
    new_cache_file(root, POD_A, "main", V12, [SimDevice("GPU-a", 4 * GiB, 30)])
    uuids = [f"GPU-{i:06d}-{'f' * 30}" for i in range(1000)]
    allocated = [AllocatedDevice(uuid, "NVIDIA", 4096, 30) for uuid in uuids]
    view = {POD_A: view_of(ident(POD_A, "ml", "p"), [allocated])}
    scanner = Scanner(root, heartbeat_s=10, inc=1, identity=IdentityStage(lambda: view))
    (anomaly,) = [e for e in scanner.scan(now_ms=1_000) if isinstance(e, LayoutAnomaly)]
    assert decode(encode(anomaly)) == anomaly
    first = f"container main (index 0): GPU-000000-{'f' * 30} allocated but not in the cache file"
    assert anomaly.detail.startswith(first + "; ")
    assert len(anomaly.detail) == DETAIL_MAX + len("... (77067 more characters)")
    assert anomaly.detail.endswith("... (77067 more characters)")
