"""The collector's `/metrics` and `/healthz`.

`/metrics` is prometheus_client's exposition of the registry (text format 0.0.4, or OpenMetrics
when the scraper asks for it); `/healthz` answers 200 while scans keep happening, 503 when the
last one is older than `stale_after_s` or the Kafka forwarder has stopped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import CollectorRegistry

from ...transport.http import TEXT, Answer, HttpServer
from .families import Health, Scrape, ScrapeCollector


def healthz(health: Health, stale_after_s: float) -> tuple[str, str]:
    """200 while scans keep happening, even while the local log refuses events or the Kafka
    forwarder cannot read the spool: the collector is degraded then, not dead (a restart
    would not free the disk), and says so. A forwarder that has stopped is 503: nothing
    spooled leaves the node until a restart; so is a pod watch that has stopped: no pod is
    named until a restart."""
    fresh = health.scans > 0 and health.seconds_since_scan <= stale_after_s
    alive = health.forwarder_stopped is None and health.watch_stopped is None
    status = "200 OK" if fresh and alive else "503 Service Unavailable"
    body = (
        f"last scan {health.seconds_since_scan:.1f} s ago\n"
        if health.scans
        else f"no scan yet (started {health.seconds_since_scan:.1f} s ago)\n"
    )
    degraded = []
    if health.log_blocked is not None:
        degraded.append(f"local log refuses events ({health.log_blocked})")
    if health.spool_unreadable is not None:
        degraded.append(f"kafka forwarder cannot read the spool ({health.spool_unreadable})")
    if degraded:
        body = f"degraded: {'; '.join(degraded)}; {body}"
    if health.watch_stopped is not None:
        body = f"pod watch stopped ({health.watch_stopped}): pods are not named; {body}"
    if health.forwarder_stopped is not None:
        body = f"kafka forwarder stopped ({health.forwarder_stopped}): events stay spooled; {body}"
    return status, body


class MetricsServer(HttpServer):
    def __init__(
        self,
        port: int,
        scrape: Callable[[], Scrape],
        health: Callable[[], Health],
        *,
        stale_after_s: float,
        host: str = "0.0.0.0",
    ) -> None:
        super().__init__(host, port, {"/metrics": self._metrics, "/healthz": self._healthz})
        self._health = health
        self.stale_after_s = stale_after_s
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(ScrapeCollector(scrape))
        # One formatting at a time, shared by the scrapes that were waiting for it: each walks
        # every series in a worker thread, and a burst of scrapes formatting at once took the
        # workers and the interpreter from the scans (64 scrapers of a 2.7 MB page: one scan
        # in 10 s).
        self._formatting = asyncio.Lock()
        self._formatted: dict[str, tuple[float, bytes]] = {}  # content type: (began, page)

    async def _metrics(self, accept: str) -> Answer:
        encoder, content_type = choose_encoder(accept)
        asked = time.monotonic()
        async with self._formatting:
            done = self._formatted.get(content_type)
            if done is not None and done[0] >= asked:
                # Begun after this scrape asked: as fresh as one of its own.
                return "200 OK", content_type, done[1]
            began = time.monotonic()
            page = await asyncio.to_thread(encoder, self.registry)
            self._formatted[content_type] = (began, page)
        return "200 OK", content_type, page

    async def _healthz(self, accept: str) -> Answer:
        status, text = healthz(self._health(), self.stale_after_s)
        return status, TEXT, text.encode()
