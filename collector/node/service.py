"""`hami-usage collect`: the node collector's loop.

scan (worker thread) -> append every event to the local log -> optional Kafka forwarder.
The log is the embedded transport when no broker is configured and the write-ahead spool when
one is: the scan loop only ever appends to a local file, so it never waits on the broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..events import Event, Heartbeat, encode
from ..runtime import tune_gc
from ..transport.kafka import KafkaForwarder, ProducerSettings
from ..transport.locallog import LocalLog, LogReader
from .crosscheck import CrossCheck, DriftTolerance
from .diff import Presence
from .discover import ListingLimits
from .hostpids import HostPidMemory
from .identity import IdentityStage
from .metrics import Health, KubeHealth, MetricsServer, PodNames, Scrape
from .nvml import NvmlSource
from .podwatch import KubeSettings, PodWatch, open_api
from .presence import PresenceStage
from .scan import Scanner
from .schedule import ScanSchedule
from .writer_faults import WriterFaultSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CollectSettings:
    root: Path
    node: str
    log_dir: Path  # embedded log, or the spool when `kafka` is set
    kafka: ProducerSettings | None = None
    interval_s: float = 1.0
    heartbeat_s: float = 30.0
    host_proc: str | None = None
    presence: Presence = "folder"  # see diff.py and the README (Lifecycles, Presence)
    log_max_bytes: int = 256 * 1024 * 1024
    fsync: bool = False
    shutdown_timeout_s: float = 10.0
    max_scans: int | None = None  # stop after this many scans (tests, demo)
    nvml: bool = True  # off by itself, with one log line, where there is no driver
    nvml_timeout_s: float = 2.0
    drift: DriftTolerance = DriftTolerance()
    metrics_port: int | None = None  # Prometheus /metrics and /healthz; None: off
    metrics_bind_address: str = "0.0.0.0"
    metrics_hami: bool = False  # also serve HAMi's vGPU monitor's metric names
    metrics_hami_legacy: bool = False  # and the names HAMi served before v2.5
    listing: ListingLimits = ListingLimits()
    writer_faults: WriterFaultSettings = WriterFaultSettings()
    kube: KubeSettings | None = None  # the pod watch; None: no Kubernetes (no names)


@dataclass
class CollectorStatus:
    appended: int = 0
    dropped: int = 0  # rejected by the local log: counted here and in every heartbeat
    log_blocked: str | None = None  # why the local log rejects events now (an episode)
    blocked_since: float = 0.0  # monotonic start of that episode
    dropped_at_block: int = 0  # `dropped` when it began
    episodes: int = 0  # the local log's episodes seen so far
    dropped_told: int = 0  # `dropped` of the last heartbeat the local log stored


def last_event_ms(log_dir: Path, next_offset: int) -> int | None:
    """Event time of the last record in the local log, if it is still there (with Kafka, the
    spool releases what the broker has)."""
    if next_offset == 0:
        return None
    last = LogReader(log_dir).read(next_offset - 1, 1)
    return last[0].timestamp_ms if last and last[0].offset == next_offset - 1 else None


class Collector:
    def __init__(self, settings: CollectSettings, *, kube_api: Any = None) -> None:
        self.settings = settings
        self.kube_api = kube_api
        self.podwatch: PodWatch | None = None
        identity = presence = None
        if kube_api is not None and settings.kube is not None:
            watch = self.podwatch = PodWatch(kube_api, settings.node, settings.kube)
            identity = IdentityStage(lambda: watch.view)
            presence = PresenceStage(lambda: watch.view)
        crosscheck = None
        source = NvmlSource.open(log, timeout_s=settings.nvml_timeout_s) if settings.nvml else None
        if source is not None:
            # The inventory is restated with each heartbeat, like every other live key.
            crosscheck = CrossCheck(
                source,
                tolerance=settings.drift,
                inventory_every_ms=int(settings.heartbeat_s * 1000),
            )
        self.log = LocalLog(
            settings.log_dir, max_bytes=settings.log_max_bytes, fsync=settings.fsync
        )
        if self.log.stats.torn_tail_bytes:
            # A previous run died mid-write: the incomplete record was cut, the rest is intact.
            log.warning(
                "local log %s: cut a torn tail of %d bytes left by a crash; next offset %d",
                settings.log_dir,
                self.log.stats.torn_tail_bytes,
                self.log.next_offset,
            )
        self.scanner = Scanner(
            settings.root,
            heartbeat_s=settings.heartbeat_s,
            scan_interval_s=settings.interval_s,
            host_proc=settings.host_proc,
            host_pids=HostPidMemory(settings.log_dir) if settings.host_proc else None,
            crosscheck=crosscheck,
            listing=settings.listing,
            writer_faults=settings.writer_faults,
            identity=identity,
            presence=presence,
            after_ms=last_event_ms(settings.log_dir, self.log.next_offset),
            presence_policy=settings.presence,
        )
        if self.scanner.clock.offset_ms < 0:
            log.warning(
                "the wall clock is %d ms behind the last event in %s: event time goes on after it",
                -self.scanner.clock.offset_ms,
                settings.log_dir,
            )
        self.forwarder = (
            KafkaForwarder(settings.kafka, self.log, settings.log_dir) if settings.kafka else None
        )
        self.status = CollectorStatus()
        self.forwarder_stopped: str | None = None  # what ended the forwarder's task
        self.watch_stopped: str | None = None  # what ended the pod watch's task
        self._last_scan = time.monotonic()
        self.stopping = asyncio.Event()
        self._key = settings.node.encode()
        # pod UID -> (namespace, name) for /metrics: what the identity stage last sent.
        self.pod_names: PodNames = self._pod_name

    def _append(self, events: list[Event], *, beyond_bound: bool = False) -> None:
        dropped = self.status.dropped
        for event in events:
            at = self.log.append(self._key, encode(event), event.ts, beyond_bound=beyond_bound)
            if at is None:
                self.status.dropped += 1
            else:
                self.status.appended += 1
                if isinstance(event, Heartbeat):
                    self.status.dropped_told = event.dropped
        self.log.flush()
        self._watch_log(dropped)
        if self.forwarder is not None:
            self.forwarder.wake()

    def _watch_log(self, dropped_before: int) -> None:
        """Disk full, an I/O error and the log's size bound are one condition: logged once
        when an episode starts and once when it ends. Scanning goes on meanwhile; what is
        dropped is counted, and the first heartbeat after it restates every live key."""
        st = self.status
        blocked = self.log.blocked
        # An episode can begin and end within one batch (room made by a consumer meanwhile):
        # the log's count of episodes tells, not only its state after the batch.
        began = self.log.stats.blocked_episodes != st.episodes
        st.episodes = self.log.stats.blocked_episodes
        if began and st.log_blocked is None:
            st.log_blocked = self.log.last_block
            st.blocked_since = time.monotonic()
            st.dropped_at_block = dropped_before
            log.error(
                "local log %s cannot take events (%s): dropping and counting them, "
                "scanning goes on, writing resumes by itself",
                self.settings.log_dir,
                st.log_blocked,
            )
        if blocked is None and st.log_blocked is not None:
            log.warning(
                "local log %s writes again after %.1f s: %d events dropped (%s)",
                self.settings.log_dir,
                time.monotonic() - st.blocked_since,
                st.dropped - st.dropped_at_block,
                st.log_blocked,
            )
            self.scanner.heartbeat_now()
        st.log_blocked = blocked

    def spool_depth(self) -> int:
        return self.forwarder.depth() if self.forwarder else 0

    def scrape(self) -> Scrape:
        crosscheck = self.scanner.crosscheck
        return Scrape(
            published=self.scanner.published,
            health=self.health(),
            devices=crosscheck.current if crosscheck is not None else {},
            node=self.settings.node,
            now_s=time.time(),
            pod_names=self.pod_names,
            hami=self.settings.metrics_hami,
            legacy=self.settings.metrics_hami_legacy,
        )

    def health(self) -> Health:
        st = self.scanner.stats
        return Health(
            scans=st.scans,
            last_scan_ms=st.last_scan_ms,
            files=st.files,
            anomalies=st.anomalies,
            events=st.events,
            appended=self.status.appended,
            dropped=self.status.dropped,
            spool_depth=self.spool_depth(),
            kafka_refused=dict(self.forwarder.stats.refused) if self.forwarder else {},
            kafka_too_large=self.forwarder.stats.too_large if self.forwarder else 0,
            spool_read_errors=self.forwarder.stats.spool_read_errors if self.forwarder else 0,
            kafka_unstamped=self.forwarder.stats.unstamped if self.forwarder else 0,
            spool_unreadable=self.forwarder.spool_unreadable if self.forwarder else None,
            forwarder_stopped=self.forwarder_stopped,
            watch_stopped=self.watch_stopped,
            seconds_since_scan=time.monotonic() - self._last_scan,
            log_blocked=self.status.log_blocked,
            log_blocked_episodes=self.log.stats.blocked_episodes,
            log_write_errors=self.log.stats.write_errors,
            kube=self._kube_health(),
            clock_steps=st.clock_steps,
            clock_offset_ms=st.clock_offset_ms,
        )

    def _kube_health(self) -> KubeHealth | None:
        identity, watch = self.scanner.identity, self.podwatch
        if identity is None or watch is None:
            return None
        st = watch.stats
        return KubeHealth(
            unnamed_containers=identity.unnamed,
            stale_containers=self.scanner.presence.stale if self.scanner.presence else 0,
            connected=int(st.connected),
            watch_events=st.events,
            bookmarks=st.bookmarks,
            lists=st.lists,
            relists=st.relists,
            errors=st.errors,
            auth_errors=st.auth_errors,
            throttled=st.throttled,
            owner_errors=st.owner_errors,
        )

    def _pod_name(self, pod_uid: str) -> tuple[str, str] | None:
        identity = self.scanner.identity
        known = identity.sent.get(pod_uid) if identity is not None else None
        return (known.namespace, known.pod) if known is not None else None

    async def run(self) -> None:
        forward = asyncio.create_task(self.forwarder.run(self.stopping)) if self.forwarder else None
        if forward is not None:
            forward.add_done_callback(self._forwarder_ended)
        watch = asyncio.create_task(self.podwatch.run()) if self.podwatch is not None else None
        if watch is not None:
            watch.add_done_callback(self._watch_ended)
        self.metrics: MetricsServer | None = None
        if self.settings.metrics_port is not None:
            self.metrics = MetricsServer(
                self.settings.metrics_port,
                self.scrape,
                self.health,
                stale_after_s=max(30.0, 5 * self.settings.interval_s),
                host=self.settings.metrics_bind_address,
            )
            port = await self.metrics.start()
            log.info(
                "metrics on %s:%d/metrics, health on /healthz",
                self.settings.metrics_bind_address,
                port,
            )
        scans = 0
        try:
            self._append(self.scanner.announce(socket.gethostname(), str(self.settings.log_dir)))
            schedule = ScanSchedule(self.settings.interval_s, time.monotonic())
            while not self.stopping.is_set():
                schedule.start(time.monotonic())
                events = await asyncio.to_thread(
                    self.scanner.scan,
                    spool_depth=self.spool_depth(),
                    dropped=self.status.dropped,
                    log_blocked=self.log.stats.blocked_episodes,
                )
                self._append(events)
                self._last_scan = time.monotonic()
                scans += 1
                if self.settings.max_scans is not None and scans >= self.settings.max_scans:
                    break
                delay = schedule.wait(time.monotonic())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), timeout=delay)
        finally:
            self.stopping.set()
            if self.status.dropped > self.status.dropped_told:
                # Events dropped since the last heartbeat stored: no later event would show
                # their seq gap, nor any heartbeat their count (the aggregator said "damage:
                # none"). One heartbeat more, past the size bound if it is what refuses.
                self._append(
                    self.scanner.last_heartbeat(
                        spool_depth=self.spool_depth(),
                        dropped=self.status.dropped,
                        log_blocked=self.log.stats.blocked_episodes,
                    ),
                    beyond_bound=True,
                )
            if watch is not None:
                watch.cancel()
                await asyncio.wait({watch})  # (a watch that failed was said when it stopped)
            if self.kube_api is not None:
                await self.kube_api.close()
            if self.metrics is not None:
                await self.metrics.stop()
            if forward is not None and self.forwarder is not None:
                await self._stop_forwarder(forward, self.forwarder)
            if self.scanner.crosscheck is not None:
                self.scanner.crosscheck.close()
            self.scanner.discovery.close()
            self.log.close()
            if self.log.stats.unwritten_records:
                log.error(
                    "local log %s: %d accepted events could not be written (%s) and are lost",
                    self.settings.log_dir,
                    self.log.stats.unwritten_records,
                    self.log.blocked,
                )
            lost = self.log.stats.unwritten_records
            log.info(
                "collector stopped: %d events appended, %d dropped, %d left in the spool",
                self.status.appended - lost,  # (counted once)
                self.status.dropped + lost,
                # (the depth counts what the log accepted, held in memory until the disk took
                # it: those never reached the spool)
                max(0, self.spool_depth() - lost),
            )

    async def _stop_forwarder(self, forward: asyncio.Task[None], fwd: KafkaForwarder) -> None:
        """Let a batch in flight finish, then send what is left within the shutdown timeout.
        Cancelled between its send and its commit, a batch would be sent again by the drain
        (or by the next start): a duplicate on the topic."""
        deadline = time.monotonic() + self.settings.shutdown_timeout_s
        fwd.wake()
        done, _ = await asyncio.wait({forward}, timeout=self.settings.shutdown_timeout_s)
        if not done:  # e.g. still waiting for an unreachable broker
            forward.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await forward
        elif forward.exception() is not None:
            return  # (said when it stopped; a drain would stop the same way: all stays spooled)
        await fwd.drain(max(0.0, deadline - time.monotonic()))

    def _forwarder_ended(self, task: asyncio.Task[None]) -> None:
        # run() waits out every failure it knows (a broker away, a spool it cannot read);
        # anything else is a bug, said at once (not at shutdown) and on /healthz, for a
        # restart to send what stays spooled.
        if task.cancelled() or task.exception() is None:
            return
        self.forwarder_stopped = repr(task.exception())
        log.error(
            "kafka forwarder stopped: events stay in the spool %s until a restart",
            self.settings.log_dir,
            exc_info=task.exception(),
        )

    def _watch_ended(self, task: asyncio.Task[None]) -> None:
        # run() retries every failure it knows; anything else is a bug, and names stop coming:
        # said on /healthz and by kube_connected (it stayed 1), for a restart to watch again.
        if task.cancelled() or task.exception() is None:
            return
        self.watch_stopped = repr(task.exception())
        if self.podwatch is not None:
            self.podwatch.stats.connected = False
        log.error("pod watch stopped: pod names are no longer updated", exc_info=task.exception())


async def collect(
    settings: CollectSettings, prepare: Callable[[], None] | None = None
) -> Collector:
    """Raises KubeConfigError before anything starts when the pod watch cannot be configured.
    `prepare`: what the caller makes on disk, run once the configuration has loaded (a refused
    run leaves nothing made behind); what it raises is raised."""
    api = await open_api(settings.kube) if settings.kube is not None else None
    try:
        if prepare is not None:
            prepare()
    except BaseException:
        if api is not None:
            await api.close()
        raise
    collector = Collector(settings, kube_api=api)
    tune_gc()  # start-up is over: the Kubernetes and Kafka clients are imported
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, collector.stopping.set)
    await collector.run()
    return collector
