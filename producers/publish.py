"""Writing and reading typed events, with W3C trace context in the headers."""

from __future__ import annotations

import asyncio

from aiokafka import AIOKafkaProducer
from aiokafka.structs import ConsumerRecord, RecordMetadata

from common.unblocked import unblocked
from schemas import Event, TraceContext, decode, encode
from schemas.headers import EVENT_TYPE as TYPE_HEADER
from topics import TopicSpec


def _headers(event: Event, trace: TraceContext | None) -> list[tuple[str, bytes]]:
    headers = [(TYPE_HEADER, type(event).__struct_config__.tag.encode())]
    if trace is not None:
        headers += trace.headers()
    return headers


async def publish(
    producer: AIOKafkaProducer,
    spec: TopicSpec,
    event: Event,
    *,
    key: str | None = None,
    partition: int | None = None,
    trace: TraceContext | None = None,
    wait: bool = True,
) -> RecordMetadata | asyncio.Future[RecordMetadata]:
    """Write `event` to `spec`. The key defaults to the event's request_id.

    wait=True returns the broker's acknowledgement (acks=all: the event is durable).
    wait=False returns as soon as the event is queued in the producer's batch, with the
    future of that acknowledgement: many events then share one produce request.
    """
    if not isinstance(event, spec.events):
        raise TypeError(f"{type(event).__name__} does not belong on topic {spec.name}")
    future = await producer.send(
        spec.name,
        await unblocked(encode, event),  # a key not held: fetched in a thread, never on the loop
        key=(key if key is not None else event.request_id).encode(),
        partition=partition,
        headers=_headers(event, trace),
    )
    return await future if wait else future


def decode_record(record: ConsumerRecord, spec: TopicSpec) -> Event:
    """Decode a record as one of the event types its topic carries (raises DecodeError). On an event loop:
    `await unblocked(decode_record, record, spec)` (common/unblocked.py)."""
    return decode(record.value or b"", *spec.events)


def trace_of(record: ConsumerRecord) -> TraceContext | None:
    return TraceContext.from_headers(record.headers)
