"""Pod watch cost on a full node: CPU of watch handling and RSS growth with 110 pods.

The API server stand-in (tests/kube_apiserver.py) runs in a child process, so its work is not
counted; it serves 110 pods of this node, each padded to the size of a real pod's JSON (managed
fields, a last-applied-configuration annotation: about 8 KB), and relabels them round-robin at
`--rate` updates per second. This process runs the real `PodWatch` (kubernetes_asyncio, the
same code as the collector) against it and measures, side by side in one run:

* CPU (`time.process_time`, every thread of this process) over `--seconds` of watching while
  the server sends `--rate` updates/s, against the same time watching an idle server (bookmarks
  only): the difference is what the updates cost, the total what the watch costs;
* RSS (VmRSS) with the client connected and no pods, and after listing 110 pods and `--seconds`
  of updates: the growth is what 110 pods cost. Importing the client library is shown apart.

    .venv/bin/python bench/bench_podwatch.py [--pods 110] [--rate 10] [--seconds 30] [--batch 0.5]

Goals: watch handling at 10 updates/s <= 0.2 % of one core; RSS growth with 110 pods <= 10 MiB.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import logging
import multiprocessing as mp
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

CPU_GOAL_PERCENT = 0.2
RSS_GOAL_MIB = 10.0
NODE = "bench-node"


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def serve(pods: int, conn: Any) -> None:
    """Child process: the stand-in with `pods` pods; then relabel at the rate it is sent."""
    from kube_apiserver import ApiServer

    # A client that goes away mid-stream is normal here; aiohttp would log each as an error.
    logging.getLogger("aiohttp").setLevel(logging.CRITICAL)
    srv = ApiServer(node=NODE, bookmark_every_s=5.0).start()
    srv.add_namespace("ml", {"cost-center": "cc-17"})
    padding = json.dumps({"spec": {"template": {"metadata": {"labels": {"x": "y" * 3000}}}}})
    uids = []
    for i in range(pods):
        kw = {
            "labels": {"team": f"t{i % 7}", "app.kubernetes.io/name": f"svc-{i}"},
            "annotations": {"kubectl.kubernetes.io/last-applied-configuration": padding},
        }
        if i % 3 == 0:
            pod = srv.add_deployment_pod("ml", f"dep-{i}", ["main", "sidecar"], **kw)
        elif i % 3 == 1:
            pod = srv.add_owned_pod("ml", "StatefulSet", f"sts-{i}", f"sts-{i}-0", ["main"], **kw)
        else:
            pod = srv.add_cronjob_pod("ml", f"cron-{i}", ["main"], **kw)
        uids.append(pod["metadata"]["uid"])
    size = len(json.dumps(srv.pods[uids[0]]))
    conn.send((srv.kubeconfig(Path(tempfile.mkdtemp()) / "kubeconfig"), size))
    i = 0
    while True:
        rate = conn.recv()  # updates per second for the next phase, None to stop
        if rate is None:
            break
        seconds = conn.recv()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if rate:
                srv.relabel(uids[i % len(uids)], generation=str(i))
                i += 1
                time.sleep(1 / rate)
            else:
                time.sleep(0.05)
        conn.send(i)
    srv.close()


async def measure(args: argparse.Namespace) -> None:
    rss_start = rss_mib()
    from collector.node.podwatch import KubeSettings, PodWatch, open_api

    rss_imported = rss_mib()
    parent, child = mp.Pipe()
    server = mp.Process(target=serve, args=(args.pods, child), daemon=True)
    server.start()
    kubeconfig, pod_bytes = parent.recv()
    settings = KubeSettings(kubeconfig=str(kubeconfig), pod_labels=("team",),
                            namespace_labels=("cost-center",), batch_s=args.batch)  # fmt: skip

    # RSS with the client connected to an empty node: another node name, same server.
    api = await open_api(settings)
    empty = PodWatch(api, "no-such-node", settings)
    task = asyncio.create_task(empty.run())
    await asyncio.wait_for(empty.synced.wait(), 30)
    await asyncio.sleep(1)
    rss_connected = rss_mib()
    task.cancel()

    watch = PodWatch(api, NODE, settings)
    task = asyncio.create_task(watch.run())
    await asyncio.wait_for(watch.synced.wait(), 60)
    assert len(watch.view) == args.pods, len(watch.view)

    async def phase(rate: float) -> tuple[float, int]:
        events = watch.stats.events
        parent.send(rate)
        parent.send(args.seconds)
        cpu = time.process_time()
        await asyncio.to_thread(parent.recv)
        return time.process_time() - cpu, watch.stats.events - events

    idle_cpu, _ = await phase(0)
    profile = cProfile.Profile() if args.profile else None
    if profile is not None:
        profile.enable()
    busy_cpu, handled = await phase(args.rate)
    if profile is not None:
        profile.disable()
        pstats.Stats(profile).sort_stats("cumulative").print_stats(25)
    rss_after = rss_mib()
    parent.send(None)
    task.cancel()
    await api.close()
    server.join(10)

    idle_pct = 100 * idle_cpu / args.seconds
    busy_pct = 100 * busy_cpu / args.seconds
    per_event_us = 1e6 * (busy_cpu - idle_cpu) / max(handled, 1)
    growth = rss_after - rss_connected
    print(f"pods: {args.pods} (pod JSON {pod_bytes} B), updates: {args.rate}/s for {args.seconds} s"
          f" -> {handled} events handled; stream read every {args.batch} s")  # fmt: skip
    print(f"CPU idle watch (bookmarks only): {idle_pct:.3f} % of a core")
    print(f"CPU watch at {args.rate} updates/s: {busy_pct:.3f} % of a core "
          f"({per_event_us:.0f} us per event above idle)   goal <= {CPU_GOAL_PERCENT} %: "
          f"{'met' if busy_pct <= CPU_GOAL_PERCENT else 'NOT met'}")  # fmt: skip
    print(f"RSS: start {rss_start:.1f} MiB, after importing the client {rss_imported:.1f} MiB, "
          f"connected with 0 pods {rss_connected:.1f} MiB, with {args.pods} pods after the "
          f"updates {rss_after:.1f} MiB")  # fmt: skip
    print(f"RSS growth with {args.pods} pods: {growth:.1f} MiB   goal <= {RSS_GOAL_MIB} MiB: "
          f"{'met' if growth <= RSS_GOAL_MIB else 'NOT met'}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pods", type=int, default=110)
    p.add_argument("--rate", type=float, default=10.0)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--profile", action="store_true", help="cProfile the busy phase")
    p.add_argument(
        "--batch", type=float, default=0.5, help="KubeSettings.batch_s (0: read as data comes)"
    )
    asyncio.run(measure(p.parse_args()))


if __name__ == "__main__":
    main()
