"""Kafka producers and consumers with the settings every role should use."""

from __future__ import annotations

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from tokenstream.config import settings
from topics import TopicSpec


async def start_producer(bootstrap: str | None = None, **overrides) -> AIOKafkaProducer:
    """Idempotent producer, acks=all: an acknowledged event survives a broker restart and
    a retried send is never written twice. lz4 and a 5 ms linger batch token events of
    many requests into one produce request without adding visible latency."""
    options = dict(
        bootstrap_servers=bootstrap or settings().kafka_bootstrap,
        acks="all",
        enable_idempotence=True,
        compression_type="lz4",
        linger_ms=5,
        max_batch_size=256 * 1024,
        request_timeout_ms=30_000,
    )
    options.update(overrides)
    producer = AIOKafkaProducer(**options)
    await producer.start()
    return producer


async def start_consumer(
    *specs: TopicSpec,
    group: str | None,
    bootstrap: str | None = None,
    from_beginning: bool = False,
    **overrides,
) -> AIOKafkaConsumer:
    """Consumer with manual commits (commit after the effect is durable, never before).

    group=None gives a group-less consumer for manual assignment (replays, fan-out).
    """
    options = dict(
        bootstrap_servers=bootstrap or settings().kafka_bootstrap,
        group_id=group,
        enable_auto_commit=False,
        auto_offset_reset="earliest" if from_beginning else "latest",
        isolation_level="read_committed",
        max_poll_records=500,
    )
    options.update(overrides)
    consumer = AIOKafkaConsumer(*(s.name for s in specs), **options)
    await consumer.start()
    return consumer
