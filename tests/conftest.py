from __future__ import annotations

import re
import uuid
from collections.abc import Iterator

import pytest
from broker import PrivateBroker, bootstrap, private_broker


@pytest.fixture(scope="session")
def kafka_bootstrap() -> str:
    # Deliberately no skip: a broker that cannot start is a failure (BrokerError has the log tail).
    return bootstrap()


@pytest.fixture(scope="session")
def private_kafka(
    kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PrivateBroker]:
    # kafka_bootstrap first: starting the shared broker installs the jars both use.
    with private_broker(tmp_path_factory.mktemp("kafka")) as broker:
        yield broker


@pytest.fixture
def own_broker(private_kafka: PrivateBroker) -> PrivateBroker:
    """A broker no other test session uses, running, for tests that stop and restart it (one
    per session: each start of a JVM costs seconds)."""
    private_kafka.start()  # a test that failed during its outage may have left it stopped
    return private_kafka


@pytest.fixture
def kafka_topic(request: pytest.FixtureRequest) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]", "-", request.node.name)[:60]
    return f"{name}-{uuid.uuid4().hex[:12]}"
