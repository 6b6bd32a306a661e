"""`hami-usage collect --kafka` end to end against the real broker of scripts/kafka.sh.

The collector runs as a subprocess; a plain aiokafka consumer reads the topic back. The spool
(the local log every event goes through first) is the reference: the topic must hold exactly
its records, in order, once each, also across a broker outage.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, ConsumerRecord
from broker import PrivateBroker
from streams import create_topic
from test_collect_local import (
    Collector,
    Sim,
    SimThread,
    check_incarnations,
    collect_cmd,
    fold,
    read_all,
    run_collector,
    wait_for_records,
)

from collector.events import (
    ContainerGone,
    Event,
    Heartbeat,
    LayoutAnomaly,
    ProcessExited,
    UsageSample,
    decode,
)
from collector.layout.declarations import LAYOUTS
from collector.node.scan import Scanner
from collector.simulate import GiB, MiB, SimDevice, new_cache_file
from collector.transport.kafka import FORWARDER_GROUP
from collector.transport.locallog import LogReader, LogRecord

pytestmark = pytest.mark.kafka

NODE = b"n1"


async def consume_all(bootstrap: str, topic: str, timeout_s: float = 60) -> list[ConsumerRecord]:
    """Every record of every partition of `topic`, up to the end offsets at the time."""
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        metadata_max_age_ms=1000,
    )  # no group: all partitions are assigned to this consumer
    await consumer.start()
    try:
        async with asyncio.timeout(timeout_s):
            while not (tps := consumer.assignment()):
                await asyncio.sleep(0.05)
            ends = await consumer.end_offsets(list(tps))
            out: list[ConsumerRecord] = []
            while [tp for tp in tps if await consumer.position(tp) < ends[tp]]:
                for records in (await consumer.getmany(timeout_ms=200)).values():
                    out.extend(records)
            return out
    finally:
        await consumer.stop()


def one_partition(records: list[ConsumerRecord]) -> list[ConsumerRecord]:
    """Key = node name: all of a node's events in one partition, in offset order."""
    assert records
    assert {r.key for r in records} == {NODE}
    assert len({r.partition for r in records}) == 1
    return sorted(records, key=lambda r: r.offset)


def committed(spool: Path) -> int:
    c = LogReader(spool).committed(FORWARDER_GROUP)
    return -1 if c is None else c[0]


def spool_is_drained(spool: Path) -> bool:
    return committed(spool) == LogReader(spool).end_offset()


def wait_until(cond: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def body(e: Event) -> tuple[str, dict[str, Any]]:
    # The envelope; the heartbeat's own timing and spool depth (the collector's announcement,
    # appended before its first scan, may not be acknowledged yet when the heartbeat is made).
    skip = {"v", "inc", "seq", "ts", "scan_ms", "spool_depth"}
    return type(e).__name__, {f: getattr(e, f) for f in e.__struct_fields__ if f not in skip}


def static_node(root: Path, proc: Path) -> None:
    """One container per layout with processes, one SIGKILLed slot, one garbage file."""
    proc.mkdir()
    hostpid = 7000
    for i, layout in enumerate(LAYOUTS.values()):
        devs = [SimDevice(f"GPU-{i}{d}000000-0000-4000-8000-000000000000", 4 * GiB, 50)
                for d in range(2)]  # fmt: skip
        w = new_cache_file(root, f"pod-{i}", f"ctr_{layout.name}", layout, devs)
        for pid in (10, 11):
            hostpid += 1
            (proc / str(hostpid)).mkdir()
            w.add_process(pid, hostpid)
            w.add_memory(pid, pid % 2, "data", (i + 1) * 100 * MiB)
            w.add_memory(pid, 0, "context", 300 * MiB)
        w.watch({hostpid: {0: (2 * GiB, 40)}})
        w.add_process(12, 9999)  # no /proc entry: SIGKILLed, a stale slot
        w.close()
    junk = root / "pod-x_junk"
    junk.mkdir()
    (junk / "garbage.cache").write_bytes(b"\x01" * 4096)


def test_every_layout_end_to_end(kafka_bootstrap: str, kafka_topic: str, tmp_path: Path) -> None:
    # Provisioned, as in production: a topic auto-created by the first send can take longer to
    # get a leader on a loaded machine than the collector's 10 s of draining at exit.
    asyncio.run(create_topic(kafka_bootstrap, kafka_topic))
    spool = tmp_path / "spool"
    kafka = ["--kafka", kafka_bootstrap, "--topic", kafka_topic]

    # 1. A fixed set of files: the topic carries what an in-process Scanner produces.
    root1, proc1 = tmp_path / "static", tmp_path / "proc1"
    root1.mkdir()
    static_node(root1, proc1)
    expected = Scanner(root1, heartbeat_s=30, host_proc=str(proc1)).scan()
    assert {e.anomaly for e in expected if isinstance(e, LayoutAnomaly)} >= {
        "mislabelled_layout",
        "stale_process",
        "not_initialized",
    }
    run_collector([*collect_cmd(root1, spool, proc1, "--max-scans", "1"), *kafka], tmp_path)
    assert spool_is_drained(spool)  # sent before exit
    sent = one_partition(asyncio.run(consume_all(kafka_bootstrap, kafka_topic)))
    static = [decode(r.value) for r in sent]
    # (Node-level kinds a collector may add, e.g. from NVML, are not the Scanner's.)
    kinds = {type(e) for e in expected} | {ContainerGone, ProcessExited, UsageSample}
    assert [body(e) for e in static if type(e) in kinds] == [body(e) for e in expected]

    # 2. The simulator writes every layout while the collector scans and forwards.
    root2, proc2 = tmp_path / "live", tmp_path / "proc2"
    root2.mkdir()
    sim = Sim(root2, proc2, 10, seed=21, procs_per_container=3)
    try:
        with SimThread(sim, 0.05):
            cmd = collect_cmd(root2, spool, proc2, "--interval", "0.2", "--max-scans", "15")
            run_collector([*cmd, *kafka], tmp_path)
        # 3. Simulator stopped: a new incarnation states what the files hold now.
        run_collector([*collect_cmd(root2, spool, proc2, "--max-scans", "1"), *kafka], tmp_path)
        model = sim.model()
    finally:
        sim.close()

    records = one_partition(asyncio.run(consume_all(kafka_bootstrap, kafka_topic)))
    spooled = read_all(spool)
    # The topic is the spool: same records, same order, each once.
    assert [(r.key, r.value) for r in records] == [(r.key, r.value) for r in spooled]
    assert committed(spool) == LogReader(spool).end_offset() == len(spooled)
    events = [decode(r.value) for r in records]
    runs = check_incarnations(events)
    assert len(runs) == 3
    assert runs[0] == static
    assert {e.container for run in runs[1:] for e in run if hasattr(e, "container")} == {
        c.name for c in sim.containers
    }
    layouts = {e.layout for e in runs[1] if hasattr(e, "layout")}
    assert layouts == set(LAYOUTS)
    fold(runs[1])
    assert fold(runs[2]) == model  # processes and absolute totals equal the files' values


def test_broker_outage_spools_and_drains_exactly_once(
    own_broker: PrivateBroker, kafka_topic: str, tmp_path: Path
) -> None:
    # A broker of its own: taking the shared one away would fail the clients of every test
    # running meanwhile (other sessions on the machine), and they could end the outage early.
    kafka_bootstrap = own_broker.bootstrap
    asyncio.run(create_topic(kafka_bootstrap, kafka_topic))
    root, proc_dir, spool = tmp_path / "containers", tmp_path / "proc", tmp_path / "spool"
    root.mkdir()
    sim = Sim(root, proc_dir, 8, seed=8, procs_per_container=2)
    cmd = [
        *collect_cmd(root, spool, proc_dir, "--interval", "0.2", "--heartbeat", "2"),
        "--kafka", kafka_bootstrap, "--topic", kafka_topic,
    ]  # fmt: skip
    collector = None
    try:
        with SimThread(sim, 0.1) as st:
            collector = Collector(cmd, tmp_path / "collect.err")
            wait_for_records(spool, 1, collector)
            wait_until(lambda: committed(spool) > 50, 60, "the first events to reach Kafka")
            time.sleep(2)

            own_broker.stop()
            down_at = time.monotonic()
            end_at_stop = LogReader(spool).end_offset()
            samples = []
            # At least 20 s away, and until the spool has grown at 5 samples 2 s apart: the
            # files change every 0.1 s and are scanned every 0.2 s, so each 2 s appends
            # something unless the machine is too loaded to run the collector meanwhile.
            while time.monotonic() - down_at < 20 or len(set(samples)) < 5:
                assert time.monotonic() - down_at < 120, ("no growth", samples)
                time.sleep(2)
                assert collector.running(), collector.stderr()
                samples.append(LogReader(spool).end_offset())
            committed_while_down = committed(spool)
            # Still scanning with the broker away: new seqs keep landing in the spool...
            assert samples == sorted(samples) and samples[-1] > end_at_stop
            during = [decode(r.value) for r in LogReader(spool).read(end_at_stop, 100_000)]
            # (one incarnation into an empty spool: a record's offset is its event's seq)
            assert [e.seq for e in during] == list(range(end_at_stop, end_at_stop + len(during)))
            depth = [e.spool_depth for e in during if isinstance(e, Heartbeat)]
            assert depth and max(depth) > 0  # the heartbeat reports the backlog
            # ...and stay there.
            assert committed_while_down < samples[-1]

            own_broker.start()
            st.stop()  # quiet files: only heartbeats from here on
            wait_until(lambda: spool_is_drained(spool), 90, "the spool to drain")

        assert collector.stop(signal.SIGTERM) == 0, collector.stderr()
        # At most one line for the whole outage, however many connections failed, and one
        # when it is over. (The producer may also wait the outage out inside its own retries,
        # its connection never dropped: then neither line.)
        text = collector.stderr()
        again = re.findall(r"kafka takes the collector's connection again after (\d+) f", text)
        assert text.count("kafka unreachable, retrying") == len(again) <= 1, text
    finally:
        sim.close()
        if collector is not None and collector.running():
            collector.stop(signal.SIGKILL)
        own_broker.start()  # running again for the checks below (the fixture stops it)

    spooled: list[LogRecord] = read_all(spool)
    end = LogReader(spool).end_offset()
    assert committed(spool) == end  # the spool is empty again
    records = one_partition(asyncio.run(consume_all(kafka_bootstrap, kafka_topic)))
    events = [decode(r.value) for r in records]
    (run,) = check_incarnations(events)  # seq 0..last, each exactly once, in order
    assert len(run) == end
    assert end > samples[-1]
    assert [r.value for r in records][-len(spooled) :] == [r.value for r in spooled]
    fold(run)
