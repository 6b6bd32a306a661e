"""The aggregator's /healthz over real HTTP: a running `hami-usage aggregate` answers 200 while
its input loop turns; a loop that stopped turning answers 503."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from streams import HAMI_USAGE, create_topic, env, replica

from collector.aggregate.health import HealthServer, Liveness
from collector.aggregate.service import run_kafka


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_running_aggregator_answers_healthz(tmp_path: Path) -> None:
    (tmp_path / "log").mkdir()
    port = free_port()
    proc = subprocess.Popen(
        [
            str(HAMI_USAGE),
            "aggregate",
            "--log",
            str(tmp_path / "log"),
            "--csv",
            str(tmp_path / "billing.csv"),
            "--health-port",
            str(port),
            "--health-bind-address",
            "127.0.0.1",
        ],
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        answer: tuple[int, str] | None = None
        while time.monotonic() < deadline and answer is None:
            try:
                answer = get(port, "/healthz")
            except urllib.error.URLError:
                assert proc.poll() is None, proc.communicate()[1]
                time.sleep(0.2)
        assert answer is not None and answer[0] == 200, answer
        assert "input loop turned" in answer[1]
        assert get(port, "/metrics")[0] == 404  # its metrics go out over OTLP
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    assert f"health on 127.0.0.1:{port}/healthz" in stderr


async def test_stalled_loop_answers_503() -> None:
    """A minute once the loop has turned (start-up's grace, waiting for the broker, made it
    70 s with the default 60 s start timeout); the grace only before the first turn."""
    liveness = Liveness()
    server = HealthServer("127.0.0.1", 0, liveness, stale_after_s=60, start_grace_s=70)
    port = await server.start()
    try:
        liveness.last_beat -= 65  # starting: waiting for the broker
        assert (await asyncio.to_thread(get, port, "/healthz"))[0] == 200
        liveness.beat()
        assert (await asyncio.to_thread(get, port, "/healthz"))[0] == 200
        liveness.last_beat -= 61  # as if the loop had not come round for a minute
        status, body = await asyncio.to_thread(get, port, "/healthz")
        assert status == 503 and "61." in body
        liveness.beat()
        assert (await asyncio.to_thread(get, port, "/healthz"))[0] == 200
    finally:
        await server.stop()


@pytest.mark.kafka
def test_replicas_on_standby_stay_alive_past_the_grace(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    """Three replicas on a one-partition topic (a StatefulSet scaled past the partitions): one
    owns the partition, "b" owned it until "a" joined (the assignors give it to the first
    member id), "c" never had one. Each standby waits in its group for a partition and is
    alive meanwhile: /healthz (3 s instead of a minute, grace included) stays 200."""

    async def started(instance: str, stop: asyncio.Event) -> tuple[Any, HealthServer, int]:
        s = replica(kafka_bootstrap, kafka_topic, tmp_path, instance)
        server = HealthServer("127.0.0.1", 0, s.liveness, stale_after_s=3, start_grace_s=3)
        port = await server.start()
        return asyncio.create_task(run_kafka(s, stop)), server, port

    async def scenario() -> list[tuple[str, int, str]]:
        await create_topic(kafka_bootstrap, kafka_topic, 1)
        await create_topic(kafka_bootstrap, f"{kafka_topic}.billing", 1)
        stop = asyncio.Event()
        replicas = {}
        for instance in ("b", "a", "c"):
            replicas[instance] = await started(instance, stop)
            await asyncio.sleep(8)  # joined, past its grace
        answers = []
        try:
            for _ in range(10):
                for instance, (_, _, port) in replicas.items():
                    status, body = await asyncio.to_thread(get, port, "/healthz")
                    answers.append((instance, status, body))
                await asyncio.sleep(1)
        finally:
            stop.set()
            await asyncio.gather(*(task for task, _, _ in replicas.values()))
            for _, server, _ in replicas.values():
                await server.stop()
        return answers

    answers = asyncio.run(scenario())
    assert [(i, s) for i, s, _ in answers] == [(i, 200) for i in "bac"] * 10, answers
