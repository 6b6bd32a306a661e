"""The pipeline against the secured broker (KAFKA_SECURE=1 scripts/kafka.sh): SASL_SSL and
mutual TLS end to end with least-privilege principals, and every refusal as one clear line.

The billing topic is read back by a plain consumer that uses no project code: aiokafka, json
and jsonschema against schemas/billing.schema.json.
"""

from __future__ import annotations

import asyncio
import csv
import json
import os
import re
import ssl
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError, TopicAuthorizationFailedError
from aiokafka.protocol.admin import CreateAclsRequest
from broker import SecureBroker, secure_broker
from streams import consume_plain

from collector.aggregate.records import RECORD_VERSION

pytestmark = pytest.mark.kafka

REPO = Path(__file__).resolve().parent.parent
HAMI_USAGE = Path(sys.executable).with_name("hami-usage")
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (DEBUG|INFO|WARNING) ")
BILLING_SCHEMA = json.loads((REPO / "schemas" / "billing.schema.json").read_text())


@pytest.fixture(scope="module")
def secure() -> SecureBroker:
    return secure_broker()


def sasl(b: SecureBroker, user: str, mechanism: str = "SCRAM-SHA-512") -> list[str]:
    return [
        "--kafka", b.sasl_ssl, "--kafka-security-protocol", "SASL_SSL",
        "--kafka-ca-file", str(b.certs / "ca.pem"), "--kafka-sasl-mechanism", mechanism,
        "--kafka-username", user, "--kafka-password-file", str(b.password_file(user)),
    ]  # fmt: skip


def mtls(b: SecureBroker, user: str) -> list[str]:
    return [
        "--kafka", b.ssl, "--kafka-security-protocol", "SSL",
        "--kafka-ca-file", str(b.certs / "ca.pem"),
        "--kafka-cert-file", str(b.certs / f"{user}.pem"),
        "--kafka-key-file", str(b.certs / f"{user}.key"),
    ]  # fmt: skip


def run(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> Any:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HAMI_USAGE_")}
    return subprocess.run(
        [str(HAMI_USAGE), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**clean, **(env or {})},
        check=False,
    )


def one_line_refusal(proc: Any, *needles: str) -> str:
    """Exit 1, one line on stderr naming the cause (besides a service's timestamped log
    lines), never a traceback."""
    assert proc.returncode == 1, proc.stderr
    lines = [x for x in proc.stderr.strip().splitlines() if not LOG_LINE.match(x)]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return str(lines[0])


@pytest.fixture
def names(secure: SecureBroker) -> dict[str, str]:
    """Fresh usage and billing topics, created by `hami-usage topics --apply` as admin."""
    suffix = f"sec-{uuid.uuid4().hex[:10]}"
    n = {
        "usage": f"hami.usage.{suffix}",
        "billing": f"hami.billing.{suffix}",
        "group": f"hami-usage-{suffix}",
    }
    proc = run(
        "topics", *sasl(secure, "admin"), "--topic", n["usage"], "--billing-topic", n["billing"],
        "--usage-partitions", "2", "--billing-partitions", "2", "--replication-factor", "1",
        "--min-insync-replicas", "1", "--apply",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"created {n['usage']}\ncreated {n['billing']}\n" in proc.stdout
    return n


def ssl_context(b: SecureBroker, user: str | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(b.certs / "ca.pem"))
    if user:
        ctx.load_cert_chain(str(b.certs / f"{user}.pem"), str(b.certs / f"{user}.key"))
    return ctx


def reader_kwargs(b: SecureBroker, over: str) -> dict[str, Any]:
    """The `reader` principal, as a plain aiokafka client (no project code)."""
    if over == "mtls":
        return {
            "bootstrap_servers": b.ssl,
            "security_protocol": "SSL",
            "ssl_context": ssl_context(b, "reader"),
        }
    return {
        "bootstrap_servers": b.sasl_ssl,
        "security_protocol": "SASL_SSL",
        "ssl_context": ssl_context(b),
        "sasl_mechanism": "PLAIN",
        "sasl_plain_username": "reader",
        "sasl_plain_password": b.password_file("reader").read_text(),
    }


def check_billing_messages(messages: list[Any], csv_path: Path) -> None:
    """Each message: JSON valid against the published schema, keyed by record_id, with the
    documented headers; together they are the records the CSV output holds."""
    assert messages
    ids = set()
    for m in messages:
        record = json.loads(m.value)
        jsonschema.validate(record, BILLING_SCHEMA)
        assert m.key == record["record_id"].encode()
        assert dict(m.headers) == {
            "content-type": b"application/json",
            "schema": b"hami.billing.v1",
        }
        assert record["version"] == RECORD_VERSION
        ids.add(record["record_id"])
    with csv_path.open(newline="") as fh:
        csv_ids = {row["record_id"] for row in csv.DictReader(fh)}
    assert ids == csv_ids


def pipeline(
    tmp_path: Path,
    collector: list[str],
    aggregator: list[str],
    n: dict[str, str],
    env: dict[str, str] | None = None,
) -> Path:
    root, log, out = tmp_path / "containers", tmp_path / "spool", tmp_path / "billing.csv"
    sim = run("simulate", "--root", str(root), "--containers", "2", "--duration", "2",
              "--interval", "0.25", "--layout", "v1.2")  # fmt: skip
    assert sim.returncode == 0, sim.stderr
    col = run(
        "collect", "--root", str(root), "--log", str(log), "--node", "n1", "--no-nvml",
        "--interval", "0.2", "--heartbeat", "0.5", "--max-scans", "8", "--topic", n["usage"],
        *collector,
    )  # fmt: skip
    assert col.returncode == 0 and "refused" not in col.stderr, col.stderr
    agg = run(
        "aggregate", "--topic", n["usage"], "--billing-topic", n["billing"], "--group", n["group"],
        "--window", "1", "--lateness", "0", "--drain", "--csv", str(out), *aggregator, env=env,
    )  # fmt: skip
    assert agg.returncode == 0 and "Traceback" not in agg.stderr, agg.stderr
    for secret in (env or {}).values():
        assert secret not in agg.stderr + col.stderr
    return out


def test_pipeline_over_sasl_ssl_with_least_privilege(
    secure: SecureBroker, names: dict[str, str], tmp_path: Path
) -> None:
    # The collector's password from a file, the aggregator's from the environment.
    agg = sasl(secure, "aggregator", "SCRAM-SHA-256")
    agg = agg[: agg.index("--kafka-password-file")]
    password = secure.password_file("aggregator").read_text()
    out = pipeline(
        tmp_path, sasl(secure, "collector"), agg, names, {"HAMI_USAGE_KAFKA_PASSWORD": password}
    )
    messages = asyncio.run(
        consume_plain(
            names["billing"], group_id="billing-reader-t", **reader_kwargs(secure, "sasl")
        )
    )
    check_billing_messages(messages, out)


def test_pipeline_over_mutual_tls(
    secure: SecureBroker, names: dict[str, str], tmp_path: Path
) -> None:
    out = pipeline(tmp_path, mtls(secure, "collector"), mtls(secure, "aggregator"), names)
    messages = asyncio.run(
        consume_plain(
            names["billing"], group_id="billing-reader-m", **reader_kwargs(secure, "mtls")
        )
    )
    check_billing_messages(messages, out)


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_each_sasl_mechanism_and_a_wrong_password(
    secure: SecureBroker, names: dict[str, str], mechanism: str, tmp_path: Path
) -> None:
    flags = sasl(secure, "aggregator", mechanism)
    args = ["replay", "--topic", names["usage"], "--from", "2026-01-01T00:00:00",
            "--to", "2026-01-01T00:01:00", "--jsonl", str(tmp_path / "r.jsonl")]  # fmt: skip
    ok = run(*args, *flags)
    assert ok.returncode == 0, ok.stderr
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-password\n")
    flags[flags.index("--kafka-password-file") + 1] = str(wrong)
    line = one_line_refusal(run(*args, *flags), "SASL authentication failed", mechanism)
    assert "not-the-password" not in line


def test_a_password_file_with_a_windows_line_end_authenticates(
    secure: SecureBroker, names: dict[str, str], tmp_path: Path
) -> None:
    """A password file saved with CRLF kept its CR, and the broker refused the password."""
    crlf = tmp_path / "crlf"
    crlf.write_bytes(secure.password_file("aggregator").read_text().encode() + b"\r\n")
    flags = sasl(secure, "aggregator")
    flags[flags.index("--kafka-password-file") + 1] = str(crlf)
    span = ["--from", "2026-01-01T00:00:00", "--to", "2026-01-01T00:01:00"]
    out = ["--jsonl", str(tmp_path / "r.jsonl")]
    proc = run("replay", "--topic", names["usage"], *span, *out, *flags)
    assert proc.returncode == 0, proc.stderr


def test_an_untrusted_broker_certificate(secure: SecureBroker, tmp_path: Path) -> None:
    flags = sasl(secure, "aggregator")
    flags[flags.index("--kafka-ca-file") + 1] = str(secure.certs / "rogue-ca.pem")
    proc = run("aggregate", *flags, "--group", "hami-usage-x", "--topic", "hami.usage.none")
    one_line_refusal(proc, "broker certificate not trusted", "unable to get local issuer")


def test_an_untrusted_client_certificate(secure: SecureBroker) -> None:
    flags = mtls(secure, "collector")
    flags[flags.index("--kafka-cert-file") + 1] = str(secure.certs / "rogue.pem")
    flags[flags.index("--kafka-key-file") + 1] = str(secure.certs / "rogue.key")
    proc = run("topics", *flags)
    one_line_refusal(proc, "TLS handshake refused", "CERTIFICATE_UNKNOWN")


def test_a_tls_client_at_a_sasl_listener_is_told_what_is_wrong(secure: SecureBroker) -> None:
    """The SASL_SSL listener answers the version lookup of a client that did not authenticate
    and closes at its next request: said as a broker that never answered, with aiokafka's
    warnings unformatted around it. Now the line names the likely cause."""
    proc = run("topics", "--kafka", secure.sasl_ssl, "--kafka-security-protocol", "SSL",
               "--kafka-ca-file", str(secure.certs / "ca.pem"))  # fmt: skip
    line = one_line_refusal(proc, f"no Kafka broker at {secure.sasl_ssl} after 10 s")
    assert "closed the connection at a request (a listener that expects SASL_SSL?)" in line


@pytest.mark.parametrize("how", ["plaintext-at-tls", "tls-at-plaintext"])
def test_a_protocol_the_listener_does_not_speak_is_told_what_is_wrong(
    secure: SecureBroker, kafka_bootstrap: str, how: str
) -> None:
    """PLAINTEXT (the default, so a protocol left out) at a TLS listener, or TLS at a plaintext
    one: the listener closes or resets the connection, which read "no answer", as if no broker
    were there. The line now names the likely cause."""
    if how == "plaintext-at-tls":
        proc = run("topics", "--kafka", secure.ssl)
        line = one_line_refusal(proc, f"no Kafka broker at {secure.ssl} after 10 s")
        assert f"{secure.ssl} closed the connection (a listener that expects TLS: " in line
    else:
        proc = run("topics", "--kafka", kafka_bootstrap, "--kafka-security-protocol", "SSL",
                   "--kafka-ca-file", str(secure.certs / "ca.pem"))  # fmt: skip
        line = one_line_refusal(proc, f"no Kafka broker at {kafka_bootstrap} after 10 s")
        assert f"{kafka_bootstrap} reset the TLS handshake (a PLAINTEXT listener?)" in line


def test_a_missing_acl_stops_the_aggregator_with_one_line(
    secure: SecureBroker, names: dict[str, str], tmp_path: Path
) -> None:
    proc = run(
        "aggregate", "--topic", names["usage"], "--billing-topic", names["billing"],
        "--group", names["group"], "--drain", *sasl(secure, "nobody"), timeout=90,
    )  # fmt: skip
    one_line_refusal(proc, "not authorized", "an ACL is missing")


async def deny_write(b: SecureBroker, user: str, topic: str) -> None:
    """A DENY ACL for `user`'s Write on exactly `topic` (wire codes: TOPIC 2, LITERAL 3,
    WRITE 4, DENY 2), sent to the super-user listener: the ALLOW ACLs are prefixed, so
    this takes the right from this test's topic alone."""
    admin = AIOKafkaAdminClient(bootstrap_servers=b.internal, request_timeout_ms=10_000)
    await admin.start()
    try:
        request = CreateAclsRequest(2, topic, 3, f"User:{user}", "*", 4, 2)
        response = await admin._send_request(request)  # noqa: SLF001
        assert [r[0] for r in response.creation_responses] == [0]
    finally:
        await admin.close()


def test_an_aggregator_denied_write_on_billing_stops_with_one_line(
    secure: SecureBroker, names: dict[str, str], tmp_path: Path
) -> None:
    """Denied Write on the billing topic (an ACL taken away), the transaction fails and so
    does each record sent in it: asyncio logged each as 'Future exception was never
    retrieved', with a traceback, around the refusal's line."""
    asyncio.run(deny_write(secure, "aggregator", names["billing"]))
    with pytest.raises(AssertionError, match="an ACL is missing"):
        pipeline(tmp_path, sasl(secure, "collector"), sasl(secure, "aggregator"), names)
    agg = run(
        "aggregate", "--topic", names["usage"], "--billing-topic", names["billing"],
        "--group", names["group"], "--window", "1", "--lateness", "0", "--drain",
        *sasl(secure, "aggregator"), timeout=90,
    )  # fmt: skip
    line = one_line_refusal(agg, "not authorized", names["billing"], "an ACL is missing")
    assert "never retrieved" not in agg.stderr
    assert line.startswith("hami-usage aggregate: Kafka refused: not authorized: ")


def test_an_aggregator_whose_billing_topic_does_not_exist_names_it(
    secure: SecureBroker, names: dict[str, str], tmp_path: Path
) -> None:
    """A broker that does not create topics on first use (this one, as production brokers
    often are) and no billing topic: the line said `[Error 3] UnknownTopicOrPartitionError`,
    naming no topic."""
    missing = f"{names['billing']}-missing"
    with pytest.raises(AssertionError) as failed:  # (the aggregator's stderr)
        pipeline(tmp_path, sasl(secure, "collector"), sasl(secure, "aggregator"),
                 dict(names, billing=missing))  # fmt: skip
    stderr = str(failed.value)
    assert "Traceback" not in stderr
    # (besides aiokafka's own log lines, ERROR, of the metadata requests that missed it)
    line = (
        f"hami-usage aggregate: Kafka: billing topic {missing} is not in the broker's metadata: "
        "it does not exist (`hami-usage topics --apply` creates it) or the broker did not answer"
    )
    assert line in map(str.strip, stderr.splitlines())


def collect(tmp_path: Path, names: dict[str, str], *flags: str) -> tuple[Any, Path]:
    """A collector of an empty root sending to the usage topic, its stderr in a file."""
    root = tmp_path / "containers"
    root.mkdir()
    err_path = tmp_path / "err"
    with err_path.open("wb") as err:
        proc = subprocess.Popen(
            [str(HAMI_USAGE), "collect", "--root", str(root), "--log", str(tmp_path / "spool"),
             "--node", "n1", "--no-nvml", "--interval", "0.2", "--topic", names["usage"],
             *flags],
            stderr=err, stdout=subprocess.DEVNULL,
        )  # fmt: skip
    return proc, err_path


def refused(proc: Any, err_path: Path) -> None:
    """Until the running collector logs a refusal (at most 60 s)."""
    deadline = time.monotonic() + 60
    while "kafka refused the collector" not in err_path.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()
        time.sleep(0.2)


def test_a_refused_collector_logs_counts_and_retries(
    secure: SecureBroker, names: dict[str, str], tmp_path: Path
) -> None:
    """A running service does not exit: one log line per refusal kind and period, a metric,
    and its events stay spooled until the credentials are fixed."""
    proc, port_file = collect(tmp_path, names, "--metrics-port", "0", *sasl(secure, "nobody"))
    try:
        refused(proc, port_file)
        text = port_file.read_text()
        assert "not authorized" in text and "Traceback" not in text, text
        assert proc.poll() is None  # still running, retrying
        port = int(re.findall(r"metrics on [^:\s]*:(\d+)/metrics", text)[0])
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
        assert re.search(r'hami_usage_kafka_refused_total\{reason="authorization"\} [1-9]', body)
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_topic_the_collector_may_not_write_is_retried_with_back_off(
    secure: SecureBroker, names: dict[str, str], tmp_path: Path
) -> None:
    """Connected, but each batch refused at send time (no Write ACL on the topic: here the
    billing topic): retried after 0.2 s doubling to 5 s, with one ERROR line. It was retried at
    every scan (every 0.2 s here), each time with a new connection and an ERROR line."""
    usage_is_billing = {**names, "usage": names["billing"]}
    proc, err_path = collect(tmp_path, usage_is_billing, "--metrics-port", "0",
                             *sasl(secure, "collector"))  # fmt: skip
    try:
        refused(proc, err_path)
        time.sleep(8)  # back-off 0.2 + 0.4 + 0.8 + 1.6 + 3.2 s: five more tries at most
        text = err_path.read_text()
        port = int(re.findall(r"metrics on [^:\s]*:(\d+)/metrics", text)[0])
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
        (count,) = re.findall(
            r'hami_usage_kafka_refused_total\{reason="authorization"\} (\S+)', body
        )
        assert 2 <= float(count) <= 7, count
        assert text.count("kafka refused the collector, retrying: ") == 1, text
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_password_file_fixed_in_place_is_used_at_the_next_retry(
    secure: SecureBroker, names: dict[str, str], tmp_path: Path
) -> None:
    """The kubelet updates a mounted Secret in place: the collector, refused for a wrong
    password, reads the file again at each retry (it kept the first one until restarted)."""
    password = tmp_path / "password"
    password.write_text("wrong-password\n")
    flags = sasl(secure, "collector")
    flags[flags.index("--kafka-password-file") + 1] = str(password)
    proc, err_path = collect(tmp_path, names, "--heartbeat", "1", *flags)
    try:
        refused(proc, err_path)
        assert "authentication" in err_path.read_text().lower()
        time.sleep(3)  # tries after 0.2, 0.4, 0.8 and 1.6 s: one line for them all
        assert err_path.read_text().count("kafka refused the collector, retrying: ") == 1
        password.write_text(secure.password_file("collector").read_text())
        deadline = time.monotonic() + 90
        while True:
            got = asyncio.run(consume_plain(names["usage"], bootstrap_servers=secure.internal))
            if got:
                break
            assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()
            time.sleep(1)
        assert {m.key for m in got} == {b"n1"}
        text = err_path.read_text()
        (tries,) = re.findall(r"kafka takes the collector's connection again after (\d+) f", text)
        assert int(tries) >= 3, text
        assert text.count("kafka refused the collector, retrying: ") == 1, text
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_refusal_after_a_password_file_that_could_not_be_read_is_logged(
    secure: SecureBroker, names: dict[str, str], tmp_path: Path
) -> None:
    """Three episodes of one kind (`authentication`), each its own line: the broker refuses
    the password, the file cannot be read (no broker asked), the broker refuses again. The
    third was hidden behind the second's line for up to 5 minutes."""
    password = tmp_path / "password"
    password.write_text("wrong-password\n")
    flags = sasl(secure, "collector")
    flags[flags.index("--kafka-password-file") + 1] = str(password)
    proc, err_path = collect(tmp_path, names, *flags)

    def lines() -> list[str]:
        text = err_path.read_text()
        return re.findall(r"kafka (refused the collector|credentials cannot be loaded)", text)

    def until(count: int) -> None:
        deadline = time.monotonic() + 60
        while len(lines()) < count:
            assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()
            time.sleep(0.1)

    try:
        until(1)
        password.unlink()
        until(2)
        password.write_text("wrong-password\n")
        until(3)
        assert lines() == [
            "refused the collector", "credentials cannot be loaded", "refused the collector"
        ]
    finally:
        proc.terminate()
        proc.wait(30)


def test_each_principal_has_only_its_own_rights(
    secure: SecureBroker, names: dict[str, str]
) -> None:
    async def produce(kwargs: dict[str, Any], topic: str) -> None:
        producer = AIOKafkaProducer(request_timeout_ms=10_000, **kwargs)
        await producer.start()
        try:
            await producer.send_and_wait(topic, b"x")
        finally:
            await producer.stop()

    async def read(kwargs: dict[str, Any], topic: str) -> None:
        consumer = AIOKafkaConsumer(**kwargs)
        await consumer.start()
        try:
            consumer.assign([TopicPartition(topic, 0)])
            await consumer.seek_to_beginning()
            await consumer.getmany(timeout_ms=2000)
            await consumer.getmany(timeout_ms=2000)
        finally:
            await consumer.stop()

    def client(user: str) -> dict[str, Any]:
        return {
            "bootstrap_servers": secure.ssl,
            "security_protocol": "SSL",
            "ssl_context": ssl_context(secure, user),
        }

    async def main() -> None:
        await produce(client("collector"), names["usage"])  # allowed
        with pytest.raises(TopicAuthorizationFailedError):
            await produce(client("collector"), names["billing"])
        with pytest.raises(KafkaError):
            await read(client("collector"), names["usage"])
        with pytest.raises(TopicAuthorizationFailedError):
            await produce(client("aggregator"), names["usage"])
        await read(client("aggregator"), names["usage"])  # allowed
        with pytest.raises(KafkaError):
            await read(client("aggregator"), names["billing"])

    asyncio.run(main())


def test_topics_without_describe_configs_says_so_not_differences(
    secure: SecureBroker, names: dict[str, str]
) -> None:
    """`reader` may read the billing topic but not describe its configs: the check cannot be
    made, which is one line naming the missing ACL, not invented differences (`=None`)."""
    proc = run(
        "topics", *sasl(secure, "reader"), "--topic", names["usage"],
        "--billing-topic", names["billing"], "--usage-partitions", "2",
        "--billing-partitions", "2", "--replication-factor", "1", "--min-insync-replicas", "1",
    )  # fmt: skip
    one_line_refusal(proc, "not authorized", "an ACL is missing")
    assert "=None" not in proc.stdout, proc.stdout
