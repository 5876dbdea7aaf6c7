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
