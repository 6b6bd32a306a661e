"""Add the secured test broker's ACLs (see scripts/kafka-secure.sh); run by kafka.sh at start.

The broker ships no ACL tool in the jars scripts/kafka.sh fetches, so this sends CreateAcls
requests with aiokafka's protocol classes to the super-user listener. Adding an ACL that exists
is a no-op, so running it at every start is harmless.
"""

from __future__ import annotations

import asyncio
import sys

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.protocol.admin import CreateAclsRequest

# Kafka's wire codes (org.apache.kafka.common.acl / resource).
TOPIC, GROUP, TRANSACTIONAL_ID = 2, 3, 5
READ, WRITE, DESCRIBE, DESCRIBE_CONFIGS = 3, 4, 8, 10
PREFIXED, ALLOW = 4, 3

ACLS: list[tuple[str, int, str, list[int]]] = [
    ("collector", TOPIC, "hami.usage", [WRITE, DESCRIBE, DESCRIBE_CONFIGS]),
    ("aggregator", TOPIC, "hami.usage", [READ, DESCRIBE, DESCRIBE_CONFIGS]),
    ("aggregator", TOPIC, "hami.billing", [WRITE, DESCRIBE, DESCRIBE_CONFIGS]),
    ("aggregator", GROUP, "hami-usage", [READ, DESCRIBE]),
    ("aggregator", TRANSACTIONAL_ID, "hami-usage", [WRITE, DESCRIBE]),
    ("reader", TOPIC, "hami.billing", [READ, DESCRIBE]),
    ("reader", GROUP, "billing-reader", [READ, DESCRIBE]),
]


async def main(bootstrap: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
    await admin.start()
    try:
        for user, resource, prefix, operations in ACLS:
            for op in operations:
                request = CreateAclsRequest(
                    resource, prefix, PREFIXED, f"User:{user}", "*", op, ALLOW
                )
                response = await admin._send_request(request)  # noqa: SLF001
                for result in response.creation_responses:
                    if result[0] != 0:
                        raise SystemExit(f"CreateAcls {user} {prefix} {op}: error {result}")
    finally:
        await admin.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
