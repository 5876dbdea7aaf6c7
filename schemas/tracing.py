"""W3C trace context (traceparent) carried in Kafka headers, never in the event body."""

from __future__ import annotations

import re
import secrets

import msgspec

from schemas.headers import TRACEPARENT

_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
HEADER = TRACEPARENT


class TraceContext(msgspec.Struct, frozen=True):
    trace_id: str
    span_id: str
    flags: str = "01"

    @classmethod
    def new(cls) -> TraceContext:
        return cls(secrets.token_hex(16), secrets.token_hex(8))

    def child(self) -> TraceContext:
        """Same trace, new span: what a processor uses for the events it writes."""
        return TraceContext(self.trace_id, secrets.token_hex(8), self.flags)

    @property
    def traceparent(self) -> str:
        return f"00-{self.trace_id}-{self.span_id}-{self.flags}"

    @classmethod
    def parse(cls, value: str | bytes | None) -> TraceContext | None:
        if value is None:
            return None
        if isinstance(value, bytes):
            value = value.decode("ascii", "replace")
        m = _TRACEPARENT.match(value.strip())
        return cls(m.group(1), m.group(2), m.group(3)) if m else None

    def headers(self) -> list[tuple[str, bytes]]:
        return [(HEADER, self.traceparent.encode())]

    @classmethod
    def from_headers(cls, headers: list[tuple[str, bytes]] | tuple | None) -> TraceContext | None:
        for key, value in headers or ():
            if key == HEADER:
                return cls.parse(value)
        return None
