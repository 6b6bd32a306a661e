"""The collector's optional Prometheus endpoint: HAMi's own metric names, plus health.

`/metrics` serves the gauges HAMi's vGPU monitor exports (same names and labels, so existing
HAMi dashboards keep working) computed from the last scan, and the collector's health.
`/healthz` answers 200 while scans keep happening, 503 when the last one is too old.
HAMi labels `namespace` and `pod` with names from the API server; the collector only knows the
pod UID from the folder name, so `pod` carries the UID and `namespace` is empty.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..events import ContainerState

log = logging.getLogger(__name__)

Published = list[tuple[ContainerState, int | None]]


@dataclass(frozen=True)
class Health:
    scans: int
    last_scan_ms: float
    files: int
    anomalies: int
    events: int
    appended: int
    dropped: int
    spool_depth: int
    seconds_since_scan: float


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(**labels: str) -> str:
    return ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())


_HAMI = [
    (
        "hami_vgpu_memory_used_bytes",
        "GPU memory HAMi accounts to the container (sum of used.total)",
    ),
    ("hami_vgpu_memory_limit_bytes", "GPU memory limit of the container"),
    ("hami_vgpu_memory_context_bytes", "CUDA context memory of the container"),
    ("hami_vgpu_memory_module_bytes", "CUDA module memory of the container"),
    ("hami_vgpu_memory_buffer_bytes", "CUDA buffer (data) memory of the container"),
    ("hami_container_device_utilization_ratio", "SM utilisation of the container, percent"),
    ("hami_container_last_kernel_elapsed_seconds", "seconds since the last kernel launch"),
]


def render(published: Published, health: Health, now_s: float) -> str:
    """The Prometheus text exposition of one scan's state."""
    series: dict[str, list[str]] = {name: [] for name, _ in _HAMI}
    for state, last_kernel in published:
        for dev in state.devices:
            rows = [r for r in state.rows if r.device == dev.index]
            labels = _labels(
                namespace="",
                pod=state.pod_uid,
                container=state.container,
                vdevice_index=str(dev.index),
                device_uuid=dev.uuid,
            )
            values = {
                "hami_vgpu_memory_used_bytes": sum(r.total for r in rows),
                "hami_vgpu_memory_limit_bytes": dev.limit_bytes,
                "hami_vgpu_memory_context_bytes": sum(r.context for r in rows),
                "hami_vgpu_memory_module_bytes": sum(r.module for r in rows),
                "hami_vgpu_memory_buffer_bytes": sum(r.data for r in rows),
                "hami_container_device_utilization_ratio": sum(r.sm_util for r in rows),
            }
            if last_kernel:
                values["hami_container_last_kernel_elapsed_seconds"] = max(
                    0, int(now_s) - last_kernel
                )
            for name, value in values.items():
                series[name].append(f"{name}{{{labels}}} {value}")
    lines: list[str] = []
    for name, text in _HAMI:
        lines += [f"# HELP {name} {text}", f"# TYPE {name} gauge", *series[name]]
    own: list[tuple[str, str, str, float]] = [
        ("hami_usage_scans_total", "counter", "scans done", health.scans),
        (
            "hami_usage_scan_seconds",
            "gauge",
            "duration of the last scan",
            health.last_scan_ms / 1000,
        ),
        ("hami_usage_files", "gauge", "cache files tracked", health.files),
        ("hami_usage_anomalies_total", "counter", "anomaly events emitted", health.anomalies),
        ("hami_usage_events_total", "counter", "events appended to the local log", health.appended),
        (
            "hami_usage_events_dropped_total",
            "counter",
            "events rejected by a full log",
            health.dropped,
        ),
        (
            "hami_usage_spool_depth",
            "gauge",
            "events not yet acknowledged by Kafka",
            health.spool_depth,
        ),
    ]
    for name, kind, text, amount in own:
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name} {amount}"]
    return "\n".join(lines) + "\n"


class MetricsServer:
    """A minimal HTTP/1.0 server on the event loop: GET /metrics and GET /healthz."""

    def __init__(
        self,
        port: int,
        published: Callable[[], Published],
        health: Callable[[], Health],
        *,
        stale_after_s: float,
        host: str = "0.0.0.0",
    ) -> None:
        self.port = port
        self.host = host
        self._published = published
        self._health = health
        self.stale_after_s = stale_after_s
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), timeout=5)
            parts = request.decode("latin-1").split()
            path = parts[1] if len(parts) >= 2 else ""
            health = self._health()
            if parts[:1] != ["GET"]:
                status, body = "405 Method Not Allowed", "GET only\n"
            elif path == "/metrics":
                status, body = "200 OK", render(self._published(), health, time.time())
            elif path == "/healthz":
                fresh = health.scans > 0 and health.seconds_since_scan <= self.stale_after_s
                status = "200 OK" if fresh else "503 Service Unavailable"
                body = f"last scan {health.seconds_since_scan:.1f} s ago\n"
            else:
                status, body = "404 Not Found", "try /metrics or /healthz\n"
            data = body.encode()
            writer.write(
                f"HTTP/1.0 {status}\r\nContent-Type: text/plain; version=0.0.4\r\n"
                f"Content-Length: {len(data)}\r\n\r\n".encode()
                + data
            )
            await writer.drain()
        except (TimeoutError, ConnectionError) as exc:
            log.debug("metrics request dropped: %s", exc)
        finally:
            writer.close()
