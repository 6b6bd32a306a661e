"""End to end: a real `hami-usage collect` whose wall clock steps back 300 s mid-run, then
restarts with the clock still back.

The collector runs under Debian's libfaketime (installed by scripts/install-debs.sh), which
re-reads a timestamp file on every clock call: the test writes "-300s" there while the collector
runs, the way NTP steps a clock. The monotonic clock is left alone, as the kernel does.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from lifecycle import SETTINGS, SETTINGS_FLAGS
from streams import consume_plain, create_topic, msg, read_billing, reference, sort_key

from collector.events import (
    ContainerAppeared,
    ContainerGone,
    Event,
    Heartbeat,
    LayoutAnomaly,
    ProcessExited,
    decode,
)
from collector.layout.declarations import V12
from collector.simulate import CacheWriter, GiB, SimDevice
from collector.transport.locallog import LogReader

HAMI_USAGE = Path(sys.executable).parent / "hami-usage"
POD = "00000000-0000-4000-8000-0000000000fa"


def libfaketime() -> str:
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketimeMT.so.1"))
    assert found, "libfaketime is missing: run scripts/install-debs.sh (scripts/test.sh does)"
    return found[0]


def events_of(log: Path) -> list[Event]:
    reader = LogReader(log)
    out: list[Event] = []
    while batch := reader.read(len(out), 5000):
        out += [decode(r.value) for r in batch]
    return out


def wait_until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def faked(stamp: Path) -> dict[str, str]:
    """The environment of a process whose wall clock is `stamp`'s offset (now +0)."""
    stamp.write_text("+0\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAMI_USAGE_")}
    return env | {
        "LD_PRELOAD": libfaketime(),
        "FAKETIME_TIMESTAMP_FILE": str(stamp),
        "FAKETIME_NO_CACHE": "1",  # read the file on every call: the step takes effect at once
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }


@contextlib.contextmanager
def running(cmd: list[str], env: dict[str, str], err: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`cmd` running, its stderr in `err`, for the block; stopped with SIGTERM after it (it
    must exit 0), killed if the block failed."""
    with err.open("wb") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f, env=env)
    try:
        yield proc
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, err.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def one_container(root: Path) -> tuple[Path, CacheWriter]:
    """A container folder under `root` whose one process holds 2 GiB."""
    folder = root / f"{POD}_main"
    folder.mkdir(parents=True)
    w = CacheWriter(folder / "0.cache", V12, [SimDevice("GPU-0000000f-1111-4000-8000-0", 8 * GiB)])
    w.add_process(1, 4001)
    w.add_memory(1, 0, "data", 2 * GiB)
    return folder, w


def gone(w: CacheWriter, folder: Path, log: Path) -> None:
    """The container's folder removed; back once the collector said so."""
    w.close()
    shutil.rmtree(folder)
    wait_until(
        lambda: any(isinstance(e, ContainerGone) for e in events_of(log)), 30, "the gone event"
    )


def test_a_real_collector_whose_wall_clock_steps_back(tmp_path: Path) -> None:
    root, log, stamp = tmp_path / "containers", tmp_path / "log", tmp_path / "faketime"
    folder, w = one_container(root)
    env = faked(stamp)
    cmd = [
        str(HAMI_USAGE), "collect", "--root", str(root), "--log", str(log), "--node", "n1",
        "--interval", "0.2", "--heartbeat", "1", "--no-nvml",
    ]  # fmt: skip
    with running(cmd, env, tmp_path / "collect.err"):

        def heartbeats() -> int:
            if not log.exists():
                return 0
            return sum(isinstance(e, Heartbeat) for e in events_of(log))

        wait_until(lambda: heartbeats() >= 2, 60, "two heartbeats")
        stamp.write_text("-300s\n")  # NTP steps the clock back
        stepped = time.monotonic()
        before = heartbeats()
        wait_until(lambda: heartbeats() >= before + 2, 30, "heartbeats after the step")
        w.exit(1)  # an exit after the step
        time.sleep(1.0)
        gone(w, folder, log)
        after_s = time.monotonic() - stepped

    # Restarted with the clock still 300 s back: it goes on after the last event it wrote.
    again = subprocess.run(
        [*cmd, "--max-scans", "3"], capture_output=True, text=True, env=env, timeout=120
    )
    assert again.returncode == 0, again.stderr
    assert "ms behind the last event in" in again.stderr, again.stderr

    events = events_of(log)
    second = [e for e in events if e.inc != events[0].inc]
    assert second and all(e.inc == second[0].inc for e in second)
    events = events[: len(events) - len(second)]
    assert second[0].ts > events[-1].ts
    ts = [e.ts for e in events]
    assert ts == sorted(ts), "event time went backwards"
    steps = [e for e in events if isinstance(e, LayoutAnomaly) and e.anomaly == "clock_step"]
    assert len(steps) == 1, steps
    assert steps[0].value is not None and -301_000 <= steps[0].value <= -299_000
    # Heartbeats went on, about a second apart on the monotonic clock, through the step: due
    # 1 s after the last one, each comes with the first 0.2 s scan from then, later only by
    # how late that scan ran (a loaded machine's scheduling). 10 s allows for that and is
    # still far from the 300 s a heartbeat stamped by the stepped wall clock would be off.
    beats = [e.ts for e in events if isinstance(e, Heartbeat)]
    after = [t for t in beats if t >= steps[0].ts]
    assert len(after) >= 2
    assert all(500 <= b - a <= 10_000 for a, b in zip(beats, beats[1:], strict=False)), beats

    # Billed: 2 GiB from the first sample to the exit, which event time puts after the step
    # by about the real time between them (never 300 s before it).
    appeared = next(e for e in events if isinstance(e, ContainerAppeared))
    (exited,) = [e for e in events if isinstance(e, ProcessExited)]
    assert steps[0].ts < exited.ts <= steps[0].ts + after_s * 1000
    records = reference([msg("n1", e) for e in events], SETTINGS)
    billed_byte_ms = sum(round(r.memory_byte_seconds * 1000) for r in records if r.pod_uid == POD)
    assert billed_byte_ms == 2 * GiB * (exited.ts - appeared.ts)


@pytest.mark.kafka
def test_a_step_back_past_max_skew_loses_nothing_on_kafka(
    tmp_path: Path, kafka_bootstrap: str, kafka_topic: str
) -> None:
    """Stepped back 600 s (the aggregator's max_skew is 300 s): each record carries its event's
    time, so nothing after the step is refused as from the future, and the topic bills what
    the collector's own spool says. With the send time as the record time (the Kafka client's
    default) every event after the step was refused: 7 of 13 in the first reproduction."""
    root, log, stamp = tmp_path / "containers", tmp_path / "log", tmp_path / "faketime"
    folder, w = one_container(root)
    env = faked(stamp)
    asyncio.run(create_topic(kafka_bootstrap, kafka_topic, 1))
    cmd = [
        str(HAMI_USAGE), "collect", "--root", str(root), "--log", str(log), "--node", "n1",
        "--interval", "0.2", "--heartbeat", "1", "--no-nvml", "--no-kubernetes",
        "--kafka", kafka_bootstrap, "--topic", kafka_topic,
    ]  # fmt: skip
    with running(cmd, env, tmp_path / "collect.err"):
        wait_until(lambda: log.exists() and len(events_of(log)) >= 3, 60, "the first events")
        stamp.write_text("-600s\n")
        wait_until(
            lambda: any(isinstance(e, LayoutAnomaly) for e in events_of(log)), 30, "the step"
        )
        w.exit(1)
        wait_until(
            lambda: any(isinstance(e, ProcessExited) for e in events_of(log)), 30, "the exit"
        )
        gone(w, folder, log)

    spooled = events_of(log)
    got = asyncio.run(consume_plain(kafka_topic, bootstrap_servers=kafka_bootstrap))
    assert [decode(m.value) for m in got] == spooled  # everything, once, in order
    # each record stamped when it was sent, never before its event: after the step that is
    # the event's own time, 600 s ahead of the node's wall clock
    assert all(e.ts <= m.timestamp <= e.ts + 5_000 for m, e in zip(got, spooled, strict=True))
    (step,) = [e for e in spooled if isinstance(e, LayoutAnomaly) and e.anomaly == "clock_step"]
    assert step.value is not None and -601_000 <= step.value <= -599_000
    assert any(isinstance(e, ProcessExited) and e.ts > step.ts for e in spooled)
    drained = subprocess.run(
        [
            str(HAMI_USAGE), "aggregate", "--kafka", kafka_bootstrap, "--topic", kafka_topic,
            "--billing-topic", f"{kafka_topic}.billing", "--group", f"{kafka_topic}.g",
            *SETTINGS_FLAGS, "--drain",
            "--csv", str(tmp_path / "bill.csv"),
        ],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert drained.returncode == 0, drained.stderr
    assert "future_events" not in drained.stderr, drained.stderr
    billed = asyncio.run(read_billing(kafka_bootstrap, f"{kafka_topic}.billing"))
    expected = reference([msg("n1", e) for e in spooled], SETTINGS)
    assert sorted(billed, key=sort_key) == sorted(expected, key=sort_key)
