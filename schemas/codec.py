"""The one codec for events: msgspec JSON with a `type` tag and a `v` version, content sealed.

JSON rather than MessagePack so an auditor can read a topic with any Kafka tool;
msgspec rather than pydantic on this path because it validates while decoding at
several times pydantic's speed, and the token topic carries one event per token.
A tenant's content is sealed on the way out and opened on the way in by the keyring the process
installed (`use_sealer`; common/sealing.py), so every role reads and writes plain events
(schemas/sealing.py says what is sealed and why).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, Union

import msgspec

from schemas.base import SCHEMA_VERSION, Event
from schemas.errors import DecodeError, Erased, MalformedEvent, UnsupportedVersion  # noqa: F401 - re-exported
from schemas.sealing import Sealer, seal, unseal

SUPPORTED_VERSIONS = frozenset({SCHEMA_VERSION})

E = TypeVar("E", bound=Event)


_encoder = msgspec.json.Encoder()
_version_probe = msgspec.json.Decoder(dict[str, Any])
_decoders: dict[tuple[type, ...], msgspec.json.Decoder] = {}


_sealer: Sealer | None = None


def use_sealer(sealer: Sealer | None) -> None:
    """Seal content with `sealer` from now on in this process (None: write it in clear, as unit tests do)."""
    global _sealer
    _sealer = sealer


def sealer() -> Sealer | None:
    return _sealer


def encode(event: Event) -> bytes:
    if _sealer is not None:
        sealed = seal(event, _sealer)
        if sealed is not None:
            return sealed
    return _encoder.encode(event)


def _decoder_for(types: tuple[type[Event], ...]) -> msgspec.json.Decoder:
    dec = _decoders.get(types)
    if dec is None:
        target = types[0] if len(types) == 1 else Union[types]  # noqa: UP007
        dec = _decoders[types] = msgspec.json.Decoder(target)
    return dec


def decode(data: bytes, *types: type[E]) -> E:
    """Decode `data` as one of `types` (all event types when none is given).

    Raises MalformedEvent or UnsupportedVersion (Erased for content whose key was destroyed);
    never returns a half-valid event.
    """
    data = unseal(data, _sealer)
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
            event = dec.decode(unseal(data, _sealer))
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
