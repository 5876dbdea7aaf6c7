"""The event contracts and client helpers against the real Kafka broker."""

from __future__ import annotations

import asyncio

from aiokafka.admin import AIOKafkaAdminClient

from common import kafka_auth
from producers import events, publish, start_consumer, start_producer
from producers.publish import decode_record, trace_of
from schemas import ALL_EVENTS, DeadLetter, TokenChunk, TraceContext
from tests.test_schemas import sample_events
from topics import DEAD_LETTER, TopicSpec
from topics.admin import apply, describe


def spec(name: str, partitions: int = 3, events=ALL_EVENTS, **configs: str) -> TopicSpec:
    return TopicSpec(
        name, partitions, "request_id", tuple(events), "test topic", {"cleanup.policy": "delete", **configs}
    )


async def consume_n(consumer, n: int, timeout: float = 30.0) -> list:
    out = []
    deadline = asyncio.get_running_loop().time() + timeout
    while len(out) < n and asyncio.get_running_loop().time() < deadline:
        for records in (await consumer.getmany(timeout_ms=500)).values():
            out.extend(records)
    return out


async def test_every_event_type_round_trips_through_the_broker(bootstrap, unique):
    topic = spec(f"test.roundtrip.{unique}")
    await apply([topic], bootstrap)
    producer = await start_producer(bootstrap)
    consumer = await start_consumer(topic, group=f"g-{unique}", bootstrap=bootstrap, from_beginning=True)
    trace = TraceContext.new()
    try:
        sent = sample_events()
        for event in sent:
            await publish(producer, topic, event, trace=trace)
        records = await consume_n(consumer, len(sent))
        received = sorted((decode_record(r, topic) for r in records), key=lambda e: type(e).__name__)
        assert received == sorted(sent, key=lambda e: type(e).__name__)
        assert all(trace_of(r) == trace for r in records)
        assert all(r.key == b"req-1" for r in records)
        # one key, one partition: the order of a request's events is the order they were written
        assert [type(decode_record(r, topic)) for r in records] == [type(e) for e in sent]
    finally:
        await consumer.stop()
        await producer.stop()


async def test_malformed_event_goes_to_dead_letter_and_the_next_one_is_processed(bootstrap, unique):
    topic = spec(f"test.dlq.{unique}", partitions=1, events=(TokenChunk,))
    await apply([topic, DEAD_LETTER], bootstrap)
    producer = await start_producer(bootstrap)
    dlq = await start_consumer(DEAD_LETTER, group=None, bootstrap=bootstrap)
    await dlq.seek_to_end()
    consumer = await start_consumer(topic, group=f"g-{unique}", bootstrap=bootstrap, from_beginning=True)
    try:
        await (await producer.send(topic.name, b'{"type": "token_chunk", "seq": "x"}', key=b"bad-1"))
        good = TokenChunk(request_id="good-1", seq=0, text="ok")
        await publish(producer, topic, good)

        processed = []
        stream = events(consumer, producer, {topic.name: topic}, group=f"g-{unique}")
        event, record = await asyncio.wait_for(anext(stream), 30)
        processed.append(event)
        await consumer.commit()
        assert processed == [good]
        assert record.offset == 1  # the bad record at offset 0 was skipped, not retried forever

        letters = [decode_record(r, DEAD_LETTER) for r in await consume_n(dlq, 1)]
        letters = [x for x in letters if x.source_topic == topic.name]
        assert len(letters) == 1
        letter: DeadLetter = letters[0]
        assert letter.source_partition == 0 and letter.source_offset == 0
        assert letter.payload == b'{"type": "token_chunk", "seq": "x"}'
        assert letter.key == b"bad-1" and letter.request_id == "bad-1"
        assert letter.error_type == "MalformedEvent" and "seq" in letter.reason
        assert letter.consumer_group == f"g-{unique}"
    finally:
        await consumer.stop()
        await dlq.stop()
        await producer.stop()


async def test_topics_apply_is_idempotent_and_updates_changed_configs(bootstrap, unique):
    name = f"test.apply.{unique}"
    first = await apply([spec(name, 2, **{"retention.ms": "3600000"})], bootstrap)
    assert [(c.topic, c.action) for c in first] == [(name, "created")]
    again = await apply([spec(name, 2, **{"retention.ms": "3600000"})], bootstrap)
    assert [(c.action, c.detail) for c in again] == [("unchanged", "")]

    changed = await apply([spec(name, 4, **{"retention.ms": "7200000"})], bootstrap)
    assert changed[0].action == "updated"
    assert "retention.ms=7200000" in changed[0].detail and "partitions 2->4" in changed[0].detail
    [info] = await describe([name], bootstrap)
    assert info.partitions == 4
    assert info.configs["retention.ms"] == "7200000"
    assert (await apply([spec(name, 4, **{"retention.ms": "7200000"})], bootstrap))[0].action == "unchanged"


async def test_acknowledged_events_survive_a_broker_restart(stack, unique):
    bootstrap = stack.kafka.address
    topic = spec(f"test.durable.{unique}", partitions=3, events=(TokenChunk,))
    await apply([topic], bootstrap)
    n = 500
    producer = await start_producer(bootstrap)
    try:
        events_ = [TokenChunk(request_id=f"r{i % 7}", seq=i, text=str(i)) for i in range(n)]
        pending = [await publish(producer, topic, e, wait=False) for e in events_]
        acked = await asyncio.gather(*pending)  # acks=all: each of these is on the log for good
        assert len({(m.partition, m.offset) for m in acked}) == n
    finally:
        await producer.stop()

    stack.kafka.stop(say=lambda _m: None)
    assert stack.kafka.pid() is None
    stack.kafka.start(say=lambda _m: None)

    consumer = await start_consumer(topic, group=f"g-{unique}", bootstrap=bootstrap, from_beginning=True)
    try:
        records = await consume_n(consumer, n, timeout=60)
        seqs = sorted(decode_record(r, topic).seq for r in records)
        assert seqs == list(range(n))
    finally:
        await consumer.stop()
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **kafka_auth.client_options())
    await admin.start()
    try:
        assert topic.name in await admin.list_topics()
    finally:
        await admin.close()
