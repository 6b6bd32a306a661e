"""The collector's Prometheus endpoint over real HTTP: HAMi's metric names and /healthz."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from pathlib import Path

from collector.layout.declarations import V12
from collector.node.service import Collector, CollectSettings
from collector.simulate import GiB, MiB, SimDevice, new_cache_file

GPU = "GPU-aaaaaaaa-bbbb-4ccc-8ddd-eeeeeeeeeeee"
POD = "0b9d6c7e-1f2a-4b3c-9d4e-5f6a7b8c9d0e"


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


async def test_metrics_and_health(tmp_path: Path) -> None:
    root = tmp_path / "containers"
    w = new_cache_file(root, POD, "main", V12, [SimDevice(GPU, 8 * GiB, 40)])
    w.add_process(7, 4242)
    w.add_memory(7, 0, "context", 300 * MiB)
    w.add_memory(7, 0, "data", GiB)
    w.watch({4242: {0: (GiB, 55)}})
    w.kernel_launched(1_000)
    collector = Collector(
        CollectSettings(
            root=root,
            node="n1",
            log_dir=tmp_path / "log",
            interval_s=0.1,
            nvml=False,
            metrics_port=0,
        )
    )
    task = asyncio.create_task(collector.run())
    try:
        while collector.scanner.stats.scans < 2:
            await asyncio.sleep(0.05)
        assert collector.metrics is not None
        port = collector.metrics.port
        status, body = await asyncio.to_thread(get, port, "/metrics")
        assert status == 200
        labels = f'namespace="",pod="{POD}",container="main",vdevice_index="0",device_uuid="{GPU}"'
        lines = set(body.splitlines())
        assert f"hami_vgpu_memory_used_bytes{{{labels}}} {GiB + 300 * MiB}" in lines
        assert f"hami_vgpu_memory_limit_bytes{{{labels}}} {8 * GiB}" in lines
        assert f"hami_vgpu_memory_context_bytes{{{labels}}} {300 * MiB}" in lines
        assert f"hami_vgpu_memory_buffer_bytes{{{labels}}} {GiB}" in lines
        assert f"hami_container_device_utilization_ratio{{{labels}}} 55" in lines
        assert any(
            x.startswith(f"hami_container_last_kernel_elapsed_seconds{{{labels}}} ") for x in lines
        )
        assert "hami_usage_files 1" in lines
        assert "hami_usage_events_dropped_total 0" in lines
        assert (await asyncio.to_thread(get, port, "/healthz"))[0] == 200
        assert (await asyncio.to_thread(get, port, "/nope"))[0] == 404
        collector.metrics.stale_after_s = 0.0  # as if the scan loop had stopped
        assert (await asyncio.to_thread(get, port, "/healthz"))[0] == 503
    finally:
        collector.stopping.set()
        await task
        w.close()
