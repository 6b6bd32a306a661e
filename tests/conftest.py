from __future__ import annotations

import re
import uuid

import pytest
from broker import bootstrap


@pytest.fixture(scope="session")
def kafka_bootstrap() -> str:
    # Deliberately no skip: a broker that cannot start is a failure (BrokerError has the log tail).
    return bootstrap()


@pytest.fixture
def kafka_topic(request: pytest.FixtureRequest) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]", "-", request.node.name)[:60]
    return f"{name}-{uuid.uuid4().hex[:12]}"
