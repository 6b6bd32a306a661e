"""The billing topic for any consumer, provisioned topics, and where a fresh group starts,
against the real (plaintext) broker; kcat is the consumer that knows nothing of this project."""

from __future__ import annotations

import asyncio
import csv
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import jsonschema
import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from streams import (
    WINDOW_FLAGS,
    build,
    committed_metadata,
    consume_plain,
    create_topic,
    final_report,
    hami,
    produce,
    read_csv,
    recent_t0,
)

from collector.aggregate.records import CSV_FIELDS, iso_utc

pytestmark = pytest.mark.kafka

REPO = Path(__file__).resolve().parent.parent
BILLING_SCHEMA = json.loads((REPO / "schemas" / "billing.schema.json").read_text())
DAY_MS = 86_400_000


def kcat() -> str:
    """kcat, installed by the repository's installer when missing (never skipped)."""
    if shutil.which("kcat") is None:
        subprocess.run(["bash", str(REPO / "scripts" / "install-debs.sh")], check=True)
    path = shutil.which("kcat")
    assert path, "scripts/install-debs.sh did not install kcat"
    return path


def readme_command(topic_kind: str) -> str:
    """The kcat command line of the README's "Consuming the billing topic" for a topic."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Consuming the billing topic", 1)[1].split("\n## ", 1)[0]
    lines = [ln for ln in section.splitlines() if ln.startswith("kcat ") and topic_kind in ln]
    assert len(lines) == 1, lines
    return lines[0]


def run_readme(command: str, bootstrap: str, topic: str, default_topic: str) -> bytes:
    assert "localhost:9092" in command and default_topic in command
    line = command.replace("localhost:9092", bootstrap).replace(default_topic, topic)
    kcat()
    # As a user runs it: `hami-usage` on the PATH (the venv's bin).
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    proc = subprocess.run(
        ["bash", "-c", line],
        capture_output=True,
        timeout=60,
        check=False,
        env={**os.environ, "PATH": path},
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def csv_rows(lines: list[str]) -> list[dict[str, str]]:
    return list(csv.DictReader(lines, fieldnames=CSV_FIELDS))


def topic_flags(bootstrap: str, usage: str, billing: str, partitions: int = 2) -> list[str]:
    return [
        "--kafka", bootstrap, "--topic", usage, "--billing-topic", billing,
        "--usage-partitions", str(partitions), "--billing-partitions", "1",
        "--replication-factor", "1", "--min-insync-replicas", "1",
    ]  # fmt: skip


@pytest.fixture
def names(kafka_bootstrap: str) -> dict[str, str]:
    suffix = uuid.uuid4().hex[:10]
    return {"usage": f"hami.usage.t-{suffix}", "billing": f"hami.billing.t-{suffix}"}


def test_topics_prints_creates_and_checks(kafka_bootstrap: str, names: dict[str, str]) -> None:
    flags = topic_flags(kafka_bootstrap, names["usage"], names["billing"])
    want_usage = (
        f"want {names['usage']}: partitions=2 replication.factor=1 cleanup.policy=delete "
        f"min.insync.replicas=1 retention.ms={400 * DAY_MS}\n"
    )
    want_billing = (
        f"want {names['billing']}: partitions=1 replication.factor=1 cleanup.policy=compact "
        "min.insync.replicas=1 retention.ms=-1\n"
    )
    before = hami("topics", *flags)
    assert before.returncode == 1, before.stderr
    missing = "  differs: missing\n"
    assert before.stdout == want_usage + missing + want_billing + missing
    applied = hami("topics", *flags, "--apply")
    assert applied.returncode == 0, applied.stderr
    assert applied.stdout == (
        f"created {names['usage']}\ncreated {names['billing']}\n"
        + want_usage + "  ok\n" + want_billing + "  ok\n"
    )  # fmt: skip
    again = hami("topics", *flags, "--apply")  # idempotent: creates nothing, checks
    assert again.returncode == 0 and "created" not in again.stdout, again.stdout
    other = hami("topics", *topic_flags(kafka_bootstrap, names["usage"], names["billing"], 3))
    assert other.returncode == 1
    assert (
        "  differs: partitions=2, want 3 (do not add partitions to a topic in use: its keys "
        "would move to other partitions, the usage topic's windows billed twice; keep it, or "
        "move to a new topic: see the README's Topics)\n"
    ) in other.stdout
    bad = hami("topics", *flags[:-1], "2")  # (its last flag: --min-insync-replicas 1)
    assert bad.returncode == 2
    assert bad.stderr == (
        "hami-usage topics: invalid setting min_insync_replicas: 2 is more than "
        "replication_factor 1\n"
    )


def test_services_started_before_the_topics_job_create_their_topics_as_planned(
    kafka_bootstrap: str, names: dict[str, str], tmp_path: Path
) -> None:
    """kustomize applies the workloads and the topics Job together, and Helm's hook runs the
    Job after them. A broker that creates topics on first use (Kafka's default, and this test
    broker's) gave the collector's first send a usage topic of the broker's partitions, kept
    7 days, and the aggregator's first transaction a billing topic that deletes after 7 days
    (not compacted, not kept): the Job then found both wrong and exited 1. The services now
    create a missing topic as `[topics]` plans it."""
    config = tmp_path / "config.toml"
    config.write_text(
        "[topics]\nusage_partitions = 2\nbilling_partitions = 1\nreplication_factor = 1\n"
        "min_insync_replicas = 1\n"
    )
    root = tmp_path / "root"
    root.mkdir()
    collect = hami(
        "collect", "--config", config, "--kafka", kafka_bootstrap, "--topic", names["usage"],
        "--root", root, "--log", tmp_path / "spool", "--node", "n1", "--max-scans", "2",
        "--interval", "0.1", "--no-nvml", "--metrics-port", "0",
    )  # fmt: skip
    assert collect.returncode == 0, collect.stderr
    assert f"created topic {names['usage']} as [topics] plans it" in collect.stderr
    drain = hami(
        "aggregate", "--config", config, "--kafka", kafka_bootstrap, "--topic", names["usage"],
        "--billing-topic", names["billing"], "--group", f"g-{names['usage']}",
        *WINDOW_FLAGS, "--csv", tmp_path / "billing.csv", "--drain",
    )  # fmt: skip
    assert drain.returncode == 0, drain.stderr
    assert f"created topic {names['billing']} as [topics] plans it" in drain.stderr
    assert "missing" not in collect.stderr + drain.stderr
    job = hami("topics", "--config", config, "--kafka", kafka_bootstrap, "--topic", names["usage"],
               "--billing-topic", names["billing"], "--apply")  # fmt: skip
    assert job.returncode == 0, job.stdout
    assert "created" not in job.stdout and job.stdout.count("  ok\n") == 2, job.stdout


def test_a_topic_the_broker_refuses_does_not_hide_the_one_it_created(
    kafka_bootstrap: str, names: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """One CreateTopics answer refuses one topic (a Create ACL on one name only; here a config
    the broker refuses) and creates the other: the service said it could create neither and
    took the created one for missing."""
    from collector.transport.security import KafkaSecurity
    from collector.transport.topics import TopicSpec, check

    good = TopicSpec(names["usage"], 2, 1, {"min.insync.replicas": "1"})
    bad = TopicSpec(names["billing"], 1, 1, {"min.insync.replicas": "0"})
    caplog.set_level(logging.INFO, logger="collector.transport.topics")
    found = asyncio.run(check(kafka_bootstrap, KafkaSecurity(), [good, bad]))
    assert found == {good.name: [], bad.name: ["missing"]}
    lines = [r.getMessage() for r in caplog.records]
    assert f"created topic {good.name} as [topics] plans it (it did not exist)" in lines
    (refused,) = [ln for ln in lines if ln.startswith("could not create")]
    assert refused.startswith(f"could not create the missing topic {bad.name} as planned (")


def test_billing_topic_for_any_consumer(
    kafka_bootstrap: str, names: dict[str, str], tmp_path: Path
) -> None:
    created = hami(
        "topics", *topic_flags(kafka_bootstrap, names["usage"], names["billing"]), "--apply"
    )
    assert created.returncode == 0, created.stdout + created.stderr
    t0 = recent_t0(300)
    msgs = build(tmp_path / "nodes", t0)
    asyncio.run(produce(kafka_bootstrap, names["usage"], msgs))

    def aggregate(group: str, *extra: str) -> tuple[list[str], str]:
        csv = tmp_path / f"{group}.csv"
        proc = hami(
            "aggregate", "--kafka", kafka_bootstrap, "--topic", names["usage"],
            "--billing-topic", names["billing"], "--group", f"{names['usage']}.{group}",
            *WINDOW_FLAGS, "--csv", csv, "--drain", *extra,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return read_csv(csv), proc.stderr

    first, stderr = aggregate("g1")
    # The start-up check: the test topics are smaller than the default plan.
    assert f"topic {names['usage']}: partitions=2, want 6" in stderr
    assert first

    # Plain consumers: kcat as the README says, and aiokafka without project code.
    out = run_readme(
        readme_command("hami.billing.v1"), kafka_bootstrap, names["billing"], "hami.billing.v1"
    )
    records = [json.loads(line) for line in out.decode().splitlines()]
    for record in records:
        jsonschema.validate(record, BILLING_SCHEMA)
    assert {r["record_id"] for r in records} == {row["record_id"] for row in csv_rows(first)}
    assert len(records) == len(first)
    raw = asyncio.run(consume_plain(names["billing"], bootstrap_servers=kafka_bootstrap))
    for m in raw:
        assert m.key == json.loads(m.value)["record_id"].encode()
        assert dict(m.headers) == {
            "content-type": b"application/json",
            "schema": b"hami.billing.v1",
        }

    # A second group re-bills the same usage: the same records, the same ids (the duplicate
    # contract: consumers and compaction keep one per record_id).
    second, _ = aggregate("g2")
    assert sorted(second) == sorted(first)
    again = asyncio.run(consume_plain(names["billing"], bootstrap_servers=kafka_bootstrap))
    assert len(again) == 2 * len(records)
    assert {m.key for m in again} == {m.key for m in raw}

    # A fresh group that starts at the end bills nothing already there; one that starts at a
    # time bills only from there on.
    latest, stderr = aggregate("g3", "--start-from", "latest")
    assert latest == [] and final_report(stderr)[0] == 0
    # A time inside a window: from the next window on, the very records (and ids) of the first
    # group; the window it falls in is not published from part of its input under its id.
    cut = t0 + 3 * 60_000 + 30_000
    later, _ = aggregate("g4", "--start-from", iso_utc(cut))
    assert later and min(ln.split(",")[0] for ln in later) == iso_utc(t0 + 4 * 60_000)
    assert set(later) == {ln for ln in first if ln.split(",")[0] >= iso_utc(cut)}
    # (before 1970 is every record's: Kafka takes no negative time, and it was a traceback)
    old, _ = aggregate("g5", "--start-from", "1960-01-01T00:00:00Z")
    assert sorted(old) == sorted(first)

    # Usage events through kcat and `hami-usage decode`: every message, with field names.
    decoded = run_readme(
        readme_command("hami.usage.v1"), kafka_bootstrap, names["usage"], "hami.usage.v1"
    )
    events = [json.loads(line) for line in decoded.decode().splitlines()]
    assert len(events) == len([m for m in msgs if m.event is not None])
    kinds = {type(m.event).__name__ for m in msgs if m.event is not None}
    assert {e["kind"] for e in events} == kinds
    sample = next(e for e in events if e["kind"] == "UsageSample")
    assert set(sample) == {"kind", "v", "inc", "seq", "ts", "cid", "rows"}
    assert set(sample["rows"][0]) >= {"pid", "hostpid", "device", "total", "sm_util"}


def test_start_from_is_checked(tmp_path: Path) -> None:
    proc = hami("aggregate", "--kafka", "127.0.0.1:1", "--start-from", "yesterday")
    assert proc.returncode == 2
    assert re.fullmatch(
        r"hami-usage aggregate: --start-from 'yesterday': not an ISO-8601 time "
        r"\(or earliest, latest\)\n",
        proc.stderr,
    )


def test_differences_name_each_mismatch_and_the_impossible_min_isr() -> None:
    from collector.transport.topics import TopicPlan, TopicState, differences

    plan = TopicPlan("u", "b", 6, 3, 3, 2, 400)
    billing = plan.billing()
    assert differences(billing, None) == ["missing"]
    same = TopicState(3, 3, dict(billing.configs))
    assert differences(billing, same) == []
    # A single broker with a cluster default of min.insync.replicas=2: what makes acks=all
    # writes fail with NotEnoughReplicas and aiokafka retry for ever.
    auto = TopicState(3, 1, {"cleanup.policy": "delete", "min.insync.replicas": "2"})
    assert differences(billing, auto) == [
        "replication.factor=1, want 3",
        "cleanup.policy=delete, want compact",
        "retention.ms=None, want -1",
        "min.insync.replicas=2 > replication.factor=1: no write can succeed (NotEnoughReplicas)",
    ]


def test_records_the_billing_topic_refuses_stop_the_aggregator_uncommitted(
    kafka_bootstrap: str, names: dict[str, str], tmp_path: Path
) -> None:
    """A billing topic whose max.message.bytes refuses the batches: aiokafka fails those
    records only, and the transaction committed the offsets without them (nothing on the
    billing topic, exit 0, nothing said)."""

    async def setup() -> None:
        await create_topic(kafka_bootstrap, names["usage"], 1)
        admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
        await admin.start()
        try:
            small = {"cleanup.policy": "compact", "max.message.bytes": "300"}
            await admin.create_topics([NewTopic(names["billing"], 1, 1, topic_configs=small)])
        finally:
            await admin.close()
        await produce(kafka_bootstrap, names["usage"], build(tmp_path / "nodes", recent_t0(300)))

    asyncio.run(setup())
    group = f"{names['usage']}.g"
    proc = hami(
        "aggregate", "--kafka", kafka_bootstrap, "--topic", names["usage"],
        "--billing-topic", names["billing"], "--group", group, *WINDOW_FLAGS, "--drain",
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("hami-usage aggregate: Kafka: "), last
    assert "MessageSizeTooLarge" in last, last
    # (its start commits where it begins; nothing after that)
    committed = asyncio.run(committed_metadata(kafka_bootstrap, group))
    assert {p: offset for p, (offset, _) in committed.items()} == {0: 0}
