"""The collector and aggregator against a real GPU and its real NVML driver, in one run.

Run on a machine with an NVIDIA GPU, CUDA-capable PyTorch and this project's dependencies:

    python3 bench/gpu_node_check.py [--out DIR] [--seconds 14]

No HAMi-core is needed: three CUDA processes take GPU memory (one keeps the SMs busy), and cache
files are written for two of them with the project's writer (`collector/simulate.py`), naming
the real GPU's UUID and the processes' real host pids:

* `a`: the busy process, `used.total` = what NVML says it uses (no drift expected);
* `b`: an idle process, `used.total` = a quarter of what NVML says (`accounting_drift` expected);
* `c`: an idle process with no cache file (`unaccounted_process` expected).

Midway through the collector's run the busy process is killed: its slot keeps `sm_util` 60 on a
GPU that NVML now sees idle (`stale_utilization` expected; no `--host-proc`, so the slot stays).

It then compares our NVML boundary (`collector/node/nvml.py`) with `nvidia-smi`, runs
`bench/nvml_check.py`, runs `hami-usage collect` (real NVML, `/metrics` scraped mid-run) and
`hami-usage aggregate --drain` over its local log, and checks the billing records' GPU rows.
Each check prints PASS or FAIL with the figures; the exit status is the number of FAILs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from collector.events import LayoutAnomaly, decode  # noqa: E402
from collector.layout.declarations import LAYOUTS  # noqa: E402
from collector.node.nvml import NvmlSource  # noqa: E402
from collector.simulate import CacheWriter, SimDevice, pod_dir  # noqa: E402
from collector.transport.locallog.reader import LogReader  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
LIMIT = 8 * GiB
SM_LIMIT = 50

WORKER = r"""
import sys, time, torch
gib, busy, seconds = float(sys.argv[1]), sys.argv[2] == "busy", float(sys.argv[3])
hold = torch.empty(int(gib * (1 << 30)), dtype=torch.uint8, device="cuda")
a = torch.randn(4096, 4096, device="cuda")
torch.cuda.synchronize()
print("ready", flush=True)
end = time.time() + seconds
while time.time() < end:
    if busy:
        for _ in range(20):
            a = a @ a
            a = a / a.norm()
        torch.cuda.synchronize()
    else:
        time.sleep(0.2)
"""

failures = 0


def check(ok: bool, what: str) -> None:
    global failures
    failures += 0 if ok else 1
    print(f"{'PASS' if ok else 'FAIL'} {what}", flush=True)


def smi(query: str, kind: str = "gpu") -> list[list[str]]:
    out = subprocess.run(
        ["nvidia-smi", f"--query-{kind}={query}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]


def start_worker(gib: float, busy: bool, seconds: float) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(gib), "busy" if busy else "idle", str(seconds)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None
    line = p.stdout.readline().strip()
    if line != "ready":
        raise SystemExit(f"gpu_node_check: a CUDA worker did not start (said {line!r})")
    return p


def write_cache(root: Path, pod: str, uuid: str, hostpid: int, used: int, sm: int) -> None:
    folder = pod_dir(root, pod, "main")
    folder.mkdir(parents=True)
    w = CacheWriter(
        folder / "0.cache",
        LAYOUTS["v1.2"],
        [SimDevice(uuid, limit_bytes=LIMIT, sm_limit=SM_LIMIT)],
    )
    w.add_process(pid=1, hostpid=hostpid)
    w.add_memory(1, 0, "data", used)
    w.watch({hostpid: {0: (used, sm)}})
    w.close()


def collector(*args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "collector", *args], capture_output=True, text=True, **kw
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None, help="keep logs and records here")
    p.add_argument("--seconds", type=int, default=20, help="scans of the collector run")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    out = args.out or work
    out.mkdir(parents=True, exist_ok=True)
    root = work / "root"
    root.mkdir()

    gpus = smi("index,uuid,name,memory.total,memory.used,utilization.gpu,driver_version")
    print("nvidia-smi:", gpus, flush=True)
    uuid, name, total_mib = gpus[0][1], gpus[0][2], int(gpus[0][3])

    life = args.seconds + 90.0
    workers = {
        "a": start_worker(3.0, True, life),
        "b": start_worker(2.0, False, life),
        "c": start_worker(1.0, False, life),
    }
    pids = {k: w.pid for k, w in workers.items()}
    print("worker pids:", pids, flush=True)
    try:
        source = NvmlSource.open(timeout_s=5.0)
        check(source is not None, "NVML opens through nvidia-ml-py")
        if source is None:
            return failures
        for _ in range(40):
            reading = source.poll().reading
            procs = {} if reading is None else {q.pid: q for q in reading.processes.get(uuid, [])}
            if set(pids.values()) <= procs.keys():
                break
            time.sleep(0.5)
        assert reading is not None
        dev = reading.devices[0]
        print(f"our NVML reading: {dev}", flush=True)
        print(f"call set took {source.stats.last_poll_ms:.1f} ms", flush=True)
        check(dev.uuid == uuid and dev.name == name, f"uuid and name match nvidia-smi: {name}")
        check(
            dev.memory_total // MiB == total_mib,
            f"memory total {dev.memory_total} B = {dev.memory_total // MiB} MiB, smi {total_mib}",
        )
        apps = {int(r[0]): int(r[1]) for r in smi("pid,used_memory", "compute-apps")}
        print("nvidia-smi compute apps (pid: MiB):", apps, flush=True)
        for k, pid in pids.items():
            got = procs.get(pid)
            mem = None if got is None else got.used_memory
            check(
                mem is not None and mem // MiB == apps.get(pid),
                f"process {k} pid {pid}: NVML {mem} B, smi {apps.get(pid)} MiB",
            )
        source.close()
        used = {k: procs[pid].used_memory or 0 for k, pid in pids.items()}

        write_cache(root, "pod-a", uuid, pids["a"], used["a"], 60)
        write_cache(root, "pod-b", uuid, pids["b"], used["b"] // 4, 0)

        nv = subprocess.run(
            [sys.executable, "bench/nvml_check.py", "--root", str(root), "--host-proc", "/proc"],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        (out / "nvml_check.txt").write_text(nv.stdout + nv.stderr)
        print(nv.stdout + nv.stderr, flush=True)
        check(nv.returncode == 0, f"bench/nvml_check.py exits {nv.returncode}")
        check(
            "accounting_drift" in nv.stdout and "unaccounted_process" in nv.stdout,
            "nvml_check reports accounting_drift (b) and unaccounted_process (c)",
        )

        log = work / "log"
        port = 19400
        col = subprocess.Popen(
            [sys.executable, "-m", "collector", "collect", "--root", str(root), "--log", str(log)]
            + ["--node", "gpu-check", "--interval", "1", "--max-scans", str(args.seconds)]
            + ["--heartbeat", "2", "--metrics-port", str(port), "--no-kubernetes"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
        )
        time.sleep(args.seconds * 0.4)
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        (out / "metrics.txt").write_bytes(metrics)
        # The busy process ends; its slot keeps sm_util 60 on a GPU NVML now sees idle.
        workers["a"].kill()
        workers["a"].wait()
        col_out, _ = col.communicate(timeout=120)
        (out / "collect.txt").write_text(col_out)
        print("collect exit", col.returncode, "\n", col_out[-3000:], flush=True)
        check(col.returncode == 0, f"collect exits {col.returncode}")
        text = metrics.decode()
        lines = [ln for ln in text.splitlines() if not ln.startswith("#")]
        for ln in lines:
            if ln.startswith(("hami_usage_gpu_", "hami_usage_anomalies", "HostGPU", "vGPU")):
                print("  metric:", ln)
        total_line = [ln for ln in lines if ln.startswith("hami_usage_gpu_memory_total_bytes")]
        check(
            bool(total_line) and float(total_line[0].rsplit(" ", 1)[1]) == dev.memory_total,
            f"/metrics memory total {total_line[:1]}",
        )
        kinds: dict[str, int] = {}
        for rec in LogReader(log).read(0, 100_000):
            ev = decode(rec.value)
            if isinstance(ev, LayoutAnomaly):
                kinds[ev.anomaly] = kinds.get(ev.anomaly, 0) + 1
                print(f"  anomaly {ev.anomaly} cid {ev.cid}: {ev.detail}")
        want = {"accounting_drift", "unaccounted_process", "stale_utilization"}
        check(want <= kinds.keys(), f"collect reported {sorted(kinds)}")

        billing = work / "billing.jsonl"
        agg = collector(
            *("aggregate", "--log", str(log), "--drain", "--jsonl", str(billing)),
            *("--window", "5", "--max-gap", "6"),
            cwd=ROOT,
        )
        print("aggregate exit", agg.returncode, agg.stderr[-2000:], flush=True)
        check(agg.returncode == 0, f"aggregate --drain exits {agg.returncode}")
        records = [json.loads(x) for x in billing.read_text().splitlines()]
        shutil.copy(billing, out / "billing.jsonl")
        gpu_rows = [r for r in records if r["kind"] == "gpu"]
        check(
            bool(gpu_rows) and all(r["gpu_model"] == name for r in gpu_rows),
            f"{len(gpu_rows)} gpu records name the model {name!r}",
        )
        check(
            all(r["gpu_memory_bytes"] == dev.memory_total for r in gpu_rows),
            f"gpu records carry memory {dev.memory_total} B",
        )
        nodes = [r for r in records if r["kind"] == "node"]
        node_nvml = sum(float(r["nvml_memory_byte_seconds"]) for r in nodes)
        ctr = [r for r in records if r["kind"] == "container"]
        for pod in ("pod-a", "pod-b"):
            rows = [r for r in ctr if r["pod_uid"] == pod]
            mem_bs = sum(float(r["memory_byte_seconds"]) for r in rows)
            nvml = sum(float(r["nvml_memory_byte_seconds"]) for r in rows)
            alloc = sum(float(r["allocated_gpu_seconds"]) for r in rows)
            seen = sum(float(r["observed_seconds"]) for r in rows)
            print(
                f"  {pod}: memory {mem_bs / GiB:.3f} GiB·s, NVML {nvml / GiB:.3f} GiB·s, "
                f"allocated {alloc:.3f} of {seen:.3f} s observed"
            )
            check(abs(alloc - seen * SM_LIMIT / 100) < 1e-3, f"{pod}: allocation = 50 % cores")
        print(f"  node rows: NVML memory {node_nvml / GiB:.3f} GiB·s", flush=True)
        check(node_nvml > 0, "node rows integrate NVML's device memory")
    finally:
        for w in workers.values():
            w.kill()
            w.wait()
    print(f"{failures} check(s) failed", flush=True)
    return failures


if __name__ == "__main__":
    sys.exit(main())
