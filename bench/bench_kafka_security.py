"""What TLS and SASL cost end to end, and what JSON billing values cost next to msgpack.

    .venv/bin/python bench/bench_kafka_security.py [--rows 200000] [--repeat 3]

One run, one broker: the secured test broker of `KAFKA_SECURE=1 scripts/kafka.sh` (started here
if needed), whose listeners differ only in security, so the three rates are side by side:

* plaintext: its loopback PLAINTEXT listener;
* SASL_SSL: TLS + SCRAM-SHA-512 (the `admin` user), through collector/transport/security.py;
* mTLS: TLS with a client certificate (the `aggregator` principal and its ACLs).

Each: the usage events of bench/bench_e2e.py produced (gzip, idempotent, like the collector) to a
fresh topic and consumed by the aggregator's consumption path (`ours`); the rates are usage
samples per wall second from the first record consumed to the last, and per CPU second of the
consuming process (connection set-up and handshakes included); producing is timed too. Goal: TLS
+ SASL costs at most 25 % of the plaintext samples/s, judged per CPU second (on a shared machine
the wall-clock rate mostly measures the neighbours; both are printed).

Billing values: the records an `Aggregator` makes of the same events, encoded as the billing
topic's JSON and as msgpack (same field names), bytes per record before compression. Goal:
JSON <= 2.5 x msgpack.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_e2e import SETTINGS, Shape, build, ours, produce, start_broker  # noqa: E402

from collector.aggregate.billing import billing_message  # noqa: E402
from collector.aggregate.intake import InputStats, add_record  # noqa: E402
from collector.aggregate.windows import Aggregator  # noqa: E402
from collector.events import encode  # noqa: E402
from collector.transport.security import KafkaSecurity  # noqa: E402

GOAL_COST = 0.25
GOAL_JSON_RATIO = 2.5


def secure_broker() -> dict[str, str]:
    out = start_broker(KAFKA_SECURE="1")
    return dict(line.split("=", 1) for line in out.splitlines())


def clients(b: dict[str, str]) -> dict[str, tuple[str, dict[str, object]]]:
    certs, secrets = Path(b["certs"]), Path(b["secrets"])
    sasl = KafkaSecurity(
        "SASL_SSL",
        ca_file=str(certs / "ca.pem"),
        sasl_mechanism="SCRAM-SHA-512",
        username="admin",
        password=(secrets / "admin.password").read_text(),
    )
    mtls = KafkaSecurity(
        "SSL",
        ca_file=str(certs / "ca.pem"),
        cert_file=str(certs / "aggregator.pem"),
        key_file=str(certs / "aggregator.key"),
    )
    return {
        "plaintext": (b["internal"], {}),
        "SASL_SSL": (b["sasl_ssl"], sasl.client_kwargs()),
        "mTLS": (b["ssl"], mtls.client_kwargs()),
    }


async def one(
    name: str,
    bootstrap: str,
    client: dict[str, object],
    admin: tuple[str, dict[str, object]],
    events: list,
    usage_rows: int,
) -> tuple[float, float, float]:
    """(samples/s consumed, samples per CPU second of the consumer, seconds to produce) on a
    fresh topic. CPU time, unlike wall time, does not move with the other load of the machine."""
    topic = f"hami.usage.bench-{name.lower()}-{uuid.uuid4().hex[:8]}"
    # Topics are made by the admin (the mTLS principal may not create them), then produced to
    # and consumed with the client under test.
    producer_side = client if name != "mTLS" else admin[1]
    producer_addr = bootstrap if name != "mTLS" else admin[0]
    started = time.perf_counter()
    await produce(producer_addr, topic, events, **producer_side)
    produced = time.perf_counter() - started
    cpu = time.process_time()
    result = await ours(bootstrap, topic, len(events), usage_rows, "hami-usage-bench", **client)
    cpu = time.process_time() - cpu
    return result.rate, usage_rows / cpu, produced


def billing_bytes(events: list) -> tuple[int, float, float]:
    agg = Aggregator(SETTINGS)
    stats = InputStats()
    for i, (node, e) in enumerate(events):
        add_record(agg, stats, node.encode(), encode(e), source=0, offset=i, record_ts_ms=e.ts)
    records = agg.flush()
    json_sizes = [len(billing_message(r, "json")[1]) for r in records]
    msgpack_sizes = [len(billing_message(r, "msgpack")[1]) for r in records]
    return len(records), statistics.mean(json_sizes), statistics.mean(msgpack_sizes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    broker = secure_broker()
    kinds = clients(broker)
    t0 = (int(time.time() * 1000) - 3_600_000) // 60_000 * 60_000
    events, usage_rows, _ = build(Shape(), args.rows, t0)
    print(f"{len(events)} events, {usage_rows} usage samples; one broker, three listeners")
    rates: dict[str, list[float]] = {k: [] for k in kinds}
    per_cpu: dict[str, list[float]] = {k: [] for k in kinds}
    produce_s: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(args.repeat):
        for name, (addr, client) in kinds.items():  # interleaved: drift hits all alike
            rate, cpu_rate, secs = asyncio.run(
                one(name, addr, client, kinds["SASL_SSL"], events, usage_rows)
            )
            rates[name].append(rate)
            per_cpu[name].append(cpu_rate)
            produce_s[name].append(secs)
    base, base_cpu = statistics.median(rates["plaintext"]), statistics.median(per_cpu["plaintext"])
    for name in kinds:
        med, med_cpu = statistics.median(rates[name]), statistics.median(per_cpu[name])
        print(
            f"{name:>9}: wall median {med:>9,.0f} samples/s (cost {1 - med / base:6.1%}); "
            f"per consumer CPU second {med_cpu:>9,.0f} (cost {1 - med_cpu / base_cpu:6.1%}); "
            f"produce median {statistics.median(produce_s[name]):.2f} s"
        )
    # The goal is judged on CPU: on a shared machine wall time mostly measures the neighbours.
    cost = 1 - statistics.median(per_cpu["SASL_SSL"]) / base_cpu
    verdict = "met" if cost <= GOAL_COST else "NOT met"
    print(f"TLS + SASL cost per CPU second: {cost:.1%} (goal <= {GOAL_COST:.0%}): {verdict}")
    n, js, mp = billing_bytes(events)
    ratio = js / mp
    print(
        f"billing values, {n} records: JSON {js:.1f} B, msgpack {mp:.1f} B per record: "
        f"ratio {ratio:.2f} (goal <= {GOAL_JSON_RATIO}): "
        + ("met" if ratio <= GOAL_JSON_RATIO else "NOT met")
    )


if __name__ == "__main__":
    main()
