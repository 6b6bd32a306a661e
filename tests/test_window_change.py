"""A group's window size changed between runs: the commit records the size its records were
emitted with, and a run whose first window would straddle the emitted end (billing part of
it again) is refused, one line and exit 4, before anything is written. A size with a boundary
at that end takes over from it."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import msgspec
import pytest
from streams import (
    T0_MS,
    WINDOW_FLAGS,
    Spec,
    build,
    committed_metadata,
    create_topic,
    decode_checkpoint,
    hami,
    produce,
    recent_t0,
    write_local_log,
)

from collector.aggregate.damage import EXIT_CHECKPOINT, CheckpointError
from collector.aggregate.service import Checkpoint, check_window

SPEC = Spec(seconds=100)  # values run to their 30 s cap: the last window is [120 s, 180 s)
NODES = ("node-a", "node-b")
assert WINDOW_FLAGS[:2] == ["--window", "60"]
OTHER = WINDOW_FLAGS[2:]  # lateness, max gap and skew as the other tests have them


def committed_locally(log: Path) -> dict[str, Any]:
    out: dict[str, Any] = msgspec.json.decode(
        (log / "consumers" / "hami-usage-aggregator.json").read_bytes()
    )
    return out


def test_the_rule() -> None:
    at = Checkpoint(T0_MS + 180_000, window_ms=60_000)  # T0 is on a 5-minute mark
    check_window(at, 60_000, "c")  # the same size
    check_window(at, 30_000, "c")  # a boundary at 180 s: takes over there
    check_window(at, 90_000, "c")
    check_window(Checkpoint(), 300_000, "c")  # nothing emitted yet
    with pytest.raises(CheckpointError) as unknown:  # written before sizes were recorded
        check_window(Checkpoint(T0_MS + 180_000), 300_000, "c")
    assert str(unknown.value) == (
        "c was written with windows of another size, emitted up to 2026-03-02T10:03:00Z; "
        "--window 300 would bill 2026-03-02T10:00:00Z to 2026-03-02T10:03:00Z again: keep the "
        "window size it was written with, or start the new size in a new --group"
    )
    with pytest.raises(CheckpointError) as refused:
        check_window(at, 300_000, "checkpoint of group g")
    assert str(refused.value) == (
        "checkpoint of group g was written with 60 s windows, emitted up to "
        "2026-03-02T10:03:00Z; --window 300 would bill 2026-03-02T10:00:00Z to "
        "2026-03-02T10:03:00Z again: keep --window 60, or start the new size in a new --group"
    )


def test_the_local_log_refuses_a_window_that_would_bill_again(tmp_path: Path) -> None:
    log, csv = tmp_path / "log", tmp_path / "a.csv"
    write_local_log(log, build(tmp_path / "nodes", T0_MS, SPEC, NODES))
    first = hami("aggregate", "--log", log, *WINDOW_FLAGS, "--csv", csv, "--drain")
    assert first.returncode == 0, first.stderr
    checkpoint = decode_checkpoint(committed_locally(log)["metadata"])
    assert (checkpoint["emitted_until_ms"], checkpoint["window_ms"]) == (T0_MS + 180_000, 60_000)
    written = csv.read_bytes()
    checkpoint_bytes = (log / "consumers" / "hami-usage-aggregator.json").read_bytes()

    refused = hami("aggregate", "--log", log, "--window", "300", *OTHER, "--csv", csv, "--drain")
    assert refused.returncode == EXIT_CHECKPOINT, refused.stderr
    (line,) = refused.stderr.strip().splitlines()
    assert line == (
        "hami-usage aggregate: checkpoint of group hami-usage-aggregator was written with 60 s "
        "windows, emitted up to 2026-03-02T10:03:00Z; --window 300 would bill "
        "2026-03-02T10:00:00Z to 2026-03-02T10:03:00Z again: keep --window 60, or start the "
        "new size in a new --group"
    )
    assert csv.read_bytes() == written  # nothing was done
    assert (log / "consumers" / "hami-usage-aggregator.json").read_bytes() == checkpoint_bytes

    # 30 s windows have a boundary at the emitted end: they take over from it
    halves = hami("aggregate", "--log", log, "--window", "30", *OTHER, "--csv", csv, "--drain")
    assert halves.returncode == 0, halves.stderr
    assert csv.read_bytes() == written  # nothing new to bill
    assert decode_checkpoint(committed_locally(log)["metadata"])["window_ms"] == 30_000


@pytest.mark.kafka
def test_a_partition_whose_checkpoint_has_another_window_stops_the_service(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    """On Kafka the check runs per partition as it is assigned (the rebalance listener)."""
    t0 = recent_t0(SPEC.seconds)
    t0 -= t0 % 300_000 - 60_000  # a minute past a 5-minute mark: the emitted end is not on one
    asyncio.run(create_topic(kafka_bootstrap, kafka_topic, 1))
    asyncio.run(produce(kafka_bootstrap, kafka_topic, build(tmp_path / "nodes", t0, SPEC, NODES)))
    group = f"{kafka_topic}.g"
    cmd = [
        "aggregate", "--kafka", kafka_bootstrap, "--topic", kafka_topic, "--group", group,
        "--billing-topic", f"{kafka_topic}.billing", "--instance", uuid.uuid4().hex[:8],
        *OTHER, "--csv", str(tmp_path / "a.csv"), "--drain",
    ]  # fmt: skip
    first = hami(*cmd, "--window", "60")
    assert first.returncode == 0, first.stderr
    ((offset, metadata),) = asyncio.run(committed_metadata(kafka_bootstrap, group)).values()
    emitted = decode_checkpoint(metadata)
    assert (emitted["emitted_until_ms"] - t0, emitted["window_ms"]) == (180_000, 60_000)
    refused = hami(*cmd, "--window", "300")
    assert refused.returncode == EXIT_CHECKPOINT, refused.stderr
    assert "Traceback" not in refused.stderr
    line = refused.stderr.strip().splitlines()[-1]
    assert line.startswith(
        f"hami-usage aggregate: checkpoint of group {group} partition 0 was written with 60 s "
        "windows"
    ), refused.stderr
    assert line.endswith("keep --window 60, or start the new size in a new --group")
    assert asyncio.run(committed_metadata(kafka_bootstrap, group)) == {0: (offset, metadata)}
