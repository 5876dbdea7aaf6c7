"""Where an event that cannot be processed goes, with everything needed to inspect or replay it."""

from __future__ import annotations

import msgspec

from schemas.base import Event


class DeadLetter(Event, tag="dead_letter"):
    """request_id is the original key when there was one (or "").

    payload is the original value, untouched; headers are the original Kafka headers.
    """

    reason: str
    error_type: str
    source_topic: str
    source_partition: int
    source_offset: int
    consumer_group: str = ""
    payload: bytes = b""
    key: bytes | None = None
    headers: list[tuple[str, bytes]] = msgspec.field(default_factory=list)


def letter_of(record, value: bytes, reason: str, error_type: str, group: str) -> DeadLetter:
    """The dead letter of `record` (aiokafka's or faust's record, or a step record's entry: its topic,
    partition, offset, key and headers, pairs or a mapping) whose value is `value`."""
    key = record.key if isinstance(record.key, bytes) else None
    headers = record.headers or ()
    items = headers.items() if isinstance(headers, dict) else headers
    return DeadLetter(
        request_id=key.decode("utf-8", "replace") if key else "",
        reason=reason,
        error_type=error_type,
        source_topic=record.topic,
        source_partition=record.partition,
        source_offset=record.offset,
        consumer_group=group,
        payload=value,
        key=key,
        headers=[(k, bytes(v)) for k, v in items],
    )
