"""Warming a benchmark's freshly started broker before anything is measured (see `warm_broker`)."""

from __future__ import annotations

WARM_ROUND_TRIPS = 2000  # untimed produce -> fetch round trips
WARM_TOPIC = "bench.warm-up"


async def warm_broker(bootstrap: str, round_trips: int = WARM_ROUND_TRIPS, say=print) -> None:
    """Untimed produce -> fetch round trips on a scratch topic before any request is measured.

    The benchmark's broker starts with the run, and a JVM runs a code path interpreted until it
    has been called thousands of times: on this 2-core host one acknowledged produce and its fetch
    took 4.0 ms p50 over a fresh broker's first 60 round trips and 1.8-2.4 ms after 800 (measured
    while the local broker still ran the JVM's C2 compiler; it runs C1 only now, which compiles
    sooner, and the warm-up stays as the cheap guarantee of a steady state). A
    request of `bench pipeline` crosses five broker hops, so a cold broker added some 10 ms to its
    every figure, a cost a running deployment paid once, days ago. (Tried in `bench engine`'s
    worker run too: the broker's CPU during the measured run stayed 1.3-1.5 s, so not used there.)
    """
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic
    from aiokafka.structs import TopicPartition

    from common import kafka_auth
    from producers import start_consumer, start_producer

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **kafka_auth.client_options())
    await admin.start()
    try:
        await admin.create_topics([NewTopic(WARM_TOPIC, 1, 1)])
        producer = await start_producer(bootstrap)
        consumer = await start_consumer(group=None, bootstrap=bootstrap)
        tp = TopicPartition(WARM_TOPIC, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        try:
            for i in range(round_trips):
                await (await producer.send(WARM_TOPIC, b"warm-up", key=b"warm-up"))
                while not await consumer.getmany(tp, timeout_ms=1000):
                    pass
                if (i + 1) % 500 == 0:
                    say(f"broker warm-up: {i + 1}/{round_trips} round trips")
        finally:
            await consumer.stop()
            await producer.stop()
        await admin.delete_topics([WARM_TOPIC])
    finally:
        await admin.close()
