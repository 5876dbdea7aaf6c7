"""Kafka record headers the roles write and read (never part of the event body).

event-type   the event's `type` tag, so a tool can filter records without decoding them
traceparent  W3C trace context of the hop that wrote the record (see schemas.tracing)
"""

from __future__ import annotations

EVENT_TYPE = "event-type"
TRACEPARENT = "traceparent"
