"""Presence from Kubernetes' own timestamps, end to end: `hami-usage collect` (a subprocess, the
real kubernetes_asyncio client) against the API server stand-in over real cache files, then
`aggregate --drain` and `replay`.

Second by second (whole seconds, as Kubernetes records them):

* +2: the `side` pod's init container ends (its folder stays) and its main container starts; its
  native sidecar `proxy` (an init container with `restartPolicy: Always`) runs throughout;
* +3: the `svc` container ends; +4 it runs again (a restart the watch sees); between +5 and +6 it
  restarts again between two reads of the watch (only `lastState` tells it ended at +5);
  +8 it ends for good;
* +7: the `lost` pod (a folder, no process: a lost node's pod) and the `kept` pod (its process
  still runs) are deleted without a terminated status;
* +8: the Job's container ends (the pod `Succeeded`) while its folder stays.

Checked, in exact byte-milliseconds: each container's memory limit and allocation are billed
from the scan that tracks its file to Kubernetes' `finishedAt` (the Job: nothing after +8),
`svc` for its three runs only, `lost` until the DELETED event's time, `kept` to the end, each of
the `side` pod's containers under its own name; and `replay` gives the live CSV's bytes.
"""

from __future__ import annotations

import csv
import io
import json
import subprocess
import time
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

from kube_apiserver import ApiServer, make_pod, stop_collector
from streams import HAMI_USAGE, env, final_report, hami, read_csv

from collector.aggregate.records import iso_utc
from collector.events import ContainerAppeared, ContainerRun, Event, decode
from collector.layout.declarations import V12
from collector.simulate import GiB, SimDevice, new_cache_file
from collector.transport.locallog import LogReader

NODE = "node-a"
WINDOW = ["--window", "1", "--lateness", "3", "--max-gap", "3"]
LIMIT = GiB


def iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def until_ms(ms: int) -> None:
    time.sleep(max(0.0, ms / 1000 - time.time()))


def tracked(log: Path, pod_uid: str, times: int) -> int:
    """The wall-clock ms at which the collector's log held `times` appearances of the pod's
    main container (polled every 50 ms, for at most 30 s)."""
    deadline = time.monotonic() + 30
    while True:
        events = [decode(r.value) for r in LogReader(log).read(0, 1_000_000)]
        seen = [e for e in events if isinstance(e, ContainerAppeared) and e.pod_uid == pod_uid]
        if len(seen) >= times:
            return round(time.time() * 1000)
        assert time.monotonic() < deadline, f"{len(seen)} appearances of {pod_uid}"
        time.sleep(0.05)


def status(srv: ApiServer, uid: str, name: str, state: dict[str, Any], *, restarts: int = 0,
           last: dict[str, Any] | None = None, phase: str | None = None, init: bool = False
           ) -> None:  # fmt: skip
    """Write a container's status as the kubelet does (the pod's phase too, when given)."""
    with srv.lock:
        pod = json.loads(json.dumps(srv.pods[uid]))
    statuses = pod["status"]["initContainerStatuses" if init else "containerStatuses"]
    (st,) = [s for s in statuses if s["name"] == name]
    st["state"] = state
    st["restartCount"] = restarts
    st["lastState"] = last or {}
    if phase is not None:
        pod["status"]["phase"] = phase
    srv.put_pod(pod)


def ended(started: int, finished: int) -> dict[str, Any]:
    return {"terminated": {"exitCode": 0, "reason": "Completed", "startedAt": iso(started),
                           "finishedAt": iso(finished)}}  # fmt: skip


def running(started: int) -> dict[str, Any]:
    return {"running": {"startedAt": iso(started)}}


def test_presence_follows_kubernetes_timestamps_end_to_end(tmp_path: Path) -> None:
    root, log = tmp_path / "root", tmp_path / "log"
    root.mkdir()
    srv = ApiServer(node=NODE, bookmark_every_s=0.5).start()
    srv.add_namespace("ml")
    pods = {
        "job": srv.add_cronjob_pod("ml", "nightly-eval", ["main"]),
        "svc": srv.add_deployment_pod("ml", "svc", ["main"]),
        "lost": srv.put_pod(make_pod("ml", "lost", NODE, ["main"])),
        "kept": srv.put_pod(make_pod("ml", "kept", NODE, ["main"])),
        "side": srv.put_pod(make_pod("ml", "side", NODE, ["main"], init_containers=("init",),
                                     sidecars=("proxy",))),  # fmt: skip
    }
    uid = {k: p["metadata"]["uid"] for k, p in pods.items()}
    # The side pod is initialising: its init container and its sidecar run, main waits.
    status(srv, uid["side"], "init", running(0), init=True)
    status(srv, uid["side"], "main", {"waiting": {"reason": "PodInitializing"}}, phase="Pending")
    writers = []

    def start(key: str, container: str, uuid: str, sm: int = 100, process: bool = True) -> None:
        w = new_cache_file(root, uid[key], container, V12, [SimDevice(uuid, LIMIT, sm)])
        if process:
            w.add_process(100, 4100)
            w.add_memory(100, 0, "context", 64 << 20)
        writers.append(w)

    start("job", "main", "GPU-a")
    start("svc", "main", "GPU-b")
    start("lost", "main", "GPU-c", process=False)
    start("kept", "main", "GPU-d")
    start("side", "init", "GPU-s", 30)
    start("side", "proxy", "GPU-s", 30)
    proc = subprocess.Popen(
        [str(HAMI_USAGE), "collect", "--root", str(root), "--log", str(log), "--node", NODE,
         "--kubeconfig", str(srv.kubeconfig(tmp_path / "kubeconfig")), "--interval", "0.2",
         "--heartbeat", "1", "--no-nvml"],
        env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not srv.watch_requests():  # the collector has listed the pods and watches
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        time.sleep(1)
        b0 = (int(time.time()) + 1) * 1000  # a whole second: Kubernetes' resolution
        s = {n: b0 + n * 1000 for n in range(10)}
        until_ms(s[2])
        status(srv, uid["side"], "init", ended(s[0], s[2]), init=True)
        status(srv, uid["side"], "main", running(s[2]), phase="Running")
        start("side", "main", "GPU-s", 30)
        until_ms(s[3])
        status(srv, uid["svc"], "main", ended(s[0], s[3]))
        until_ms(s[4])
        status(srv, uid["svc"], "main", running(s[4]), restarts=1, last=ended(s[0], s[3]))
        # The rest starts on the next whole second after the collector tracked svc again (the
        # watch's read batch and a scan, longer than a second on a loaded machine).
        seen = tracked(log, uid["svc"], 2)
        s.update({n: (seen // 1000 + 1 + n - 5) * 1000 for n in range(5, 10)})
        until_ms(s[6])  # ended at +5 and ran again at +6: the watch saw neither
        status(srv, uid["svc"], "main", running(s[6]), restarts=2, last=ended(s[4], s[5]))
        until_ms(s[7])
        deleted_ms = round(time.time() * 1000)
        srv.delete_pod(uid["lost"])
        srv.delete_pod(uid["kept"])
        until_ms(s[8])
        status(srv, uid["job"], "main", ended(s[0], s[8]), phase="Succeeded")
        status(srv, uid["svc"], "main", ended(s[6], s[8]), restarts=2, last=ended(s[4], s[5]))
        until_ms(s[9] + 1500)
    finally:
        rc, stderr = stop_collector(proc, srv, writers)
    assert rc == 0, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]

    events: list[Event] = [decode(r.value) for r in LogReader(log).read(0, 1_000_000)]
    appeared: dict[tuple[str, str], list[int]] = {}
    for e in events:
        if isinstance(e, ContainerAppeared):
            appeared.setdefault((e.pod_uid, e.container), []).append(e.ts)
    (deleted,) = [e for e in events if isinstance(e, ContainerRun) and e.reason == "deleted"]
    # The lost pod's run ended when the watch saw the DELETED event (its read batch: 0.5 s,
    # later on a loaded machine); not as late as the collector's stop, which came at least
    # s[9] + 1.5 s - s[7] = 3.5 s after the deletion.
    assert 0 <= deleted.at - deleted_ms < 3500, deleted.at - deleted_ms
    missed = [e.at for e in events if isinstance(e, ContainerRun) and e.reason == "restart_missed"]
    assert missed == [s[5]]

    live = tmp_path / "live.csv"
    agg = hami("aggregate", "--log", log, *WINDOW, "--csv", live, "--drain")
    assert agg.returncode == 0, agg.stderr[-3000:]
    _, counters = final_report(agg.stderr)
    assert counters.get("presence_clamped", 0) == 0  # every end reached the aggregator in time
    rows = [r for r in csv.DictReader(io.StringIO(live.read_text())) if r["kind"] == "container"]

    def billed(key: str, container: str = "main", field: str = "memory_limit_byte_seconds",
               after: int = 0) -> Decimal:  # fmt: skip
        return sum(
            (Decimal(r[field]) for r in rows if r["pod_uid"] == uid[key]
             and r["container"] == container and _ms(r["window_start"]) >= after),
            Decimal(0),
        )  # fmt: skip

    def first(key: str, container: str = "main") -> int:
        return appeared[(uid[key], container)][0]

    ms = Decimal("0.001")
    # The Job: from its first scan to finishedAt (+8), limit and allocation; nothing after.
    assert billed("job") == LIMIT * (s[8] - first("job")) * ms
    assert billed("job", field="allocated_gpu_seconds") == (s[8] - first("job")) * ms
    assert billed("job", after=s[8]) == 0
    assert billed("job", field="allocated_gpu_seconds", after=s[8]) == 0
    # svc: three runs, [tracked, +3), [tracked again, +5), [+6, +8).
    a0, a1 = appeared[(uid["svc"], "main")]
    assert s[3] < a1 < s[5]
    runs_ms = (s[3] - a0) + (s[5] - a1) + (s[8] - s[6])
    assert billed("svc") == LIMIT * runs_ms * ms
    assert billed("svc", field="allocated_gpu_seconds") == runs_ms * ms
    # Deleted without a terminated status: lost (no process) until then, kept (a live process)
    # on to the end, as long as the init container's file (tracked to the end) is.
    assert billed("lost") == LIMIT * (deleted.at - first("lost")) * ms
    assert billed("kept", after=s[8]) == billed("side", "proxy", after=s[8]) > 0
    # Init container and native sidecar: each under its own name, never merged.
    assert billed("side", "init") == LIMIT * (s[2] - first("side", "init")) * ms
    assert billed("side", "proxy") > billed("side", "main") > 0
    side_names = {r["container"] for r in rows if r["pod_uid"] == uid["side"]}
    assert side_names == {"init", "proxy", "main"}
    assert {r["pod"] for r in rows if r["pod_uid"] == uid["side"]} == {"side"}

    starts = sorted({r["window_start"] for r in rows})
    replayed = tmp_path / "replay.csv"
    rep = hami("replay", "--log", log, *WINDOW, "--csv", replayed, "--from", starts[0],
               "--to", iso_utc(_ms(starts[-1]) + 1000))  # fmt: skip
    assert rep.returncode == 0, rep.stderr[-3000:]
    assert read_csv(replayed) == read_csv(live)


def _ms(text: str) -> int:
    return round(datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1000)
