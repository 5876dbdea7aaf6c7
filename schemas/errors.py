"""Why an event could not be read: what a consumer dead-letters (or, for Erased, skips)."""

from __future__ import annotations

from typing import Any


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


class Erased(DecodeError):
    """A sealed event whose key was destroyed (`tokenstream erase`): its content is gone for good, its
    clear fields remain. Readers skip it (it is not malformed); `clear` holds those fields (ids, times,
    tenant, the event's `type`) for an audit to show."""

    def __init__(self, reason: str, clear: dict[str, Any]) -> None:
        super().__init__(reason)
        self.clear = clear
