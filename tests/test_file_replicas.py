"""CSV outputs with two aggregator replicas, SIGKILLed and restarted, against the real broker.

Two live replicas of one group (each with its own `--instance` and its own CSV file) consume a
stream produced progressively to a 3-partition topic; they are SIGKILLed in turn at seeded
random moments and started again, sometimes only after the survivor took every partition. The
checkpoint keeps each replica's committed file lengths (`service.merge_checkpoints`), so a
replica that restarts or takes partitions back cuts its own file to its own last commit. The
two files together must hold exactly the records of one uninterrupted run: each line once,
none missing, no line spliced from two.
"""

from __future__ import annotations

import asyncio
import csv
import io
import logging
import random
import time
import uuid
from pathlib import Path

import pytest
from streams import (
    WINDOW_FLAGS,
    Spec,
    Stream,
    create_topic,
    csv_lines,
    hami,
    produce,
    read_billing,
    read_csv,
    recent_t0,
    reference,
    sort_key,
)
from test_aggregate_crash import Service, produce_progressively

from collector.aggregate.records import CSV_FIELDS
from collector.transport.kafka import QuietRetries

SPEC = Spec(seconds=600, exit_at=200, restart_at=350, gone_at=450)
NODES = ("node-a", "node-b", "node-c")
SEED = 20261130


def holds_all(svc: Service) -> bool:
    """Whether the replica's latest assignment is every partition of the topic (aiokafka logs
    each assignment, and the service's log filter lets each one through)."""
    assigned = [ln for ln in svc.stderr().splitlines() if "newly assigned partitions" in ln]
    return bool(assigned) and assigned[-1].count("partition=") == 3


async def wait_group_empty(bootstrap: str, group: str, timeout_s: float = 90) -> None:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        deadline = time.monotonic() + timeout_s
        while (await admin.describe_consumer_groups([group]))[0].groups[0][2] != "Empty":
            assert time.monotonic() < deadline, f"group {group} still has members"
            await asyncio.sleep(0.5)
    finally:
        await admin.close()


@pytest.mark.kafka
def test_two_replicas_with_csv_killed_in_turn_write_each_record_once(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    t0 = recent_t0(SPEC.seconds)
    seconds = list(Stream(tmp_path / "nodes", t0, SPEC, NODES).seconds())
    msgs = [m for batch in seconds for m in batch]
    asyncio.run(create_topic(kafka_bootstrap, kafka_topic, 3))
    asyncio.run(create_topic(kafka_bootstrap, f"{kafka_topic}.billing", 1))
    group = f"{kafka_topic}.g"
    instances = {"a": uuid.uuid4().hex[:8], "b": uuid.uuid4().hex[:8]}

    def args(name: str) -> list[str]:
        return [
            "aggregate", "--kafka", kafka_bootstrap, "--topic", kafka_topic,
            "--billing-topic", f"{kafka_topic}.billing", "--group", group,
            "--instance", instances[name], *WINDOW_FLAGS, "--csv", str(tmp_path / f"{name}.csv"),
        ]  # fmt: skip

    rng = random.Random(SEED)
    producer = produce_progressively(kafka_bootstrap, kafka_topic, seconds)
    runs = {"a": 0, "b": 0}
    services = {n: Service(args(n), tmp_path / f"{n}-0.err") for n in ("a", "b")}
    took_over = 0
    try:
        for k in range(4):
            # Each replica dies in turn, mid-work. Twice the survivor takes every partition
            # (once the dead one's session expires) before the dead one comes back and takes
            # its share back - the moment a shared length used to cut the wrong file.
            name, other = "ab"[k % 2], "ba"[k % 2]
            time.sleep(rng.uniform(1.0, 3.0))
            assert services[name].proc.poll() is None, services[name].stderr()[-3000:]
            services[name].kill()
            if k < 2:
                deadline = time.monotonic() + 60
                while not holds_all(services[other]):
                    assert time.monotonic() < deadline, services[other].stderr()[-3000:]
                    time.sleep(0.1)
                took_over += 1
                time.sleep(rng.uniform(1.0, 2.0))
            runs[name] += 1
            services[name] = Service(args(name), tmp_path / f"{name}-{runs[name]}.err")
        producer.join(120)
        assert not producer.is_alive() and not producer.failure  # type: ignore[attr-defined]
        time.sleep(rng.uniform(1.0, 3.0))
    finally:
        for svc in services.values():
            if svc.proc.poll() is None:
                svc.kill()
    assert took_over == 2

    # One final --drain pass of replica a closes the last windows, once the killed members'
    # sessions have expired (a static member keeps its partitions until then, and --drain
    # drains the assignment it starts with).
    asyncio.run(wait_group_empty(kafka_bootstrap, group))
    final = hami(*args("a"), "--drain", timeout=180)
    assert final.returncode == 0, final.stderr[-3000:]

    expected = sorted(reference(msgs), key=sort_key)
    billing = asyncio.run(read_billing(kafka_bootstrap, f"{kafka_topic}.billing"))
    got = sorted(billing, key=sort_key)
    assert got == expected
    lines = read_csv(tmp_path / "a.csv") + read_csv(tmp_path / "b.csv")
    for line in lines:  # no line spliced from two halves
        (row,) = list(csv.reader(io.StringIO(line)))
        assert len(row) == len(CSV_FIELDS), line
    assert len(lines) == len(set(lines)), "a CSV line was written twice"
    assert sorted(lines) == sorted(csv_lines(expected)), "CSV lines missing"
    assert read_csv(tmp_path / "a.csv") and read_csv(tmp_path / "b.csv")


@pytest.mark.kafka
def test_a_replica_on_standby_cuts_its_files_back_at_start(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    """Replica b wrote past its last commit and crashed; restarted while replica a holds the
    only partition, it gets none. Its file is still cut back to its commit at once (it was cut
    only at its first assignment: a standby replica's uncommitted lines or Parquet parts stood
    beside the ones a recomputed)."""
    t0 = recent_t0(SPEC.seconds)
    msgs = [m for s in Stream(tmp_path / "nodes", t0, SPEC, NODES).seconds() for m in s]
    asyncio.run(create_topic(kafka_bootstrap, kafka_topic, 1))
    asyncio.run(create_topic(kafka_bootstrap, f"{kafka_topic}.billing", 1))
    asyncio.run(produce(kafka_bootstrap, kafka_topic, msgs))

    def args(name: str) -> list[str]:  # a sorts first: the round robin gives a the partition
        return [
            "aggregate", "--kafka", kafka_bootstrap, "--topic", kafka_topic,
            "--billing-topic", f"{kafka_topic}.billing", "--group", f"{kafka_topic}.g",
            "--instance", name, *WINDOW_FLAGS, "--csv", str(tmp_path / f"{name}.csv"),
        ]  # fmt: skip

    drained = hami(*args("b"), "--drain", timeout=180)
    assert drained.returncode == 0, drained.stderr[-3000:]
    b_csv = tmp_path / "b.csv"
    committed = b_csv.stat().st_size
    with b_csv.open("a") as f:
        f.write("written after the last commit,then a crash\n")
    services = [Service(args("a"), tmp_path / "a.err")]
    try:
        services[0].wait_assigned()
        services.append(Service(args("b"), tmp_path / "b.err"))
        deadline = time.monotonic() + 60
        while b_csv.stat().st_size != committed:
            assert services[1].proc.poll() is None, services[1].stderr()[-3000:]
            assert time.monotonic() < deadline, "not cut back: " + services[1].stderr()[-3000:]
            time.sleep(0.1)
    finally:
        for svc in services:
            svc.kill()
    assert "partition=" not in services[1].stderr()  # b was never assigned one


def test_the_log_shows_every_assignment_and_holds_back_repeated_warnings() -> None:
    """The service's aiokafka log filter: rebalances seconds apart each log their assignment
    (held back, a replica's log went on naming the partitions it had before the last one);
    a warning repeated while the broker is away shows once per period."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(QuietRetries(period_s=3600))
    log = logging.getLogger("aiokafka.consumer.group_coordinator")
    log.addHandler(handler)
    log.propagate = False
    level = log.level
    log.setLevel(logging.INFO)
    try:
        for parts in ("{0, 2}", "{0, 1, 2}", "{1}"):
            log.info("Setting newly assigned partitions %s for group %s", parts, "g")
        for _ in range(40):
            log.warning("Heartbeat failed for group %s because it is rebalancing", "g")
        log.error("Unable connect to node with id %s: %s", 1, "refused")
    finally:
        log.removeHandler(handler)
        log.propagate = True
        log.setLevel(level)
    assert stream.getvalue().splitlines() == [
        "Setting newly assigned partitions {0, 2} for group g",
        "Setting newly assigned partitions {0, 1, 2} for group g",
        "Setting newly assigned partitions {1} for group g",
        "Heartbeat failed for group g because it is rebalancing",
        "Unable connect to node with id 1: refused",
    ]
