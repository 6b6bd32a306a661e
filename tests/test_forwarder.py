"""The collector's Kafka forwarder (spool -> topic) at its edges, against the real broker:
an event no Kafka request can carry, and a spool that ends below its checkpoint."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import re
import time
from pathlib import Path

import certifi
import pytest
from streams import consume_plain, create_topic
from test_locallog import no_descriptor_left

from collector.transport.kafka import FORWARDER_GROUP, KafkaForwarder, ProducerSettings
from collector.transport.locallog import LocalLog, LogReader
from collector.transport.locallog.frames import list_segments, segment_name
from collector.transport.security import KafkaSecurity

pytestmark = pytest.mark.kafka

KEY = b"node-1"


def spool_of(directory: Path, values: list[bytes]) -> LocalLog:
    spool = LocalLog(directory)
    for i, v in enumerate(values):
        spool.append(KEY, v, 1_700_000_000_000 + i)
    spool.flush()
    return spool


def forward(
    spool: LocalLog,
    directory: Path,
    bootstrap: str,
    topic: str,
    compression: str = "gzip",
    batch_records: int = 1000,
    configs: dict[str, str] | None = None,
) -> KafkaForwarder:
    """A forwarder of `spool` sending until the spool is drained (at most 60 s), to a topic
    made with these `configs`."""

    async def run() -> KafkaForwarder:
        await create_topic(bootstrap, topic, partitions=1, configs=configs)
        settings = ProducerSettings(
            bootstrap, topic=topic, compression=compression, batch_records=batch_records
        )
        fwd = KafkaForwarder(settings, spool, directory)
        try:
            async with asyncio.timeout(60):
                while fwd.depth():
                    await fwd.forward_once()
        finally:
            await fwd.drain(5)
        return fwd

    return asyncio.run(run())


def on_topic(bootstrap: str, topic: str) -> list[bytes]:
    return [m.value for m in asyncio.run(consume_plain(topic, bootstrap_servers=bootstrap))]


def test_an_event_too_large_for_kafka_is_skipped_and_counted(
    tmp_path: Path, kafka_bootstrap: str, kafka_topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    """aiokafka refuses a record over max_request_size (1 MiB) before sending it: no retry can
    send it, so it must not hold back everything spooled after it."""
    huge = b"x" * (1 << 20)
    values = [b"first", huge, b"second", b"third"]
    spool = spool_of(tmp_path, values)
    with caplog.at_level(logging.ERROR, logger="collector.transport.kafka"):
        fwd = forward(spool, tmp_path, kafka_bootstrap, kafka_topic)
    assert on_topic(kafka_bootstrap, kafka_topic) == [b"first", b"second", b"third"]
    assert (fwd.stats.sent, fwd.stats.too_large, fwd.stats.send_failures) == (3, 1, 0)
    assert LogReader(tmp_path).committed(FORWARDER_GROUP) == (4, "")
    assert [r.getMessage() for r in caplog.records] == [
        f"spooled event at offset 1 is {len(huge)} bytes, more than a Kafka request may carry "
        "(max_request_size): skipped"
    ]


def test_an_event_the_broker_refuses_as_too_large_is_skipped_and_counted(
    tmp_path: Path, kafka_bootstrap: str, kafka_topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The broker refuses a batch over the topic's max.message.bytes (once compressed, which
    the producer's own check, before compression, does not see): its batch was retried for
    good, nothing after it was ever sent, and the spool filled. The batch's first record not
    acknowledged is sent alone: three that fit only apart go out, the one that fits alone in
    no request is skipped and counted, and what follows it goes out."""
    piece = [random.randbytes(1500) for _ in range(3)]  # (not compressible)
    huge = random.randbytes(8000)
    values = [*piece, huge, b"last"]
    spool = spool_of(tmp_path, values)
    with caplog.at_level(logging.ERROR, logger="collector.transport.kafka"):
        fwd = forward(spool, tmp_path, kafka_bootstrap, kafka_topic,
                      configs={"max.message.bytes": "4000"})  # fmt: skip
    assert on_topic(kafka_bootstrap, kafka_topic) == [*piece, b"last"]
    assert (fwd.stats.sent, fwd.stats.too_large) == (4, 1)
    assert LogReader(tmp_path).committed(FORWARDER_GROUP) == (5, "")
    assert [r.getMessage() for r in caplog.records] == [
        "spooled event at offset 3 (8000 bytes) is refused by the broker as too large "
        "(MessageSizeTooLargeError): skipped"
    ]


def test_a_record_carries_the_send_time_or_its_events_time_when_later(
    tmp_path: Path, kafka_bootstrap: str, kafka_topic: str
) -> None:
    """The aggregator refuses an event more than max_skew after its record time. The Kafka
    client stamps the send time: after the node's clock stepped back 600 s, every event (whose
    time does not step back) was refused as from the future. A spool drained after an outage
    still says when it was sent (the aggregator's idle rule and a replay of it need that)."""
    before = int(time.time() * 1000)
    times = [before - 2 * 86_400_000, before - 1, before + 600_000, before + 50 * 60_000]
    spool = LocalLog(tmp_path)
    for i, ts in enumerate(times):
        spool.append(KEY, b"e%d" % i, ts)
    fwd = forward(spool, tmp_path, kafka_bootstrap, kafka_topic)
    after = int(time.time() * 1000)
    got = asyncio.run(consume_plain(kafka_topic, bootstrap_servers=kafka_bootstrap))
    assert [(m.value, m.timestamp_type) for m in got] == [(b"e%d" % i, 0) for i in range(4)]
    assert all(before <= m.timestamp <= after for m in got[:2])  # sent now: the send time
    assert [m.timestamp for m in got[2:]] == times[2:]  # ahead of the send time: their own
    assert (fwd.stats.sent, fwd.stats.unstamped) == (4, 0)


def test_a_time_the_broker_refuses_turns_the_collector_to_send_times(
    tmp_path: Path, kafka_bootstrap: str, kafka_topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Two hours ahead of the broker's clock is past message.timestamp.after.max.ms (an hour
    by default): refused, and sent as it is it would be refused for ever, holding up
    everything spooled after it, and so would every later batch (the node's event time stays
    ahead by the step). From the refusal on, records carry the send time (the aggregator then
    refuses the events ahead of it as future events, counted per node): one refused send, one
    line."""
    now = int(time.time() * 1000)
    times = [now - 1000, now + 2 * 3_600_000, now + 2 * 3_600_000 + 1, now + 2 * 3_600_000 + 2]
    spool = LocalLog(tmp_path)
    for i, ts in enumerate(times):
        spool.append(KEY, b"e%d" % i, ts)
    with caplog.at_level(logging.WARNING, logger="collector.transport.kafka"):
        fwd = forward(spool, tmp_path, kafka_bootstrap, kafka_topic, batch_records=1)
    after = int(time.time() * 1000)
    got = asyncio.run(consume_plain(kafka_topic, bootstrap_servers=kafka_bootstrap))
    assert [m.value for m in got] == [b"e0", b"e1", b"e2", b"e3"]
    assert all(now <= m.timestamp <= after for m in got)  # all sent with the send time
    assert (fwd.stats.sent, fwd.stats.unstamped, fwd.stats.send_failures) == (4, 3, 1)
    assert [r.getMessage() for r in caplog.records] == [
        "kafka refused an event's own time (more than the topic's "
        "message.timestamp.after.max.ms ahead of the broker's clock: the node's clock stepped "
        "back?); this collector now stamps its records with the send time until it restarts, "
        "and the aggregator refuses those of the events ahead of it as future events"
    ]


def test_a_spool_that_ends_below_its_checkpoint_is_sent_from_its_end(
    tmp_path: Path, kafka_bootstrap: str, kafka_topic: str
) -> None:
    """The checkpoint is fsync'd, the segments are not: after a power loss the spool can end
    below it. What is appended after the restart (at offsets the broker never had) is sent."""
    spool = spool_of(tmp_path, [b"old-%d" % i for i in range(10)])
    LogReader(tmp_path).commit(FORWARDER_GROUP, 10)  # the broker had all ten
    spool.close()
    for base in list_segments(tmp_path):
        (tmp_path / segment_name(base)).write_bytes(b"")  # the page cache, lost
    spool = spool_of(tmp_path, [b"new-%d" % i for i in range(3)])  # appended before it starts
    assert (spool.opened_end, spool.next_offset) == (0, 3)
    fwd = forward(spool, tmp_path, kafka_bootstrap, kafka_topic)
    assert on_topic(kafka_bootstrap, kafka_topic) == [b"new-0", b"new-1", b"new-2"]
    assert (fwd.stats.sent, fwd.depth()) == (3, 0)
    assert LogReader(tmp_path).committed(FORWARDER_GROUP) == (3, "")


def test_compression_none_sends(tmp_path: Path, kafka_bootstrap: str, kafka_topic: str) -> None:
    """`compression = "none"` (README: gzip snappy lz4 zstd none) is no compression to
    aiokafka, not a name it refuses (which stopped the forwarder for good)."""
    spool = spool_of(tmp_path, [b"a", b"b"])
    fwd = forward(spool, tmp_path, kafka_bootstrap, kafka_topic, "none")
    assert on_topic(kafka_bootstrap, kafka_topic) == [b"a", b"b"]
    assert (fwd.stats.sent, fwd.stats.send_failures) == (2, 0)


def test_tls_files_that_go_bad_are_retried_until_fixed(tmp_path: Path) -> None:
    """The CA file is replaced by one that cannot be loaded while the forwarder retries (a
    Secret being rotated): a refusal, counted and retried, so fixing the file is enough; the
    forwarder never stops. (The broker address answers nothing: no broker is needed.)"""
    ca = tmp_path / "ca.pem"
    good = Path(certifi.where()).read_bytes()  # a CA bundle (certifi: kubernetes-asyncio's)
    ca.write_bytes(good)
    security = KafkaSecurity(protocol="SSL", ca_file=str(ca))
    spool = spool_of(tmp_path / "spool", [b"a"])

    async def run() -> tuple[bool, bool, dict[str, int]]:
        fwd = KafkaForwarder(
            ProducerSettings("127.0.0.1:9", security=security), spool, tmp_path / "spool"
        )
        stop = asyncio.Event()
        task = asyncio.create_task(fwd.run(stop))
        await asyncio.sleep(1)
        ca.write_text("not a certificate\n")
        await asyncio.sleep(3)
        bad = task.done()
        ca.write_bytes(good)
        await asyncio.sleep(2)
        fixed = task.done()
        stop.set()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return bad, fixed, dict(fwd.stats.refused)

    bad, fixed, refused = asyncio.run(run())
    assert (bad, fixed) == (False, False)
    assert refused.get("certificate", 0) >= 1


def test_a_password_file_gone_at_a_reconnect_is_an_authentication_failure_of_ours(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The password file removed while the forwarder retries (a Secret mid-rotation): counted
    as `authentication`, not `certificate`, and logged as a file that cannot be loaded, not
    as a refusal by a broker it never reached. (The address answers nothing.)"""
    secret = tmp_path / "pw"
    secret.write_text("s3cret-value\n")
    security = KafkaSecurity(
        protocol="SASL_SSL", sasl_mechanism="PLAIN", username="u", password_file=str(secret)
    )
    secret.unlink()
    spool = spool_of(tmp_path / "spool", [b"a"])

    async def run() -> dict[str, int]:
        fwd = KafkaForwarder(
            ProducerSettings("127.0.0.1:9", security=security), spool, tmp_path / "spool"
        )
        stop = asyncio.Event()
        task = asyncio.create_task(fwd.run(stop))
        await asyncio.sleep(1.0)  # tries after 0.2 and 0.4 s
        stop.set()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return dict(fwd.stats.refused)

    with caplog.at_level(logging.INFO, logger="collector.transport.kafka"):
        refused = asyncio.run(run())
    assert set(refused) == {"authentication"} and refused["authentication"] >= 2, refused
    lines = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
    assert lines == [
        f"kafka credentials cannot be loaded, retrying: kafka_password_file {secret}: "
        "No such file or directory"
    ]


def test_a_spool_that_cannot_be_read_for_a_while_is_waited_out(
    tmp_path: Path, kafka_bootstrap: str, kafka_topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Out of descriptors for a while (a real limit: EMFILE listing the spool): each failed
    read is counted and retried, the episode is logged when it begins and when it ends, and
    what was spooled meanwhile is sent. The error used to end the forwarder's task, silently
    until shutdown, while the spool grew."""
    spool = spool_of(tmp_path, [b"a"])

    async def run() -> tuple[KafkaForwarder, str | None, bool]:
        await create_topic(kafka_bootstrap, kafka_topic, partitions=1)
        fwd = KafkaForwarder(ProducerSettings(kafka_bootstrap, topic=kafka_topic), spool, tmp_path)
        stop = asyncio.Event()
        task = asyncio.create_task(fwd.run(stop))
        try:
            async with asyncio.timeout(60):
                while fwd.stats.sent < 1:
                    await asyncio.sleep(0.05)
                with no_descriptor_left():
                    for v in (b"b", b"c"):
                        spool.append(KEY, v, 1_700_000_000_100)
                    spool.flush()
                    fwd.wake()
                    while fwd.stats.spool_read_errors < 2:  # (one retry)
                        await asyncio.sleep(0.05)
                    during, ended = fwd.spool_unreadable, task.done()
                while fwd.depth():
                    await asyncio.sleep(0.05)
        finally:
            stop.set()
            fwd.wake()
            await asyncio.wait({task}, timeout=10)
            await fwd.drain(5)  # (and the producer stopped, whatever happened)
        await task
        return fwd, during, ended

    with caplog.at_level(logging.INFO, logger="collector.transport.kafka"):
        fwd, during, ended = asyncio.run(run())
    assert (during, ended) == ("Too many open files", False)
    assert on_topic(kafka_bootstrap, kafka_topic) == [b"a", b"b", b"c"]
    assert (fwd.stats.sent, fwd.stats.spool_read_errors, fwd.spool_unreadable) == (3, 2, None)
    assert LogReader(tmp_path).committed(FORWARDER_GROUP) == (3, "")
    said = [r.getMessage() for r in caplog.records if r.name == "collector.transport.kafka"]
    assert said[0] == (
        f"kafka forwarder cannot read the spool {tmp_path} (Too many open files): events stay "
        "spooled, retrying"
    )
    assert re.fullmatch(
        r"kafka forwarder reads the spool again after \d+\.\d s: 2 failed reads "
        r"\(Too many open files\)",
        said[1],
    ), said
    assert len(said) == 2, said
