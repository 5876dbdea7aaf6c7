"""Kafka producers and consumers with the settings every role should use."""

from __future__ import annotations

import contextlib

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from common import kafka_auth, sealing
from common.config import settings
from producers.settings import CONSUMER, FOLLOW_FETCH_MAX_WAIT_MS, PRODUCER, liveness
from topics import TopicSpec


async def start_producer(bootstrap: str | None = None, **overrides) -> AIOKafkaProducer:
    """Idempotent producer, acks=all, lz4, no linger (producers/settings.py says why).

    Its process seals tenants' content from now on (common/sealing.py)."""
    sealing.install()
    options = dict(
        bootstrap_servers=bootstrap or settings().kafka_bootstrap, **kafka_auth.client_options(), **PRODUCER
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

    group=None gives a group-less consumer for manual assignment (replays, fan-out), which
    follows its partitions with a short fetch wait (producers/settings.py). Its process opens
    sealed content from now on (common/sealing.py).
    """
    sealing.install()
    options = dict(
        bootstrap_servers=bootstrap or settings().kafka_bootstrap,
        **kafka_auth.client_options(),
        group_id=group,
        auto_offset_reset="earliest" if from_beginning else "latest",
        **CONSUMER,
    )
    if group is None:
        options["fetch_max_wait_ms"] = FOLLOW_FETCH_MAX_WAIT_MS
    else:
        options.update(liveness())
    options.update(overrides)
    consumer = AIOKafkaConsumer(*(s.name for s in specs), **options)
    await consumer.start()
    return consumer


async def stop_clients(*clients) -> None:
    """Stop each client that was started, even when its broker is gone (shutdown must not hang on it)."""
    for client in clients:
        if client is not None:
            with contextlib.suppress(Exception):  # stopping clients of a broker that is gone
                await client.stop()


async def commit_past(consumer: AIOKafkaConsumer, tp, offset: int, log) -> bool:
    """Commit past `offset` of `tp`; False when the partition moved to another member meanwhile (a
    rebalance: the new owner finds the work done, or does it under its own claim, and commits)."""
    from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError

    try:
        await consumer.commit({tp: offset + 1})
        return True
    except (CommitFailedError, IllegalStateError, KafkaError) as exc:
        log.warning("commit of %s@%d failed (%s); the new owner carries on", tp, offset, exc)
        return False
