"""Exactly once across crashes: `hami-usage aggregate --kafka` SIGKILLed at random points.

The test produces a 20-minute stream (3 nodes, a process exit, a collector restart, a container
gone) to a fresh 3-partition topic progressively, over about as long as the kills take, while
a live service (no --drain) consumes it. The service is SIGKILLed at seeded random moments -
mid-batch, mid-transaction, between the file write and the commit, whatever the moment holds -
and started again with the same group and `--instance` (the same transactional id, so the
restarted producer fences and aborts its predecessor's open transaction). A final `--drain`
pass closes the last windows. Its billing topic (read_committed) and CSV must hold exactly the
records of one uninterrupted `--drain` run over the same topic: the same record ids, the same
values, each once.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest
from broker import PrivateBroker
from streams import (
    HAMI_USAGE,
    T0_MS,
    WINDOW,
    WINDOW_FLAGS,
    Msg,
    Producer,
    Spec,
    Stream,
    create_topic,
    csv_lines,
    env,
    final_report,
    hami,
    read_billing,
    read_csv,
    recent_t0,
    reference,
    sort_key,
)

from collector.aggregate.records import BillingRecord
from collector.aggregate.windows import Aggregator

SPEC = Spec(seconds=1200, exit_at=400, restart_at=650, gone_at=900)
NODES = ("node-a", "node-b", "node-c")
KILLS = 6
SEED = 20261129
PRODUCE_S = 50.0  # wall time over which the stream is produced (restarts take ~10 s each)


class Service:
    """A live `hami-usage aggregate` process; stderr goes to a file (a pipe nobody reads
    would block it)."""

    def __init__(self, args: list[str], err: Path) -> None:
        self.err = err
        with err.open("wb") as f:
            self.proc = subprocess.Popen(
                [str(HAMI_USAGE), *args], stdout=subprocess.DEVNULL, stderr=f, env=env()
            )

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def wait_assigned(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while "Setting newly assigned partitions" not in self.stderr():
            assert self.proc.poll() is None, self.stderr()[-3000:]
            assert time.monotonic() < deadline, "no partition assignment: " + self.stderr()[-3000:]
            time.sleep(0.05)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)


def produce_progressively(bootstrap: str, topic: str, seconds: list[list[Msg]]) -> threading.Thread:
    """Send the stream second by second of event time, spread over PRODUCE_S of wall time."""
    failure: list[BaseException] = []

    async def run() -> None:
        async with Producer(bootstrap, topic) as p:
            started = time.monotonic()
            per_s = PRODUCE_S / len(seconds)
            chunk = 5
            for i in range(0, len(seconds), chunk):
                await p.send(m for batch in seconds[i : i + chunk] for m in batch)
                ahead = started + (i + chunk) * per_s - time.monotonic()
                if ahead > 0:
                    await asyncio.sleep(ahead)

    def target() -> None:
        try:
            asyncio.run(run())
        except BaseException as exc:
            failure.append(exc)
            raise

    t = threading.Thread(target=target, daemon=True)
    t.failure = failure  # type: ignore[attr-defined]
    t.start()
    return t


@pytest.mark.kafka
def test_sigkill_anywhere_gives_the_uninterrupted_records(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    began = time.monotonic()
    t0 = recent_t0(SPEC.seconds)
    seconds = list(Stream(tmp_path / "nodes", t0, SPEC, NODES).seconds())
    msgs = [m for batch in seconds for m in batch]
    asyncio.run(create_topic(kafka_bootstrap, kafka_topic, 3))

    def args(name: str, instance: str, *extra: str) -> list[str]:
        return [
            "aggregate", "--kafka", kafka_bootstrap, "--topic", kafka_topic,
            "--billing-topic", f"{kafka_topic}.{name}.billing", "--group", f"{kafka_topic}.{name}",
            "--instance", instance, *WINDOW_FLAGS, "--csv", str(tmp_path / f"{name}.csv"), *extra,
        ]  # fmt: skip

    instance = uuid.uuid4().hex[:8]
    crashed = args("crashed", instance)
    rng = random.Random(SEED)
    producer = produce_progressively(kafka_bootstrap, kafka_topic, seconds)
    svc = Service(crashed, tmp_path / "svc-0.err")
    kills: list[tuple[float, int]] = []  # (seconds after the assignment, CSV bytes) at a kill
    try:
        for k in range(KILLS):
            svc.wait_assigned()
            delay = rng.uniform(0.2, 3.0)
            time.sleep(delay)
            assert svc.proc.poll() is None, svc.stderr()[-3000:]
            svc.kill()
            csv = tmp_path / "crashed.csv"
            kills.append((round(delay, 2), csv.stat().st_size if csv.exists() else -1))
            svc = Service(crashed, tmp_path / f"svc-{k + 1}.err")
        producer.join(120)
        assert not producer.is_alive() and not producer.failure  # type: ignore[attr-defined]
        # The last live instance runs until it has seen everything, and is killed too.
        svc.wait_assigned()
        time.sleep(rng.uniform(0.5, 2.0))
    finally:
        if svc.proc.poll() is None:
            svc.kill()

    # One final --drain pass of the same group and instance closes the open windows.
    final = hami(*crashed, "--drain")
    assert final.returncode == 0, final.stderr[-3000:]
    # The reference: one uninterrupted run over the same topic.
    ref = hami(*args("reference", uuid.uuid4().hex[:8], "--drain"))
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert final_report(ref.stderr)[1]["events"] == len(msgs)

    expected = asyncio.run(read_billing(kafka_bootstrap, f"{kafka_topic}.reference.billing"))
    got = asyncio.run(read_billing(kafka_bootstrap, f"{kafka_topic}.crashed.billing"))
    expected.sort(key=sort_key)
    assert len({r.record_id for r in expected}) == len(expected)
    # The in-process Aggregator agrees with the reference run (whatever the partitioning).
    assert expected == reference(msgs)
    assert len(expected) > 3 * 2 * 3 * 20 * 0.8
    ids = [r.record_id for r in got]
    assert len(ids) == len(set(ids)), "a record was published twice"
    assert {r.record_id for r in got} == {r.record_id for r in expected}, "records missing"
    assert sorted(got, key=sort_key) == expected  # and with the same values

    # The CSV: the same lines, each once, one header.
    lines = read_csv(tmp_path / "crashed.csv")
    assert len(lines) == len(set(lines)), "a CSV line was written twice"
    assert sorted(lines) == sorted(read_csv(tmp_path / "reference.csv"))
    assert sorted(lines) == sorted(csv_lines(expected))

    # The kills fell while the service was working: some with records already written.
    assert len(kills) == KILLS
    assert sum(1 for _, size in kills if size > 300) >= 3, kills
    elapsed = time.monotonic() - began
    print(f"kills (s after assignment, CSV bytes): {kills}; {elapsed:.1f} s in all")


@pytest.mark.kafka
def test_a_replica_fenced_by_a_second_of_its_instance_stops_with_one_line(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    """Two replicas with one `--instance` (a copied StatefulSet): the second's producer
    fences the first's, whose transaction then fails with ProducerFenced. aiokafka cannot
    abort a fenced transaction and asserted on it; the assertion's 50-line traceback hid the
    reason. The same happens to a replica stopped past its transaction timeout."""
    seconds = list(Stream(tmp_path / "nodes", recent_t0(SPEC.seconds), SPEC, NODES).seconds())
    asyncio.run(create_topic(kafka_bootstrap, kafka_topic, 3))
    args = [
        "aggregate", "--kafka", kafka_bootstrap, "--topic", kafka_topic,
        "--billing-topic", f"{kafka_topic}.billing", "--group", f"{kafka_topic}.g",
        "--instance", "0", *WINDOW_FLAGS,
    ]  # fmt: skip
    producer = produce_progressively(kafka_bootstrap, kafka_topic, seconds)
    first = Service([*args, "--csv", str(tmp_path / "a.csv")], tmp_path / "a.err")
    second = None
    try:
        first.wait_assigned()
        time.sleep(3)
        second = Service([*args, "--csv", str(tmp_path / "b.csv")], tmp_path / "b.err")
        first.proc.wait(PRODUCE_S + 30)
    finally:
        for svc in (first, second):
            if svc is not None and svc.proc.poll() is None:
                svc.kill()
        producer.join(120)
    text = first.stderr()
    assert first.proc.returncode == 1, text[-3000:]
    assert "Traceback" not in text and "never retrieved" not in text, text[-3000:]
    last = text.strip().splitlines()[-1]
    assert last.startswith("hami-usage aggregate: Kafka: ProducerFenced: "), last


@pytest.mark.kafka
def test_a_broker_that_lost_its_state_stops_a_replica_with_the_reason(
    own_broker: PrivateBroker, kafka_topic: str, tmp_path: Path
) -> None:
    """The broker wiped and started again (a new cluster id) while a replica runs: its next
    transaction is refused as InvalidProducerIdMapping, which aiokafka logs with a traceback
    and raises as "Unexpected error during batch delivery". The line said only that."""
    bootstrap = own_broker.bootstrap
    seconds = iter(Stream(tmp_path / "nodes", recent_t0(SPEC.seconds), SPEC, NODES).seconds())

    async def produce(n: int) -> None:
        async with Producer(bootstrap, kafka_topic) as p:
            for _ in range(n):
                await p.send(next(seconds))

    def topics() -> None:
        for topic in (kafka_topic, f"{kafka_topic}.billing"):
            asyncio.run(create_topic(bootstrap, topic, 2))

    topics()
    asyncio.run(produce(200))
    svc = Service(
        ["aggregate", "--kafka", bootstrap, "--topic", kafka_topic,
         "--billing-topic", f"{kafka_topic}.billing", "--group", f"{kafka_topic}.g",
         *WINDOW_FLAGS],
        tmp_path / "svc.err",
    )  # fmt: skip
    try:
        svc.wait_assigned()
        time.sleep(5)  # a transaction or two
        own_broker.stop()
        shutil.rmtree(own_broker.home / "data")
        own_broker.start()  # (the topics come back as the clients ask for them)
        deadline = time.monotonic() + 120
        while svc.proc.poll() is None and time.monotonic() < deadline:
            asyncio.run(produce(5))
            time.sleep(1)
    finally:
        if svc.proc.poll() is None:
            svc.kill()
    text = svc.stderr()
    assert svc.proc.returncode == 1, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    last = text.strip().splitlines()[-1]
    assert last.startswith("hami-usage aggregate: Kafka: "), last
    assert "InvalidProducerIdMapping" in last, last


def test_restart_from_checkpoints_in_process(tmp_path: Path) -> None:
    """The service's protocol without processes, at many more crash points: commit (records
    out, checkpoint = needed offset + emitted end) at random moments, crash at others (records
    since the last commit are lost), restart a new Aggregator from the checkpoint."""
    msgs = Stream(tmp_path / "nodes", T0_MS, SPEC, NODES).messages()
    expected = reference(msgs)  # one source holding all three nodes
    rng = random.Random(SEED)
    commits = set(rng.sample(range(len(msgs)), 60))
    crashes = set(rng.sample(range(len(msgs)), 40))
    published: list[BillingRecord] = []
    tentative: list[BillingRecord] = []
    checkpoint = (0, 0)  # (offset to restart from, emitted_until_ms)
    agg = Aggregator(WINDOW)
    i = restarts = 0
    while i < len(msgs):
        m = msgs[i]
        assert m.event is not None
        agg.add(m.node, m.event, source=0, offset=i, record_ts_ms=m.ts)
        if i % 97 == 96:  # a consumer batch
            tentative += agg.advance()
        if i in commits:
            tentative += agg.advance()
            published += tentative
            tentative = []
            checkpoint = (agg.needed_offsets().get(0, i + 1), agg.emitted_until_ms)
        if i in crashes:
            crashes.discard(i)
            tentative = []
            agg = Aggregator(WINDOW, emitted_until_ms=checkpoint[1])
            i = checkpoint[0]
            restarts += 1
            continue
        i += 1
    published += tentative + agg.flush()
    assert restarts == 40
    ids = [r.record_id for r in published]
    assert len(ids) == len(set(ids)), "a window was published twice"
    published.sort(key=sort_key)
    assert published == expected
