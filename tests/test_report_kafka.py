"""`hami-usage report --kafka` against the real broker: the billing topic the aggregator wrote
gives the bill its CSV and JSON Lines outputs give, to the last digit, over plaintext and over
the secured broker (SASL_SSL, mutual TLS, settings from flags, env and TOML); a wrong password,
an untrusted broker certificate and a missing ACL each end it with one line and exit 1."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import uuid
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer
from broker import SecureBroker, secure_broker
from streams import WINDOW_FLAGS, build, consume_plain, create_topic, hami, produce, recent_t0
from test_kafka_security import mtls, one_line_refusal, run, sasl

from collector.aggregate.records import iso_utc

pytestmark = pytest.mark.kafka

PRICES = 'currency = "EUR"\ndefault = 2.50\n'


def topic_flags(usage: str, billing: str) -> list[str]:
    return [
        "--topic", usage, "--billing-topic", billing, "--usage-partitions", "2",
        "--billing-partitions", "2", "--replication-factor", "1", "--min-insync-replicas", "1",
    ]  # fmt: skip


def billed(tmp: Path, producer_bootstrap: str, kafka: list[str]) -> list[str]:
    """Fresh topics (as `kafka`'s principal), two nodes' five minutes of usage produced through
    `producer_bootstrap`, and `aggregate --drain` into the billing topic, CSV and JSONL. Returns
    the report's range flags."""
    n = names(tmp)
    t0 = recent_t0(300)
    asyncio.run(produce(producer_bootstrap, n["usage"], build(tmp / "nodes", t0)))
    proc = hami(
        "aggregate", *kafka, "--topic", n["usage"], "--billing-topic", n["billing"],
        "--group", n["group"], *WINDOW_FLAGS, "--csv", tmp / "b.csv", "--jsonl", tmp / "b.jsonl",
        "--drain",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (tmp / "prices.toml").write_text(PRICES)
    return ["--from", iso_utc(t0 - 3_600_000), "--to", iso_utc(t0 + 3_600_000)]


def names(tmp: Path) -> dict[str, str]:
    suffix = uuid.uuid5(uuid.NAMESPACE_URL, str(tmp)).hex[:12]  # one set per test folder
    return {
        "usage": f"hami.usage.rk-{suffix}",
        "billing": f"hami.billing.rk-{suffix}",
        "group": f"hami-usage-rk-{suffix}",
    }


def bill(
    tmp: Path, rng: list[str], *source: str | Path, env: dict[str, str] | None = None
) -> tuple[str, str]:
    """`report --by node --by pod` with prices: its stdout and its `--out-csv`."""
    out = tmp / f"report-{uuid.uuid4().hex[:6]}.csv"
    args = [*rng, "--by", "node", "--by", "pod", "--prices", tmp / "prices.toml", "--out-csv", out]
    proc = run("report", *map(str, args), *map(str, source), env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    return proc.stdout, out.read_text()


def check_figures(report: tuple[str, str], jsonl: Path) -> None:
    """The bill's figures worked out from the records by hand: per node the container records'
    allocated GPU-seconds, and a total of every GPU's observed hours at the default price."""
    rows = list(csv.DictReader(io.StringIO(report[1])))
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert records
    per_node: dict[str, Fraction] = {}
    observed = Fraction(0)
    for r in records:
        if r["kind"] == "container":
            per_node[r["node"]] = per_node.get(r["node"], Fraction(0)) + Fraction(
                Decimal(str(r["allocated_gpu_seconds"]))
            )
        elif r["kind"] == "gpu":
            observed += Fraction(Decimal(str(r["observed_seconds"])))
    assert set(per_node) == {"node-a", "node-b"}
    for node, seconds in per_node.items():
        got = sum(Fraction(r["gpu_hours_allocated"]) for r in rows if r.get("node") == node)
        # each row rounded to 6 decimals: within half a unit per row
        assert abs(got - seconds / 3600) <= Fraction(len(rows), 2_000_000), node
    total = next(r for r in rows if r["kind"] == "total")
    cents = round(observed / 3600 * Fraction("2.50") * 100)  # half-even, like the bill
    assert Decimal(total["cost"]) == Decimal(cents).scaleb(-2)
    assert total["currency"] == "EUR"


@pytest.fixture(scope="module")
def plain(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    tmp = tmp_path_factory.mktemp("plain")
    n = names(tmp)
    proc = hami("topics", "--kafka", kafka_bootstrap, *topic_flags(n["usage"], n["billing"]),
                "--apply")  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return tmp, billed(tmp, kafka_bootstrap, ["--kafka", kafka_bootstrap])


def test_report_from_the_plaintext_billing_topic_equals_the_files(
    kafka_bootstrap: str, plain: tuple[Path, list[str]]
) -> None:
    tmp, rng = plain
    topic = names(tmp)["billing"]
    from_kafka = bill(tmp, rng, "--kafka", kafka_bootstrap, "--billing-topic", topic)
    assert from_kafka == bill(tmp, rng, "--csv", tmp / "b.csv")
    assert from_kafka == bill(tmp, rng, "--jsonl", tmp / "b.jsonl")
    check_figures(from_kafka, tmp / "b.jsonl")


def test_a_record_published_twice_is_billed_once(
    kafka_bootstrap: str, plain: tuple[Path, list[str]]
) -> None:
    """A record can be on the billing topic twice (a second group, a redeployment from
    `earliest`): `report` keeps one per record_id, as every consumer must."""
    tmp, rng = plain
    twice = f"hami.billing.twice-{uuid.uuid4().hex[:8]}"
    published = asyncio.run(consume_plain(names(tmp)["billing"], bootstrap_servers=kafka_bootstrap))
    assert published

    async def republish() -> None:
        await create_topic(kafka_bootstrap, twice, 2)
        async with AIOKafkaProducer(bootstrap_servers=kafka_bootstrap) as producer:
            for m in published + published:
                await producer.send_and_wait(twice, m.value, key=m.key, headers=list(m.headers))

    asyncio.run(republish())
    from_kafka = bill(tmp, rng, "--kafka", kafka_bootstrap, "--billing-topic", twice)
    assert from_kafka == bill(tmp, rng, "--csv", tmp / "b.csv")


def test_report_of_a_topic_that_does_not_exist_is_one_line(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    topic = f"hami.billing.none-{uuid.uuid4().hex[:8]}"
    proc = run("report", "--from", "2026-01-01", "--to", "2026-01-02", "--kafka",
               kafka_bootstrap, "--billing-topic", topic)  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr == f"hami-usage report: Kafka: topic {topic} does not exist\n"
    # and reading it did not create it with the broker's defaults
    again = run("topics", "--kafka", kafka_bootstrap, "--billing-topic", topic)
    assert f"want {topic}: " in again.stdout
    assert again.stdout.split(f"want {topic}: ", 1)[1].splitlines()[1] == "  differs: missing"


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> tuple[SecureBroker, Path, list[str]]:
    """The aggregator over SASL_SSL (SCRAM-SHA-256) wrote the billing topic; the usage was
    produced through the broker's internal listener."""
    b = secure_broker()
    tmp = tmp_path_factory.mktemp("secured")
    n = names(tmp)
    proc = run("topics", *sasl(b, "admin"), *topic_flags(n["usage"], n["billing"]), "--apply")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return b, tmp, billed(tmp, b.internal, sasl(b, "aggregator", "SCRAM-SHA-256"))


def test_report_over_sasl_ssl_and_mutual_tls_equals_the_files(
    secured: tuple[SecureBroker, Path, list[str]],
) -> None:
    b, tmp, rng = secured
    topic = ["--billing-topic", names(tmp)["billing"]]
    want = bill(tmp, rng, "--csv", tmp / "b.csv")
    # The reader's password from the environment, never a flag.
    flags = sasl(b, "reader", "SCRAM-SHA-512")
    flags = flags[: flags.index("--kafka-password-file")]
    password = b.password_file("reader").read_text()
    assert bill(tmp, rng, *flags, *topic, env={"HAMI_USAGE_KAFKA_PASSWORD": password}) == want
    # Mutual TLS, the settings in the [report] table of a TOML file.
    m = mtls(b, "reader")
    config = tmp / "report.toml"
    config.write_text(
        "[report]\nkafka_security_protocol = 'SSL'\n"
        f"kafka_ca_file = '{m[m.index('--kafka-ca-file') + 1]}'\n"
        f"kafka_cert_file = '{m[m.index('--kafka-cert-file') + 1]}'\n"
        f"kafka_key_file = '{m[m.index('--kafka-key-file') + 1]}'\n"
    )
    assert bill(tmp, rng, "--kafka", b.ssl, "--config", config, *topic) == want
    check_figures(want, tmp / "b.jsonl")


def test_report_refused_is_one_line(secured: tuple[SecureBroker, Path, list[str]]) -> None:
    b, tmp, rng = secured
    args = ["report", *rng, "--billing-topic", names(tmp)["billing"]]
    wrong = tmp / "wrong.password"
    wrong.write_text("not-the-password\n")
    flags = sasl(b, "reader")
    flags[flags.index("--kafka-password-file") + 1] = str(wrong)
    line = one_line_refusal(run(*args, *flags), "hami-usage report: Kafka refused SASL_SSL",
                            "SASL authentication failed")  # fmt: skip
    assert "not-the-password" not in line
    untrusted = sasl(b, "reader")
    untrusted[untrusted.index("--kafka-ca-file") + 1] = str(b.certs / "rogue-ca.pem")
    one_line_refusal(run(*args, *untrusted), "broker certificate not trusted")
    # The collector may write usage but not read billing.
    one_line_refusal(
        run(*args, *sasl(b, "collector")),
        f"not authorized: TopicAuthorizationFailedError {names(tmp)['billing']}",
        "an ACL is missing",
    )


def test_report_security_settings_are_checked_before_anything_starts(tmp_path: Path) -> None:
    config = tmp_path / "report.toml"
    config.write_text("[report]\nkafka_security_protocol = 'SASL_SSL'\n")
    rng = ["--from", "2026-01-01", "--to", "2026-01-02", "--kafka", "127.0.0.1:1"]
    proc = run("report", *rng, "--config", str(config))
    assert proc.returncode == 2
    assert proc.stderr == (
        "hami-usage report: kafka_security_protocol SASL_SSL needs kafka_sasl_mechanism\n"
    )


def test_collectors_ahead_of_the_aggregator_are_billed_from_the_topic(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """Windows are in the collectors' time; their records were stamped with the aggregator's
    publish time, so with collectors' clocks 13 minutes ahead every record of the range lay
    before the offset of time `from`, and `report --kafka` billed nothing where the files
    billed every GPU-hour. A record is stamped with its window's start."""
    n = names(tmp_path)
    proc = hami("topics", "--kafka", kafka_bootstrap, *topic_flags(n["usage"], n["billing"]),
                "--apply")  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    t0 = recent_t0(300) + 20 * 60_000  # (Kafka 4 refuses record times over an hour ahead)
    asyncio.run(produce(kafka_bootstrap, n["usage"], build(tmp_path / "nodes", t0)))
    proc = hami(
        "aggregate", "--kafka", kafka_bootstrap, "--topic", n["usage"], "--billing-topic",
        n["billing"], "--group", n["group"], *WINDOW_FLAGS, "--jsonl", tmp_path / "b.jsonl",
        "--drain",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    published = asyncio.run(consume_plain(n["billing"], bootstrap_servers=kafka_bootstrap))
    assert published
    assert all(m.timestamp == json.loads(m.value)["window_start_ms"] for m in published)
    (tmp_path / "prices.toml").write_text(PRICES)
    rng = ["--from", iso_utc(t0), "--to", iso_utc(t0 + 3_600_000)]
    from_kafka = bill(tmp_path, rng, "--kafka", kafka_bootstrap, "--billing-topic", n["billing"])
    assert from_kafka == bill(tmp_path, rng, "--jsonl", tmp_path / "b.jsonl")
    check_figures(from_kafka, tmp_path / "b.jsonl")
