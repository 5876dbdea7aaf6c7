"""The fields every event carries, whatever its kind."""

from __future__ import annotations

import time
from typing import ClassVar

import msgspec

#: Version written into every event. A decoder accepts the versions in
#: `schemas.codec.SUPPORTED_VERSIONS` and rejects any other with UnsupportedVersion.
SCHEMA_VERSION = 1


def _version() -> int:
    return SCHEMA_VERSION


def now() -> float:
    """Wall-clock time in seconds since the epoch, the unit of every `*_at` field."""
    return time.time()


class Event(msgspec.Struct, kw_only=True, tag_field="type", forbid_unknown_fields=False, omit_defaults=True):
    """Base of every event. `type` (the tag) names the concrete class on the wire.

    request_id       one user request, end to end (also the Kafka key on per-request topics)
    conversation_id  the multi-turn conversation the request belongs to
    tenant           who pays: rate limits and routing tiers are per tenant
    created_at       when the event was made (seconds since the epoch)
    v                schema version of the writer

    A field left at its default is not written (a decoder fills it in), except `created_at` and `v`,
    which every record carries: a reader of any version sees which version wrote it.

    `content` names the fields that hold a tenant's content: they are written sealed with a key of the
    tenant's conversation, and read back transparently (schemas/sealing.py, `tokenstream erase`).
    """

    content: ClassVar[frozenset[str]] = frozenset()

    request_id: str
    conversation_id: str = ""
    tenant: str = "default"
    created_at: float = msgspec.field(default_factory=now)
    v: int = msgspec.field(default_factory=_version)  # a factory: written even at its default
