"""The one codec for events: msgspec JSON with a `type` tag and a `v` version.

JSON rather than MessagePack so an auditor can read a topic with any Kafka tool;
msgspec rather than pydantic on this path because it validates while decoding at
several times pydantic's speed, and the token topic carries one event per token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, Union

import msgspec

from schemas.base import SCHEMA_VERSION, Event

SUPPORTED_VERSIONS = frozenset({SCHEMA_VERSION})

E = TypeVar("E", bound=Event)


class DecodeError(Exception):
    """An event could not be decoded. `reason` is meant for the dead-letter topic."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class MalformedEvent(DecodeError):
    """Not JSON, an unknown `type`, a missing field or a field of the wrong type."""


class UnsupportedVersion(DecodeError):
    """Well-formed, but written with a schema version this reader does not know."""

    def __init__(self, reason: str, version: Any) -> None:
        super().__init__(reason)
        self.version = version


_encoder = msgspec.json.Encoder()
_version_probe = msgspec.json.Decoder(dict[str, Any])
_decoders: dict[tuple[type, ...], msgspec.json.Decoder] = {}


def encode(event: Event) -> bytes:
    return _encoder.encode(event)


def _decoder_for(types: tuple[type[Event], ...]) -> msgspec.json.Decoder:
    dec = _decoders.get(types)
    if dec is None:
        target = types[0] if len(types) == 1 else Union[types]  # noqa: UP007
        dec = _decoders[types] = msgspec.json.Decoder(target)
    return dec


def decode(data: bytes, *types: type[E]) -> E:
    """Decode `data` as one of `types` (all event types when none is given).

    Raises MalformedEvent or UnsupportedVersion; never returns a half-valid event.
    """
    if not types:
        from schemas.events import ALL_EVENTS

        types = ALL_EVENTS  # type: ignore[assignment]
    try:
        event = _decoder_for(tuple(types)).decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        version = _peek_version(data)
        if version is not None and version not in SUPPORTED_VERSIONS:
            raise UnsupportedVersion(f"schema version {version!r} is not supported", version) from exc
        raise MalformedEvent(f"malformed event: {exc}") from exc
    except ValueError as exc:  # raised by a Struct's __post_init__ check
        raise MalformedEvent(f"invalid event: {exc}") from exc
    if event.v not in SUPPORTED_VERSIONS:
        raise UnsupportedVersion(f"schema version {event.v!r} is not supported", event.v)
    return event


def decoder(*types: type[E]) -> Callable[[bytes], E]:
    """`decode` bound to `types`, for loops over many records: the same checks and errors."""
    dec = _decoder_for(tuple(types))

    def run(data: bytes) -> E:
        try:
            event = dec.decode(data)
        except (msgspec.ValidationError, msgspec.DecodeError, ValueError):
            return decode(data, *types)  # raises the precise MalformedEvent / UnsupportedVersion
        if event.v not in SUPPORTED_VERSIONS:
            raise UnsupportedVersion(f"schema version {event.v!r} is not supported", event.v)
        return event

    return run


def _peek_version(data: bytes) -> Any:
    try:
        return _version_probe.decode(data).get("v")
    except (msgspec.DecodeError, msgspec.ValidationError, AttributeError):
        return None
