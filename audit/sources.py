"""Which topics and partitions an audit reads, decided by the topic registry.

A topic is audited when its spec lists the auditor among its readers. Where a request's or a
conversation's records lie follows from the spec: `placement` "key" means the default
partitioner (murmur2 of the key, as Kafka's Java client and aiokafka compute it),
"reply_partition" means the partition named in the request id (`schemas.ids`).
"""

from __future__ import annotations

from aiokafka.partitioner import murmur2

from schemas.ids import parse_request_id
from schemas.keys import conversation_key
from topics.registry import AUDITOR, REGISTRY, TopicSpec, inference_topic

INFERENCE_PREFIX = "ts.inference."


def audited(existing: list[str]) -> list[TopicSpec]:
    """Registry topics an auditor reads, plus every inference topic that exists on the broker."""
    specs = [s for s in REGISTRY if AUDITOR in s.readers]
    specs += [
        inference_topic(n.removeprefix(INFERENCE_PREFIX))
        for n in sorted(existing)
        if n.startswith(INFERENCE_PREFIX)
    ]
    return [s for s in specs if s.name in set(existing)]


def partition_of(key: str, partitions: int) -> int:
    return (murmur2(key.encode()) & 0x7FFFFFFF) % partitions


def keyed_by_request(spec: TopicSpec) -> bool:
    return spec.key == "request_id"


def conversation_partitions(
    spec: TopicSpec, conversation_id: str, tenant: str | None, partitions: int
) -> list[int]:
    """Where a conversation's records can be on `spec`: none when it is not keyed by conversation;
    every partition of a tenant-scoped key when the tenant is not known."""
    if spec.key == "conversation_id":
        return [partition_of(conversation_id, partitions)]
    if spec.key == "tenant:conversation_id":
        if tenant is None:
            return list(range(partitions))
        return [partition_of(conversation_key(tenant, conversation_id), partitions)]
    return []


def request_partitions(spec: TopicSpec, request_id: str, partitions: int) -> list[int]:
    """Where the records of `request_id` can be on `spec` (every partition when it cannot be told)."""
    if spec.placement == "reply_partition":
        try:
            return [parse_request_id(request_id)[0]]
        except ValueError:
            return list(range(partitions))
    if keyed_by_request(spec):
        return [partition_of(request_id, partitions)]
    return list(range(partitions))


def admitted_ms(request_id: str) -> int | None:
    """Admission time of a gateway-made request id (ms), None for any other id."""
    try:
        return parse_request_id(request_id)[1]
    except ValueError:
        return None
