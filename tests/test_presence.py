"""A folder that outlives its container is not billed (collector/node/presence.py): the real
Scanner over real cache files with the pod watch's view, and the Aggregator over what it sends.

A Job's container terminates at +8 s while its folder stays; it restarts twice (new runs of the
same container, the same folder), terminating at +20 s and +32 s. Its limit is billed exactly
while it runs, as seen by the scans (1 s apart), `stale_container` is reported once per
termination, and a pod deleted while its container runs is still billed. Then the same through
the collector subprocess, the real client and the API server stand-in, with replay's bytes.
"""

from __future__ import annotations

import csv
import io
import json
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path

from kube_apiserver import ApiServer, stop_collector
from streams import HAMI_USAGE, env, hami, read_csv

from collector.aggregate.windows import Aggregator, WindowSettings
from collector.events import (
    ContainerAppeared,
    ContainerGone,
    Event,
    Identity,
    LayoutAnomaly,
    decode,
)
from collector.layout.declarations import V12
from collector.node.identity import IdentityStage
from collector.node.pods import PodView
from collector.node.presence import PresenceStage
from collector.node.scan import Scanner
from collector.simulate import GiB, SimDevice, new_cache_file
from collector.transport.locallog import LogReader

JOB = "0b8e6a43-2f7e-4a6c-9d1e-6f5e1c0a9b11"
DEP = "7c1d2e3f-4a5b-4c6d-8e9f-0a1b2c3d4e5f"
T0 = 1_795_991_820_000  # 2026-11-29T22:37:00Z, a whole minute
ISO = {8: "2026-11-29T22:37:08Z", 20: "2026-11-29T22:37:20Z", 32: "2026-11-29T22:37:32Z"}


def view(job: str = "Running", ended: tuple[tuple[str, str], ...] = (), deleted: bool = False
         ) -> dict[str, PodView]:  # fmt: skip
    return {
        JOB: PodView(Identity(JOB, "ml", "eval-29412360-q9w8e", "CronJob", "eval", {}), ("main",),
                     None, None, phase=job, ended=ended),
        DEP: PodView(Identity(DEP, "ml", "trainer-x", "Deployment", "trainer", {}), ("main",),
                     None, None, deleted=deleted),
    }  # fmt: skip


def test_limits_are_billed_only_while_the_container_runs(tmp_path: Path) -> None:
    root = tmp_path / "root"
    writers = [
        new_cache_file(root, JOB, "main", V12, [SimDevice("GPU-a", 4 * GiB, 50)]),
        new_cache_file(root, DEP, "main", V12, [SimDevice("GPU-b", 1 * GiB, 100)]),
    ]
    current = view()
    presence = PresenceStage(lambda: current)
    scanner = Scanner(root, heartbeat_s=10, inc=1, identity=IdentityStage(lambda: current),
                      presence=presence)  # fmt: skip
    timeline = {
        # second -> the view from then on
        9: view("Running", (("main", ISO[8]),)),  # terminated at +8 s, seen at the +9 s scan
        12: view("Running", ()),  # restarted: running again
        21: view("Running", (("main", ISO[20]),)),  # terminated again
        24: view("Running", ()),  # second restart
        33: view("Failed", (("main", ISO[32]),)),  # terminated for good, and the pod failed
        40: view("Failed", (("main", ISO[32]),), deleted=True),  # the trainer's pod is deleted
    }
    events: list[Event] = []
    for second in range(0, 60):
        current = timeline.get(second, current)
        events += scanner.scan(now_ms=T0 + second * 1000)
    for w in writers:
        w.close()

    stale = [e for e in events if isinstance(e, LayoutAnomaly) and e.anomaly == "stale_container"]
    assert [(e.ts - T0, e.value, e.detail) for e in stale] == [
        (9_000, 1, "container main of pod ml/eval-29412360-q9w8e terminated at "
                   "2026-11-29T22:37:08Z, 1 s ago; its folder is still there: not billed"),
        (21_000, 1, "container main of pod ml/eval-29412360-q9w8e terminated at "
                    "2026-11-29T22:37:20Z, 1 s ago; its folder is still there: not billed"),
        (33_000, 1, "container main of pod ml/eval-29412360-q9w8e terminated at "
                    "2026-11-29T22:37:32Z, 1 s ago; its folder is still there: not billed"),
    ]  # fmt: skip
    assert presence.stale == 1
    job_cids = {e.cid: e.ts - T0 for e in events if isinstance(e, ContainerAppeared)
                and e.pod_uid == JOB}  # fmt: skip
    assert sorted(job_cids.values()) == [0, 12_000, 24_000]  # first run, and two restarts
    gone = sorted(e.ts - T0 for e in events if isinstance(e, ContainerGone) and e.cid in job_cids)
    assert gone == [9_000, 21_000, 33_000]

    # Billed: the job's 4 GiB limit for its three runs as the scans saw them, [0, 9), [12, 21)
    # and [24, 33): 27 s; the trainer's whole minute, its pod's deletion at +40 s notwithstanding.
    agg = Aggregator(WindowSettings())
    for i, e in enumerate(events):
        agg.add("n1", e, offset=i)
    records = agg.flush()
    limit = {r.pod_uid: r.memory_limit_byte_seconds for r in records if r.window_start_ms == T0}
    assert limit[JOB] == 4 * GiB * 27
    assert limit[DEP] >= 1 * GiB * 59
    named = {r.pod_uid: r.pod for r in records if r.window_start_ms == T0 and r.pod_uid}
    assert named == {JOB: "eval-29412360-q9w8e", DEP: "trainer-x"}


def test_through_the_pod_watch_a_finished_job_stops_being_billed(tmp_path: Path) -> None:
    """The collector as a subprocess with the real client against the API server stand-in: the
    Job's container terminates (status and phase as the kubelet writes them) while its folder
    stays; its limit stops within a scan of the watch seeing it, and replay gives the same
    bytes."""
    root, log = tmp_path / "root", tmp_path / "log"
    srv = ApiServer(node="node-a", bookmark_every_s=0.5).start()
    srv.add_namespace("ml")
    job = srv.add_cronjob_pod("ml", "nightly-eval", ["main"])
    dep = srv.add_deployment_pod("ml", "trainer", ["main"])
    writers = []
    for pod, uuid in ((job, "GPU-a"), (dep, "GPU-b")):
        w = new_cache_file(root, pod["metadata"]["uid"], "main", V12, [SimDevice(uuid, GiB)])
        w.add_process(100, 4100)
        w.add_memory(100, 0, "context", 100 << 20)
        writers.append(w)
    proc = subprocess.Popen(
        [str(HAMI_USAGE), "collect", "--root", str(root), "--log", str(log), "--node", "node-a",
         "--kubeconfig", str(srv.kubeconfig(tmp_path / "kubeconfig")), "--interval", "0.2",
         "--heartbeat", "1", "--no-nvml"],
        env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not srv.watch_requests():  # the collector has listed the pods and watches
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        time.sleep(2)
        done = json.loads(json.dumps(srv.pods[job["metadata"]["uid"]]))
        finished = datetime.now(UTC)
        done["status"]["phase"] = "Succeeded"
        done["status"]["containerStatuses"][0]["state"] = {
            "terminated": {"exitCode": 0, "reason": "Completed",
                           "finishedAt": finished.strftime("%Y-%m-%dT%H:%M:%SZ")}
        }  # fmt: skip
        srv.put_pod(done)
        time.sleep(4)
    finally:
        rc, stderr = stop_collector(proc, srv, writers)
    assert rc == 0, stderr[-3000:]
    events = [decode(r.value) for r in LogReader(log).read(0, 1_000_000)]
    (stale,) = [
        e for e in events if isinstance(e, LayoutAnomaly) and e.anomaly == "stale_container"
    ]
    assert stale.detail.startswith(f"container main of pod ml/{job['metadata']['name']} terminated")
    # Not billed from the scan that saw it: the watch's read batch (0.5 s) and one interval
    # (0.2 s) after the status was written, plus what a loaded test machine adds.
    seen_ms = stale.ts
    assert seen_ms - finished.timestamp() * 1000 < 5_000

    live = tmp_path / "live.csv"
    window = ["--window", "1", "--lateness", "0.5", "--max-gap", "3"]
    agg = hami("aggregate", "--log", log, *window, "--csv", live, "--drain")
    assert agg.returncode == 0, agg.stderr[-3000:]
    rows = list(csv.DictReader(io.StringIO(live.read_text())))
    job_rows = [r for r in rows if r["pod_uid"] == job["metadata"]["uid"]]
    dep_rows = [r for r in rows if r["pod_uid"] == dep["metadata"]["uid"]]
    last_job = max(r["window_start"] for r in job_rows)
    assert last_job < max(r["window_start"] for r in dep_rows)  # the trainer goes on
    assert datetime.fromisoformat(last_job) <= datetime.fromtimestamp(seen_ms // 1000, UTC)
    assert all(r["namespace"] == "ml" for r in job_rows[-2:]), [
        (r["window_start"], r["namespace"], r["memory_limit_byte_seconds"]) for r in job_rows
    ]

    starts = sorted({r["window_start"] for r in rows})
    replayed = tmp_path / "replay.csv"
    end = datetime.fromisoformat(starts[-1]).timestamp() + 1
    rep = hami("replay", "--log", log, *window, "--csv", replayed, "--from", starts[0],
               "--to", datetime.fromtimestamp(end, UTC).isoformat())  # fmt: skip
    assert rep.returncode == 0, rep.stderr
    assert read_csv(replayed) == read_csv(live)
