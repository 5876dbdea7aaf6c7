"""The consume loop every role shares: decode, dead-letter what cannot be decoded, move on."""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import ConsumerRecord, TopicPartition

from common.unblocked import unblocked
from producers.deadletter import dead_letter
from producers.publish import decode_record
from schemas import DecodeError, Event
from schemas.steps import unpack_all
from topics import TopicSpec


async def events(
    consumer: AIOKafkaConsumer,
    producer: AIOKafkaProducer,
    specs: dict[str, TopicSpec],
    *,
    group: str = "",
    timeout_ms: int = 200,
) -> AsyncIterator[tuple[Event, ConsumerRecord]]:
    """Yield (event, record) for every decodable record, in partition order.

    A step record (schemas/steps.py) yields its chunks, each with its `Unpacked` record.
    A record that fails to decode is written to the dead-letter topic (acknowledged
    before this continues) and skipped, an erased one (`tokenstream erase`) only skipped;
    the caller commits offsets as its effects land.
    `specs` maps each subscribed topic name to its registry entry.
    """
    while True:
        batches = await consumer.getmany(timeout_ms=timeout_ms)
        for records in batches.values():
            for record in unpack_all(records):
                try:
                    event = await unblocked(decode_record, record, specs[record.topic])
                except DecodeError as exc:  # (an erased record is only passed over)
                    await dead_letter(producer, record, exc, group=group)
                    continue
                yield event, record


async def caught_up(consumer: AIOKafkaConsumer, ends: dict[TopicPartition, int]) -> bool:
    """True once the consumer's position has reached `ends` on every partition (a replay is done)."""
    for tp, end in ends.items():
        if await consumer.position(tp) < end:
            return False
    return True
