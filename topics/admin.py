"""Making the cluster match the registry (`topics apply`) and reading it back (`topics describe`)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient, NewPartitions, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.structs import TopicPartition

from common import kafka_auth
from topics.access_admin import apply_access
from topics.registry import TopicSpec

TOPIC_ALREADY_EXISTS = 36  # another `apply` created it between our list and create
DYNAMIC_TOPIC_CONFIG = 1  # config_source of a value set on the topic itself
MAX_COPIES = 3  # of a partition, when `apply` is not told: one per broker up to this


@dataclass
class Change:
    topic: str
    action: str  # created | updated | unchanged
    detail: str = ""


@dataclass
class TopicInfo:
    name: str
    partitions: int
    configs: dict[str, str]
    end_offsets: int  # sum over partitions: how many records the topic has ever taken


def _admin(bootstrap: str) -> AIOKafkaAdminClient:
    return AIOKafkaAdminClient(
        bootstrap_servers=bootstrap, **kafka_auth.client_options(), request_timeout_ms=30_000
    )


async def apply(specs: list[TopicSpec], bootstrap: str, replication: int | None = None) -> list[Change]:
    """Create missing topics; bring configs and partition counts of existing ones to the spec; on a
    broker with SASL, create the role users and the grants `specs` need (topics/access.py).

    New topics get `replication` copies of each partition (None: one per broker, three at most).

    Idempotent: a second run reports every topic unchanged. Partitions only grow (Kafka
    cannot shrink them); configs not named in the spec go back to the broker default.
    """
    admin = _admin(bootstrap)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        changes: list[Change] = []
        missing = [s for s in specs if s.name not in existing]
        if missing:
            if replication is None:
                replication = min(MAX_COPIES, len((await admin.describe_cluster())["brokers"]))
            response = await admin.create_topics(
                [NewTopic(s.name, s.partitions, replication, topic_configs=dict(s.configs)) for s in missing]
            )
            _raise_errors(response.to_object()["topic_errors"], ignore={TOPIC_ALREADY_EXISTS})
            await _wait_for_leaders(admin, [s.name for s in missing])
            changes += [Change(s.name, "created", f"{s.partitions} partitions") for s in missing]
        present = [s for s in specs if s.name in existing]
        if present:
            current = await _configs(admin, [s.name for s in present])
            counts = await _partition_counts(admin, [s.name for s in present])
            for spec in present:
                changes.append(await _reconcile(admin, spec, current[spec.name], counts[spec.name]))
        users, added = await apply_access(specs, bootstrap)
        changes += [Change(f"User:{u}", "created", "SCRAM-SHA-512 user") for u in users]
        if added:
            changes.append(Change("acls", "created", f"{len(added)} grants (`topics describe --access`)"))
        return changes
    finally:
        await admin.close()


class MissingTopics(RuntimeError):
    """Topics a role needs are absent or have fewer partitions than the registry says."""


async def require(specs: list[TopicSpec], bootstrap: str, timeout_s: float = 30.0) -> None:
    """Check that `specs` exist with their partitions, reading metadata only (no admin rights).

    Roles call this instead of `apply`: topic settings are the operator's, and a role of an older
    release must never revert them. Raises MissingTopics naming what to run.
    """
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        **kafka_auth.client_options(),
        enable_auto_commit=False,
        request_timeout_ms=int(timeout_s * 1000),
    )
    await consumer.start()
    try:
        await consumer._client.force_metadata_update()
        problems = []
        for spec in specs:
            partitions = consumer.partitions_for_topic(spec.name)
            if not partitions:
                problems.append(f"{spec.name} is missing")
            elif len(partitions) < spec.partitions:
                problems.append(
                    f"{spec.name} has {len(partitions)} partitions, the registry {spec.partitions}"
                )
        if problems:
            raise MissingTopics("; ".join(problems) + " (run `tokenstream topics apply`)")
    finally:
        await consumer.stop()


async def _reconcile(
    admin: AIOKafkaAdminClient, spec: TopicSpec, configs: dict[str, str], partitions: int
) -> Change:
    details = []
    drift = {k: v for k, v in spec.configs.items() if configs.get(k) != v}
    if drift:
        resource = ConfigResource(ConfigResourceType.TOPIC, spec.name, configs=dict(spec.configs))
        for response in await admin.alter_configs([resource]):
            _raise_errors(response.to_object()["resources"])
        details += [f"{k}={v}" for k, v in drift.items()]
    if partitions < spec.partitions:
        await admin.create_partitions({spec.name: NewPartitions(spec.partitions)})
        details.append(f"partitions {partitions}->{spec.partitions}")
    return Change(spec.name, "updated" if details else "unchanged", ", ".join(details))


async def _wait_for_leaders(admin: AIOKafkaAdminClient, names: list[str], timeout_s: float = 30.0) -> None:
    """Return once every partition of `names` has a leader: the topics are usable, not just created."""
    deadline = time.monotonic() + timeout_s
    while True:
        described = await admin.describe_topics(names)
        ready = all(
            t["error_code"] == 0 and t["partitions"] and all(p["leader"] >= 0 for p in t["partitions"])
            for t in described
        )
        if ready and len(described) == len(names):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"topics without leaders after {timeout_s:.0f}s: {names}")
        await asyncio.sleep(0.2)


async def _configs(admin: AIOKafkaAdminClient, names: list[str]) -> dict[str, dict[str, str]]:
    """Topic configs set on the topic itself (not broker defaults)."""
    responses = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, n) for n in names])
    result: dict[str, dict[str, str]] = {n: {} for n in names}
    for response in responses:
        resources = response.to_object()["resources"]
        _raise_errors(resources)
        for resource in resources:
            for entry in resource["config_entries"]:
                if entry["config_source"] == DYNAMIC_TOPIC_CONFIG:
                    result[resource["resource_name"]][entry["config_names"]] = entry["config_value"]
    return result


def _raise_errors(results: list[dict], ignore: frozenset[int] | set[int] = frozenset()) -> None:
    failed = [r for r in results if r["error_code"] not in (0, *ignore)]
    if failed:
        raise RuntimeError(
            "; ".join(
                f"{r.get('topic') or r.get('resource_name')}: "
                f"error {r['error_code']} {r['error_message'] or ''}"
                for r in failed
            )
        )


async def _partition_counts(admin: AIOKafkaAdminClient, names: list[str]) -> dict[str, int]:
    return {t["topic"]: len(t["partitions"]) for t in await admin.describe_topics(names)}


async def partition_counts(bootstrap: str) -> dict[str, int]:
    """Every topic on the broker with its partition count (what the cluster has, not what was planned)."""
    admin = _admin(bootstrap)
    await admin.start()
    try:
        return {n: c for n, c in (await _partition_counts(admin, await admin.list_topics())).items() if c}
    finally:
        await admin.close()


async def describe(names: list[str], bootstrap: str) -> list[TopicInfo]:
    admin = _admin(bootstrap)
    await admin.start()
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, **kafka_auth.client_options(), enable_auto_commit=False
    )
    await consumer.start()
    try:
        names = [n for n in names if n in set(await admin.list_topics())]
        if not names:
            return []
        configs = await _configs(admin, names)
        counts = await _partition_counts(admin, names)
        ends = await consumer.end_offsets([TopicPartition(n, p) for n in names for p in range(counts[n])])
        return [
            TopicInfo(n, counts[n], configs[n], sum(v for tp, v in ends.items() if tp.topic == n))
            for n in names
        ]
    finally:
        await consumer.stop()
        await admin.close()


async def grow(names: tuple[str, ...], partitions: int, bootstrap: str) -> list[Change]:
    """Grow every topic of `names` to `partitions` (Kafka cannot shrink; equal counts are left alone)."""
    admin = _admin(bootstrap)
    await admin.start()
    try:
        counts = await _partition_counts(admin, list(names))
        missing = [n for n in names if not counts.get(n)]
        if missing:
            raise RuntimeError(f"no such topic: {', '.join(missing)} (run `tokenstream topics apply`)")
        smaller = [n for n in names if counts[n] > partitions]
        if smaller:
            raise ValueError(
                f"{', '.join(smaller)} already have more than {partitions} partitions "
                "(Kafka cannot shrink a topic)"
            )
        grown = {n: NewPartitions(partitions) for n in names if counts[n] < partitions}
        if grown:
            await admin.create_partitions(grown)
            await _wait_for_leaders(admin, list(grown))
        return [
            Change(
                n,
                "updated" if n in grown else "unchanged",
                f"partitions {counts[n]}->{partitions}" if n in grown else f"{counts[n]} partitions",
            )
            for n in names
        ]
    finally:
        await admin.close()
