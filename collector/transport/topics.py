"""The usage and billing topics as they should be: provisioned, never auto-created.

`hami-usage topics` prints the plan, and with `--apply` creates what is missing; every service
checks the topics it uses at start, creates one that is missing as planned, and warns about
each difference (never fails on one: the operator may have good reasons, and billing must not
stop for a retention setting).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, TextIO

from ..settings_check import retention_ms
from .security import KafkaSecurity

log = logging.getLogger(__name__)

# How long `topics --apply` waits for the topics it created to show in the broker's metadata.
_CREATED_VISIBLE_S = 30.0


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    replication_factor: int
    configs: dict[str, str]

    def line(self) -> str:
        configs = " ".join(f"{k}={v}" for k, v in sorted(self.configs.items()))
        return (
            f"{self.name}: partitions={self.partitions} "
            f"replication.factor={self.replication_factor} {configs}"
        )


@dataclass(frozen=True)
class TopicPlan:
    """What `[topics]` says the two topics should be."""

    usage_topic: str
    billing_topic: str
    usage_partitions: int
    billing_partitions: int
    replication_factor: int
    min_insync_replicas: int
    usage_retention_days: float

    def usage(self) -> TopicSpec:
        # Retention covers the replay horizon: `replay` can recompute any range inside it.
        return TopicSpec(
            self.usage_topic,
            self.usage_partitions,
            self.replication_factor,
            {
                "cleanup.policy": "delete",
                "retention.ms": str(retention_ms(self.usage_retention_days)),
                "min.insync.replicas": str(self.min_insync_replicas),
            },
        )

    def billing(self) -> TopicSpec:
        # Keyed by record_id and compacted: a record published again (a new consumer group,
        # a replay) collapses to one message; nothing is ever deleted by age.
        return TopicSpec(
            self.billing_topic,
            self.billing_partitions,
            self.replication_factor,
            {
                "cleanup.policy": "compact",
                "retention.ms": "-1",
                "min.insync.replicas": str(self.min_insync_replicas),
            },
        )

    def specs(self) -> list[TopicSpec]:
        return [self.usage(), self.billing()]


@dataclass(frozen=True)
class TopicState:
    partitions: int
    replication_factor: int
    configs: dict[str, str]


def differences(spec: TopicSpec, state: TopicState | None) -> list[str]:
    """One line per way `state` differs from `spec`; ["missing"] when there is no topic."""
    if state is None:
        return ["missing"]
    out = []
    if state.partitions != spec.partitions:
        line = f"partitions={state.partitions}, want {spec.partitions}"
        if state.partitions < spec.partitions:
            # Both topics are keyed (node name, record id): added partitions move keys. A
            # node's events on two partitions at once had one window billed twice, with one
            # record_id and different values.
            line += (
                " (do not add partitions to a topic in use: its keys would move to other "
                "partitions, the usage topic's windows billed twice; keep it, or move to a new "
                "topic: see the README's Topics)"
            )
        out.append(line)
    if state.replication_factor != spec.replication_factor:
        out.append(f"replication.factor={state.replication_factor}, want {spec.replication_factor}")
    for key, want in sorted(spec.configs.items()):
        have = state.configs.get(key)
        if have != want:
            out.append(f"{key}={have}, want {want}")
    min_isr = state.configs.get("min.insync.replicas", "1")
    if min_isr.isdigit() and int(min_isr) > state.replication_factor:
        # Then every acks=all write fails with NotEnoughReplicas, retried for ever.
        out.append(
            f"min.insync.replicas={min_isr} > replication.factor={state.replication_factor}: "
            "no write can succeed (NotEnoughReplicas)"
        )
    return out


async def describe(admin: Any, names: list[str]) -> dict[str, TopicState | None]:
    """The current partitions, replication factor and configs of `names` (None: no topic)."""
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    existing = set(await admin.list_topics())
    out: dict[str, TopicState | None] = {name: None for name in names}
    present = [n for n in names if n in existing]
    if not present:
        return out
    metadata = {t["topic"]: t for t in await admin.describe_topics(present)}
    responses = await admin.describe_configs(
        [ConfigResource(ConfigResourceType.TOPIC, name) for name in present]
    )
    from aiokafka.errors import for_code

    configs: dict[str, dict[str, str]] = {}
    for response in responses:
        for resource in response.resources:
            # (error_code, error_message, resource_type, resource_name, config_entries); an
            # entry starts (name, value, ...).
            if resource[0]:  # e.g. no DescribeConfigs ACL: the configs are unknown, not empty
                raise for_code(resource[0])(f"{resource[3]}: {resource[1] or 'describe configs'}")
            configs[resource[3]] = {entry[0]: entry[1] for entry in resource[4]}
    for name in present:
        partitions = metadata[name]["partitions"]
        replicas = max((len(p["replicas"]) for p in partitions), default=0)
        out[name] = TopicState(len(partitions), replicas, configs.get(name, {}))
    return out


async def create_each(
    admin: Any, specs: list[TopicSpec]
) -> tuple[list[str], list[tuple[str, Exception]]]:
    """Create the topics of `specs` that do not exist: the names created, and the broker's
    refusal of each other one (one topic refused does not undo or hide another created)."""
    from aiokafka.admin import NewTopic
    from aiokafka.errors import TopicAlreadyExistsError, for_code

    response = await admin.create_topics(
        [
            NewTopic(s.name, s.partitions, s.replication_factor, topic_configs=s.configs)
            for s in specs
        ]
    )
    created: list[str] = []
    refused: list[tuple[str, Exception]] = []
    for name, code, *rest in response.topic_errors:
        error = for_code(code)
        if code == 0:
            created.append(name)
        elif error is not TopicAlreadyExistsError:
            message = rest[0] if rest and rest[0] else ""
            refused.append((name, error(f"create topic {name}: {message}".rstrip(": "))))
    return created, refused


async def create_missing(admin: Any, specs: list[TopicSpec]) -> list[str]:
    """Create the topics of `specs` that do not exist; returns the names created, or raises the
    first refusal."""
    created, refused = await create_each(admin, specs)
    if refused:
        raise refused[0][1]
    return created


def admin_client(bootstrap: str, security: KafkaSecurity) -> Any:
    from aiokafka.admin import AIOKafkaAdminClient

    return AIOKafkaAdminClient(
        bootstrap_servers=bootstrap,
        request_timeout_ms=10_000,
        client_id="hami-usage-topics",
        **security.client_kwargs(),
    )


async def _created_and_described(
    admin: Any, specs: list[TopicSpec], created: list[str]
) -> dict[str, TopicState | None]:
    """The state of `specs`; a topic just `created` reaches the brokers' metadata a moment
    later (seconds on a loaded broker): waited for rather than taken for missing."""
    states = await describe(admin, [s.name for s in specs])
    deadline = time.monotonic() + _CREATED_VISIBLE_S
    while any(states[name] is None for name in created) and time.monotonic() < deadline:
        await asyncio.sleep(0.25)
        states = await describe(admin, [s.name for s in specs])
    return states


async def check(
    bootstrap: str, security: KafkaSecurity, specs: list[TopicSpec]
) -> dict[str, list[str]]:
    """Differences per topic name, for `specs`, once a missing one is created as planned.

    A service's first request for a topic that does not exist has a broker that creates topics
    on first use (`auto.create.topics.enable`, Kafka's default) create it with its own
    defaults: a billing topic that deletes after 7 days instead of being compacted and kept,
    a usage topic of the broker's partition count, which cannot change once in use. Services
    and the `topics` Job start in no set order (kustomize applies them together, Helm's hook
    runs after them), so the service creates it first, as `topics --apply` would; a principal
    that may not create topics gets the warning, and the Job creates it."""
    admin = admin_client(bootstrap, security)
    await admin.start()
    try:
        states = await describe(admin, [s.name for s in specs])
        missing = [s for s in specs if states[s.name] is None]
        if missing:
            # (a refusal: no Create ACL, too few brokers; the Job is to create it then)
            try:
                created, refused = await create_each(admin, missing)
            except Exception as failed:  # the request itself failed: nothing created
                created, refused = [], [(s.name, failed) for s in missing]
            for name in created:
                log.info("created topic %s as [topics] plans it (it did not exist)", name)
            for name, exc in refused:
                log.warning("could not create the missing topic %s as planned (%s)", name, exc)
            states = await _created_and_described(admin, specs, created)
    finally:
        await admin.close()
    return {s.name: differences(s, states[s.name]) for s in specs}


async def warn_on_mismatch(bootstrap: str, security: KafkaSecurity, specs: list[TopicSpec]) -> int:
    """A service's start-up check (`check`): one warning per difference, never an exception.
    Returns the number of differences found (-1: the check itself could not run)."""
    try:
        found = await check(bootstrap, security, specs)
    except Exception as exc:  # a check, not a gate: any failure is a warning
        log.warning("could not check the Kafka topics (%s: %s)", type(exc).__name__, exc)
        return -1
    count = 0
    for name, diffs in found.items():
        for diff in diffs:
            count += 1
            log.warning(
                "topic %s: %s (see `hami-usage topics`); going on with the topic as it is",
                name,
                diff,
            )
    return count


async def apply_plan(
    bootstrap: str, security: KafkaSecurity, plan: TopicPlan, apply: bool, out: TextIO
) -> bool:
    """`hami-usage topics`: print the plan and each topic's state; with `apply`, create the
    missing ones first. Existing topics are never changed (a partition count cannot shrink
    and a config change is the operator's call): their differences are printed. True when
    every topic is as planned."""
    from .kafka import wait_for_broker

    await wait_for_broker(bootstrap, 10.0, security)
    specs = plan.specs()
    admin = admin_client(bootstrap, security)
    await admin.start()
    try:
        created = await create_missing(admin, specs) if apply else []
        for name in created:
            out.write(f"created {name}\n")
        states = await _created_and_described(admin, specs, created)
    finally:
        await admin.close()
    ok = True
    for spec in specs:
        diffs = differences(spec, states[spec.name])
        out.write(f"want {spec.line()}\n")
        if diffs:
            ok = False
            for diff in diffs:
                out.write(f"  differs: {diff}\n")
        else:
            out.write("  ok\n")
    return ok
