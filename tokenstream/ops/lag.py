"""Per consumer group and partition: committed offset, end offset, lag, owner, drain rate, wait.

Like `kafka-consumer-groups --describe`, for the groups the topic registry names (every reader
with a group, on every topic, inference topics of every served model included). The drain rate
is the growth of the committed offsets between two samples `interval_s` apart; the estimated
wait is lag / rate (what a request written now would queue), "-" when nothing drains.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.structs import TopicPartition

from common import kafka_auth
from producers.membership import GroupState, states
from topics.admin import partition_counts
from topics.registry import TopicSpec

log = logging.getLogger(__name__)


@dataclass
class PartitionLag:
    group: str
    topic: str
    partition: int
    committed: int | None  # None: the group never committed on this partition
    end: int
    owner: str  # client id of the member that holds the partition, "" when none
    rate: float = 0.0  # committed offsets per second

    @property
    def lag(self) -> int:
        return self.end - (self.committed if self.committed is not None else 0)

    @property
    def wait_s(self) -> float | None:
        return self.lag / self.rate if self.rate > 0 else (0.0 if self.lag == 0 else None)


async def _group_states(admin: AIOKafkaAdminClient, groups: list[str]) -> dict[str, GroupState]:
    """Each group described on its own: a group whose description cannot be read (aiokafka fails to
    decode some brokers' answers for some groups) shows as unknown instead of failing the table."""
    out = {}
    for group in groups:
        try:
            responses = await admin.describe_consumer_groups([group])
        except Exception as exc:  # noqa: BLE001
            log.warning("could not describe group %s: %s", group, exc)
            out[group] = GroupState(group, "unknown", 0, {}, {})
            continue
        out.update(states(responses))
    return out


async def sample(
    bootstrap: str, specs: list[TopicSpec], interval_s: float = 2.0
) -> tuple[list[PartitionLag], dict[str, GroupState]]:
    """Two readings `interval_s` apart; the rows carry the second reading and the rate between."""
    admin = AIOKafkaAdminClient(
        bootstrap_servers=bootstrap, **kafka_auth.client_options(), request_timeout_ms=10_000
    )
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, **kafka_auth.client_options(), group_id=None, enable_auto_commit=False
    )
    await admin.start()
    await consumer.start()
    try:
        counts = await partition_counts(bootstrap)
        pairs = [(group, spec) for spec in specs if spec.name in counts for group in spec.groups]

        async def read() -> list[PartitionLag]:
            rows = []
            for group, spec in pairs:
                tps = [TopicPartition(spec.name, p) for p in range(counts[spec.name])]
                ends = await consumer.end_offsets(tps)
                committed = await admin.list_consumer_group_offsets(group, partitions=tps)
                for tp in tps:
                    meta = committed.get(tp)
                    at = meta.offset if meta is not None and meta.offset >= 0 else None
                    rows.append(PartitionLag(group, tp.topic, tp.partition, at, ends[tp], ""))
            return rows

        first, t0 = await read(), time.monotonic()
        await asyncio.sleep(interval_s)
        second, t1 = await read(), time.monotonic()
        states = await _group_states(admin, sorted({g for g, _ in pairs})) if pairs else {}
        before = {(r.group, r.topic, r.partition): r.committed or 0 for r in first}
        for r in second:
            r.rate = max(0, (r.committed or 0) - before.get((r.group, r.topic, r.partition), 0)) / (t1 - t0)
            state = states.get(r.group)
            r.owner = state.owners.get(TopicPartition(r.topic, r.partition), "") if state else ""
        return second, states
    finally:
        await consumer.stop()
        await admin.close()


async def member_of(bootstrap: str, group: str, host: str) -> tuple[bool, str]:
    """Whether a member of `group` on `host` holds at least one partition (a pod's readiness)."""
    admin = AIOKafkaAdminClient(
        bootstrap_servers=bootstrap, **kafka_auth.client_options(), request_timeout_ms=5_000
    )
    await admin.start()
    try:
        state = (await _group_states(admin, [group])).get(group)
    finally:
        await admin.close()
    if state is None or not state.members:
        return False, f"group {group} has no members"
    held = state.hosts.get(host)
    if held is None:
        return False, f"no member of {group} on {host} (members on {', '.join(sorted(state.hosts))})"
    if not held:
        return False, f"the member of {group} on {host} holds no partition (group {state.state})"
    return True, f"member of {group} on {host} holds {held} partition(s)"
