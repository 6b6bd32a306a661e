"""A minimal HTTP/1.0 server on the event loop: GET /metrics and GET /healthz.

`/metrics` is prometheus_client's exposition of the registry (text format 0.0.4, or OpenMetrics
when the scraper asks for it); `/healthz` answers 200 while scans keep happening, 503 when the
last one is older than `stale_after_s`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import CollectorRegistry

from .families import Health, Scrape, ScrapeCollector

log = logging.getLogger(__name__)

_MAX_HEADERS = 100


def healthz(health: Health, stale_after_s: float) -> tuple[str, str]:
    """200 while scans keep happening, even while the local log refuses events: the
    collector is degraded then, not dead (a restart would not free the disk), and says so."""
    fresh = health.scans > 0 and health.seconds_since_scan <= stale_after_s
    status = "200 OK" if fresh else "503 Service Unavailable"
    body = f"last scan {health.seconds_since_scan:.1f} s ago\n"
    if health.log_blocked is not None:
        body = f"degraded: local log refuses events ({health.log_blocked}); {body}"
    return status, body


class MetricsServer:
    def __init__(
        self,
        port: int,
        scrape: Callable[[], Scrape],
        health: Callable[[], Health],
        *,
        stale_after_s: float,
        host: str = "0.0.0.0",
    ) -> None:
        self.port = port
        self.host = host
        self._health = health
        self.stale_after_s = stale_after_s
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(ScrapeCollector(scrape))
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        """Listen; the actual port (for port 0). Raises OSError when the address is unusable."""
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _request(self, reader: asyncio.StreamReader) -> tuple[str, str, str]:
        """(method, path, Accept header) of one request."""
        request = await reader.readline()
        parts = request.decode("latin-1").split()
        accept = ""
        for _ in range(_MAX_HEADERS):
            line = (await reader.readline()).decode("latin-1")
            if line in ("\r\n", "\n", ""):
                break
            name, _, value = line.partition(":")
            if name.strip().lower() == "accept":
                accept = value.strip()
        method = parts[0] if parts else ""
        path = parts[1] if len(parts) >= 2 else ""
        return method, path, accept

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            method, path, accept = await asyncio.wait_for(self._request(reader), timeout=5)
            content_type = "text/plain; charset=utf-8"
            if method != "GET":
                status, body = "405 Method Not Allowed", b"GET only\n"
            elif path == "/metrics":
                encoder, content_type = choose_encoder(accept)
                # Formatting walks every series: off the event loop.
                body = await asyncio.to_thread(encoder, self.registry)
                status = "200 OK"
            elif path == "/healthz":
                status, text = healthz(self._health(), self.stale_after_s)
                body = text.encode()
            else:
                status, body = "404 Not Found", b"try /metrics or /healthz\n"
            writer.write(
                f"HTTP/1.0 {status}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        except (TimeoutError, ConnectionError) as exc:
            log.debug("metrics request dropped: %s", exc)
        finally:
            writer.close()
