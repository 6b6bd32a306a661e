"""Kafka producer side: forward the collector's local log to the usage topic.

Every event is appended to the local log first (the write-ahead spool), and this forwarder
sends it on. While the broker is away, events simply stay in the log; when it returns they
drain in order. The spool offset is committed only up to the last contiguously acknowledged
record, so nothing accepted is lost and nothing is sent twice in the normal course.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from aiokafka import AIOKafkaProducer
from aiokafka.errors import (
    InvalidTimestampError,
    KafkaConnectionError,
    KafkaError,
    MessageSizeTooLargeError,
    RecordListTooLargeError,
)
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    retry_if_exception_type,
    stop_after_delay,
    wait_exponential,
)

from .locallog import CorruptCheckpointError, LocalLog, LogReader
from .security import KafkaSecurity, Refusal, SecurityError, classify
from .topics import TopicSpec, warn_on_mismatch

log = logging.getLogger(__name__)

FORWARDER_GROUP = "kafka-forwarder"
# How long the forwarder waits before it reads a spool it could not read again.
UNREADABLE_RETRY_S = 1.0


@dataclass(frozen=True)
class ProducerSettings:
    bootstrap: str
    topic: str = "hami.usage.v1"
    linger_ms: int = 50
    compression: str = "gzip"
    request_timeout_ms: int = 10_000
    batch_records: int = 1000
    security: KafkaSecurity = field(default_factory=KafkaSecurity)
    # The topic as `[topics]` plans it: checked once connected, a warning per difference.
    expect: tuple[TopicSpec, ...] = ()


@dataclass
class ForwarderStats:
    sent: int = 0
    send_failures: int = 0
    reconnects: int = 0
    # Spooled events over the producer's max_request_size: no retry can send them, so each is
    # skipped (logged; the aggregator sees a gap in the node's sequence).
    too_large: int = 0
    # Failures retrying cannot fix (credentials, certificates, ACLs), by kind: the collector
    # keeps its events spooled and retries, so that fixing the Secret or ACL is enough.
    refused: dict[str, int] = field(default_factory=dict)
    # Reads of the spool that failed (out of descriptors, an I/O error): each retried.
    spool_read_errors: int = 0
    # Events sent with the time they were sent though their own is later: the broker refused
    # such a time as too far ahead of its clock (message.timestamp.after.max.ms, an hour by
    # default: a node clock stepped back that far). The aggregator refuses them as future events.
    unstamped: int = 0


NOISY = ("aiokafka", "kubernetes_asyncio")  # the libraries QuietRetries quiets


class QuietRetries(logging.Filter):
    """aiokafka logs every reconnect attempt of every connection, tens of lines a second while
    the broker is away (and a process writing to a full stderr pipe stops); kubernetes_asyncio
    logs each failed load of the pod watch's credentials, which the watch retries and reports
    itself. Let each distinct warning or error of theirs through once per `period_s`, saying
    how many like it were held back. aiokafka's INFO lines are state changes, each once (a
    group joined, the partitions assigned, a coordinator found), and always pass: held back, a
    replica's log would go on naming the partitions it held before the last rebalance."""

    def __init__(self, period_s: float = 30.0) -> None:
        super().__init__()
        self.period_s = period_s
        self._last: dict[tuple[str, str], float] = {}
        self._held: dict[tuple[str, str], int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(NOISY) or record.levelno < logging.WARNING:
            return True
        if record.exc_info and record.exc_info[1] is not None:
            # aiokafka logs some errors with their traceback and then raises them (the
            # command's line says why): the error is folded into its line.
            exc = record.exc_info[1]
            record.msg = f"{record.getMessage()}: {type(exc).__name__}: {exc}"
            record.args = None
            record.exc_info = record.exc_text = None
        key = (record.name, str(record.msg))
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.period_s:
            self._held[key] = self._held.get(key, 0) + 1
            return False
        self._last[key] = now
        held = self._held.pop(key, 0)
        if held:
            record.msg = f"{record.msg} [and {held} more like it since the last one shown]"
        return True


class UnreadKafkaErrors(logging.Filter):
    """For the `asyncio` logger. A failed transaction or send fails aiokafka's futures for
    every record, batch and waiter in it, and asyncio logs each that nobody read as 'never
    retrieved', with a traceback, when it is freed (a fenced producer: three after the
    command's own line). The error reaches our code through the call that failed, which says
    it once; these copies of it are dropped.

    A TLS connection's error (a broker that refuses our certificate after the handshake)
    also lands in the stream's `closed` future, which asyncio marks read only when the
    stream is freed before it; freed together in one garbage collection, it is logged. aiokafka
    hands the same error to the connection's requests as a KafkaConnectionError's cause."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        unread = "never retrieved" in str(record.msg)
        return not (unread and isinstance(exc, KafkaError | ssl.SSLError))


class BrokerUnreachable(Exception):
    """No broker answered within the start-up timeout, or one refused us (credentials,
    certificate, ACL); the message is one line for stderr."""


class KafkaRefused(KafkaError):  # type: ignore[misc]
    """The broker refused this client for a reason retrying cannot fix; str() is one line."""

    def __init__(self, server: str, refusal: Refusal) -> None:
        super().__init__(f"{server}: {refusal}")
        self.refusal = refusal


async def probe(bootstrap: str, security: KafkaSecurity, timeout_ms: int = 5000) -> None:
    """Connect to a bootstrap server the way the clients do (TLS handshake, SASL) and raise
    KafkaRefused with the real reason when it refuses us. aiokafka's own clients report every
    such failure as "Unable to bootstrap", with the reason only in a log line.

    One request is made after connecting: a listener that expects SASL answers the version
    lookup of a client that did not authenticate and closes at its next request, which its
    clients then report as a broker that never answered."""
    from aiokafka.conn import create_conn
    from aiokafka.protocol.admin import ApiVersionRequest

    kwargs = security.client_kwargs()
    last: BaseException | None = None
    for server in bootstrap.split(","):
        host, _, port = server.strip().rpartition(":")
        try:
            conn = await create_conn(
                host.strip("[]"),
                int(port),
                request_timeout_ms=timeout_ms,
                ssl_context=kwargs.get("ssl_context"),
                security_protocol=kwargs["security_protocol"],
                sasl_mechanism=kwargs.get("sasl_mechanism", "PLAIN"),
                sasl_plain_username=kwargs.get("sasl_plain_username"),
                sasl_plain_password=kwargs.get("sasl_plain_password"),
            )
        except (OSError, TimeoutError, KafkaError) as exc:
            refusal = classify(exc)
            if refusal is not None:
                raise KafkaRefused(server, refusal) from None
            last = _mismatch(server, security, exc) or exc
            continue
        try:
            await conn.send(ApiVersionRequest())
        except KafkaError as exc:
            hint = "" if security.protocol == "SASL_SSL" else " (a listener that expects SASL_SSL?)"
            last = KafkaConnectionError(f"{server} closed the connection at a request{hint}: {exc}")
            continue
        finally:
            conn.close()
        return
    raise KafkaConnectionError(f"no answer from {bootstrap}: {last!r}")


def _mismatch(server: str, security: KafkaSecurity, exc: BaseException) -> Exception | None:
    """The connection a listener of another protocol gives a client, said so: a TLS listener
    closes on a PLAINTEXT client's first bytes, a PLAINTEXT listener resets a TLS handshake
    (both read "no answer", as if no broker listened there)."""
    if security.protocol == "PLAINTEXT" and isinstance(exc, KafkaError) and "closed" in str(exc):
        hint = "a listener that expects TLS: kafka_security_protocol SSL or SASL_SSL?"
        said: Exception = KafkaConnectionError(f"{server} closed the connection ({hint}): {exc}")
        return said
    if security.protocol != "PLAINTEXT" and isinstance(exc, ConnectionResetError):
        said = KafkaConnectionError(f"{server} reset the TLS handshake (a PLAINTEXT listener?)")
        return said
    return None


def _retriable(exc: BaseException) -> bool:
    return isinstance(exc, KafkaError) and not isinstance(exc, KafkaRefused)


async def wait_for_broker(bootstrap: str, timeout_s: float, security: KafkaSecurity) -> None:
    """Wait until the cluster answers (a broker may still be starting during a rollout),
    retrying with backoff; BrokerUnreachable after `timeout_s`, or at once when the broker
    refuses our credentials or certificate."""
    from aiokafka.admin import AIOKafkaAdminClient

    try:
        async for attempt in AsyncRetrying(
            stop=stop_after_delay(timeout_s),
            wait=wait_exponential(multiplier=0.2, max=5),
            retry=retry_if_exception(_retriable),
            reraise=True,
        ):
            with attempt:
                await probe(bootstrap, security)
                admin = AIOKafkaAdminClient(
                    bootstrap_servers=bootstrap, request_timeout_ms=5000, **security.client_kwargs()
                )
                try:
                    await admin.start()
                finally:
                    await admin.close()
    except KafkaRefused as exc:
        raise BrokerUnreachable(f"Kafka refused {security.describe()} at {exc.args[0]}") from None
    except KafkaError as exc:
        detail = f"no Kafka broker at {bootstrap} after {timeout_s:.0f} s: {exc}"
        raise BrokerUnreachable(detail) from None


def make_producer(s: ProducerSettings) -> AIOKafkaProducer:
    return AIOKafkaProducer(
        bootstrap_servers=s.bootstrap,
        enable_idempotence=True,  # implies acks=all; no duplicates from the producer's retries
        linger_ms=s.linger_ms,
        compression_type=None if s.compression == "none" else s.compression,
        request_timeout_ms=s.request_timeout_ms,
        client_id="hami-usage-collector",
        **s.security.client_kwargs(),
    )


# The back-off between batches after a failed one (`KafkaForwarder.send_retry_delay`), the
# shape of `_ensure_producer`'s back-off between connections.
SEND_RETRY_FIRST_S: Final = 0.2
SEND_RETRY_MAX_S: Final = 5.0
# A failure that goes on (the same kind, batch after batch) is logged again this often.
FAILURE_REPEAT_S: Final = 300.0


class Repeats:
    """Which failures of a repeating kind to log: the first of an episode, one of another kind
    than the last logged, and one every `FAILURE_REPEAT_S` while it lasts (each is counted on
    `/metrics` all the same): a broker away for a day is a handful of lines, not thousands."""

    def __init__(self) -> None:
        self._said: tuple[str, float] | None = None  # kind and time of the last line

    def say(self, kind: str, first: bool) -> bool:
        now = time.monotonic()
        said = self._said
        say = first or said is None or said[0] != kind or now - said[1] >= FAILURE_REPEAT_S
        if say:
            self._said = (kind, now)
        return say


def _retrieve(fut: asyncio.Future[Any]) -> None:
    """A done callback for a delivery future whose error is reported another way: taken, so
    asyncio does not log it as never retrieved, with a traceback, once per record."""
    if not fut.cancelled():
        fut.exception()


def delivery_error(futures: Iterable[asyncio.Future[Any]]) -> BaseException | None:
    """The first error among deliveries that ended, if any."""
    for fut in futures:
        if fut.done() and not fut.cancelled() and fut.exception() is not None:
            return fut.exception()
    return None


# The broker's refusals of a batch as too large (a record over its or the topic's limit once
# compressed, which the producer's own check, before compression, lets through)
TOO_LARGE: Final = (MessageSizeTooLargeError, RecordListTooLargeError)


class KafkaForwarder:
    def __init__(self, settings: ProducerSettings, spool: LocalLog, spool_dir: Path) -> None:
        self.settings = settings
        self.spool = spool
        self.spool_dir = spool_dir
        self.reader = LogReader(spool_dir)
        self.stats = ForwarderStats()
        self.connected = False
        self._producer: AIOKafkaProducer | None = None
        self._wake = asyncio.Event()
        self._commit_failing = False
        # Why the spool cannot be read now (an episode), and since when (monotonic).
        self.spool_unreadable: str | None = None
        self._unreadable_since = 0.0
        self._errors_at_start = 0
        # The broker refused an event's own time: from then on every record carries the send
        # time (see `unstamped`); and whether it refused even that (a node clock far ahead).
        self._send_time_only = False
        self._refused_send_time = False
        # Batches refused or failed in a row since the last one sent: the next try waits
        # `send_retry_delay()`, as a failed connection does (a refusal at send time, a topic
        # ACL missing, was retried at every scan, with a new connection and an ERROR line).
        self.failed_batches = 0
        # The spool offset of a record in a batch the broker refused as too large: it is sent
        # again alone, and skipped if the broker refuses it so (see `forward_once`).
        self._alone: int | None = None
        self._batch_lines = Repeats()
        self._connect_lines = Repeats()
        try:
            committed = self.reader.committed(FORWARDER_GROUP)
        except CorruptCheckpointError as exc:
            # Sending the spool again is safe (the aggregator drops what it already has);
            # skipping any of it is not. The next commit replaces the file.
            log.warning("spool checkpoint unreadable (%s): forwarding the whole spool again", exc)
            committed = None
        self._offset = committed[0] if committed else spool.first_offset
        if self._offset > spool.opened_end:
            # The checkpoint is fsync'd and the segments are not (unless `fsync`): after a
            # power loss the log can end below it (what it lost the broker had acknowledged),
            # and what is appended from then on takes offsets the broker never had. Sending
            # from the checkpoint would skip those, uncounted.
            log.warning(
                "spool checkpoint %d is past where the spool ended when opened (%d; segments "
                "lost in a crash): forwarding from there",
                self._offset,
                spool.opened_end,
            )
            self._offset = spool.opened_end

    def _log_retry(self, state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        refusal = error.refusal if isinstance(error, KafkaRefused) else None
        if isinstance(error, SecurityError):  # (a file of ours, read again for each try)
            refusal = Refusal(error.kind, str(error))
        elif refusal is None and error is not None:
            refusal = classify(error)
        first = state.attempt_number == 1
        if refusal is not None:
            self._count_refused(refusal)
            ours = isinstance(error, SecurityError)  # (a file of ours: no broker was asked)
            what = "credentials cannot be loaded" if ours else "refused the collector"
            if self._connect_lines.say(f"{what} {refusal.kind}", first):
                log.error("kafka %s, retrying: %s", what, refusal)
        elif self._connect_lines.say("unreachable", first):
            log.warning("kafka unreachable, retrying: %r", error)

    def _count_refused(self, refusal: Refusal) -> None:
        self.stats.refused[refusal.kind] = self.stats.refused.get(refusal.kind, 0) + 1

    def wake(self) -> None:
        self._wake.set()

    def depth(self) -> int:
        """Records in the spool not yet acknowledged by the broker."""
        return max(0, self.spool.next_offset - self._offset)

    async def _ensure_producer(self) -> AIOKafkaProducer:
        if self._producer is not None:
            return self._producer
        async for attempt in AsyncRetrying(
            wait=wait_exponential(multiplier=0.2, max=5),
            # SecurityError: TLS files that cannot be loaded now (a Secret being replaced):
            # fixing them is enough, as for a refusal
            retry=retry_if_exception_type((KafkaError, SecurityError)),
            before_sleep=self._log_retry,
        ):
            with attempt:
                await probe(self.settings.bootstrap, self.settings.security)
                producer = make_producer(self.settings)
                try:
                    await producer.start()
                except BaseException:
                    await producer.stop()
                    raise
        if attempt.retry_state.attempt_number > 1:
            log.info(
                "kafka takes the collector's connection again after %d failed tries",
                attempt.retry_state.attempt_number - 1,
            )
        self._producer = producer
        self.connected = True
        self.stats.reconnects += 1
        if self.stats.reconnects == 1 and self.settings.expect:
            s = self.settings
            await warn_on_mismatch(s.bootstrap, s.security, list(s.expect))
        return producer

    async def _drop_producer(self) -> None:
        # After a failed batch the idempotent session may be out of step: start a fresh one.
        producer, self._producer = self._producer, None
        self.connected = False
        if producer is not None:
            with contextlib.suppress(KafkaError, TimeoutError):
                await asyncio.wait_for(producer.stop(), timeout=5)

    async def forward_once(self) -> int:
        """Send what the spool holds beyond the committed offset; returns records acknowledged."""
        self.spool.flush()
        alone = self._alone == self._offset
        records = self.reader.read(self._offset, 1 if alone else self.settings.batch_records)
        if not records:
            return 0
        producer = await self._ensure_producer()
        acked = self._offset
        skipped = 0
        futures: list[asyncio.Future[Any] | None] = []
        unstamped = 0
        now = int(time.time() * 1000)
        failures = self.failed_batches
        try:
            for r in records:
                # The record's time is when it was sent (a spool drained after an outage says
                # when it came, as the aggregator's idle rule and a replay of it need), but
                # never before the event's own: after a backward step of the node's wall clock
                # the event time runs ahead of it by the step, and the aggregator refuses an
                # event more than max_skew after its record time as from the future.
                ts = now if self._send_time_only else max(r.timestamp_ms, now)
                try:
                    fut = await producer.send(
                        self.settings.topic, value=r.value, key=r.key, timestamp_ms=ts
                    )
                except MessageSizeTooLargeError:
                    fut = None  # the producer's own check, before sending: no retry can help
                futures.append(fut)
            for r, f in zip(records, futures, strict=True):
                if f is None:
                    skipped += 1
                    log.error(
                        "spooled event at offset %d is %d bytes, more than a Kafka request "
                        "may carry (max_request_size): skipped",
                        r.offset,
                        len(r.value),
                    )
                else:
                    await f
                    if self._send_time_only and r.timestamp_ms > now:
                        unstamped += 1  # acknowledged with the send time, not its later own
                acked = r.offset + 1
        except KafkaError as exc:
            self.stats.send_failures += 1
            self.failed_batches += 1
            refusal = classify(exc)
            if isinstance(exc, TOO_LARGE) and alone:
                # Alone and still too large for the broker (its message.max.bytes, the
                # topic's max.message.bytes): no retry can send it. Before, it was retried
                # with the rest of its batch for good: nothing after it was ever sent.
                skipped += 1
                acked = records[0].offset + 1
                log.error(
                    "spooled event at offset %d (%d bytes) is refused by the broker as too "
                    "large (%s): skipped",
                    records[0].offset,
                    len(records[0].value),
                    type(exc).__name__,
                )
            elif isinstance(exc, TOO_LARGE):
                self._alone = acked  # its batch was: the first record not acknowledged alone
            elif isinstance(exc, InvalidTimestampError):
                self._times_refused()
            elif refusal is not None:
                self._count_refused(refusal)
                if self._batch_lines.say(refusal.kind, self.failed_batches == 1):
                    log.error("kafka refused the collector, retrying: %s", refusal)
            elif self._batch_lines.say(type(exc).__name__, self.failed_batches == 1):
                log.warning(
                    "kafka send to %s failed after %d records: %s",
                    self.settings.topic,
                    acked - self._offset,
                    exc,
                )
            # (the rest of the batch fails too, with this error)
            for fut in futures:
                if fut is not None:
                    fut.add_done_callback(_retrieve)
            await self._drop_producer()
        done = acked - self._offset
        if self.failed_batches == failures and failures:  # (a whole batch sent)
            log.info("kafka takes the collector's events again after %d failed batches", failures)
            self.failed_batches = 0
        if done:
            self._refused_send_time = False  # (an episode ends with a batch sent)
            self._commit(acked)
            self._offset = acked
            self.stats.sent += done - skipped
            self.stats.too_large += skipped
            self.stats.unstamped += unstamped
        return done

    def send_retry_delay(self) -> float:
        """Seconds before the next try after `failed_batches` failed in a row: 0.2 s doubling
        up to 5 s, as for a connection."""
        return min(SEND_RETRY_MAX_S, SEND_RETRY_FIRST_S * 2.0 ** min(self.failed_batches - 1, 8))

    def _times_refused(self) -> None:
        """The broker refused a record's time as too far ahead of its clock. Sent again as
        they are, this batch and every later one would be refused for ever, holding up the
        spool: from now on records carry the send time. If even that is refused, the node's
        wall clock is itself too far ahead: nothing can be sent until it is set right."""
        if not self._send_time_only:
            self._send_time_only = True
            log.warning(
                "kafka refused an event's own time (more than the topic's "
                "message.timestamp.after.max.ms ahead of the broker's clock: the node's clock "
                "stepped back?); this collector now stamps its records with the send time until "
                "it restarts, and the aggregator refuses those of the events ahead of it as "
                "future events"
            )
        elif not self._refused_send_time:
            self._refused_send_time = True
            log.error(
                "kafka refuses even the send time: this node's wall clock is more than the "
                "topic's message.timestamp.after.max.ms ahead of the broker's; the events stay "
                "spooled and are retried until it is set right"
            )

    def _commit(self, acked: int) -> None:
        """Remember what the broker has, and free the spool below it. On a full disk the
        checkpoint cannot be replaced: the position is kept in memory and committed by a later
        batch (a restart before that sends what is still spooled again; the aggregator drops
        those as duplicates), while the segments the broker has are freed all the same."""
        self.spool.release_before(acked)
        try:
            self.reader.commit(FORWARDER_GROUP, acked)
        except OSError as exc:
            if not self._commit_failing:
                log.warning("spool checkpoint not written (%s); kept in memory", exc.strerror)
            self._commit_failing = True
            return
        if self._commit_failing:
            log.info("spool checkpoint written again")
        self._commit_failing = False

    async def run(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            sent = await self._forward_or_count()
            if self.spool_unreadable is not None:
                # (not cut short by a wake: every scan wakes the forwarder)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping.wait(), timeout=UNREADABLE_RETRY_S)
            elif self.failed_batches:
                # (not cut short by a wake either: the next scan must not retry at once)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping.wait(), timeout=self.send_retry_delay())
            elif sent == 0:
                self._wake.clear()
                delay = 0.2 if self.connected else 1.0
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=delay)

    async def _forward_or_count(self) -> int:
        """`forward_once`, where a spool that cannot be read (out of descriptors for a while,
        an I/O error) is an episode to wait out, not the end of forwarding: everything stays
        spooled and the next try reads it from the same offset."""
        try:
            sent = await self.forward_once()
        except OSError as exc:
            self._unreadable(exc)
            return 0
        self._readable()
        return sent

    def _unreadable(self, exc: OSError) -> None:
        self.stats.spool_read_errors += 1
        reason = exc.strerror or str(exc)
        if self.spool_unreadable is None:
            self._unreadable_since = time.monotonic()
            self._errors_at_start = self.stats.spool_read_errors - 1
            log.error(
                "kafka forwarder cannot read the spool %s (%s): events stay spooled, retrying",
                self.spool_dir,
                reason,
            )
        self.spool_unreadable = reason

    def _readable(self) -> None:
        if self.spool_unreadable is None:
            return
        log.warning(
            "kafka forwarder reads the spool again after %.1f s: %d failed reads (%s)",
            time.monotonic() - self._unreadable_since,
            self.stats.spool_read_errors - self._errors_at_start,
            self.spool_unreadable,
        )
        self.spool_unreadable = None

    async def drain(self, timeout_s: float) -> None:
        """On shutdown: send what can be sent within the timeout; the rest stays spooled."""
        try:
            async with asyncio.timeout(timeout_s):
                while await self._forward_or_count():
                    pass
        except TimeoutError:
            log.warning("shutdown: %d records stay in the spool for the next start", self.depth())
        await self._drop_producer()
