"""The worker benchmarks' client, in a process of its own as the gateway is in production: it sends
requests to the worker's inference topic and reads their tokens from ts.tokens.

    python -m bench.worker_client BOOTSTRAP SPEC.json OUT.json

SPEC holds the model, the untimed warm-up requests and the measured ones (request id, arrival
offset in seconds, messages, max_tokens). A handshake on stdin / stdout lets the worker's side
start its clocks with the measured run: the client prints `warm` once the warm-up's answers are in
(its consumer already sits on ts.tokens, so no measured token is missed), waits for a line on
stdin, sends the measured requests at their arrival times, and writes to OUT when every one of
them has its Completion: when each was sent, when each of its chunks arrived (with its token
count), the token ids read, the completion token counts, the run's wall time and its own CPU.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path


def _request(spec: dict, i: int, r: dict):
    from schemas import ChatMessage, InferenceRequest, SamplingParams
    from topics import TOKENS

    # each request its own conversation, as a gateway's new chats are: a conversation key of its own
    return InferenceRequest(
        request_id=r["rid"],
        conversation_id=r["rid"],
        tenant="bench",
        model=spec["model"],
        reply_partition=i % TOKENS.partitions,
        messages=[ChatMessage(**m) for m in r["messages"]],
        sampling=SamplingParams(max_tokens=r["max_tokens"], temperature=0),
    )


async def run(bootstrap: str, spec: dict) -> dict:
    from aiokafka import AIOKafkaConsumer
    from aiokafka.structs import TopicPartition

    from common import kafka_auth
    from producers import decode_record, publish, start_producer
    from schemas import Completion
    from schemas.steps import unpack_all
    from topics import TOKENS, inference_topic

    topic = inference_topic(spec["model"])
    producer = await start_producer(bootstrap)
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, **kafka_auth.client_options(), enable_auto_commit=False
    )
    await consumer.start()
    tps = [TopicPartition(TOKENS.name, p) for p in range(TOKENS.partitions)]
    consumer.assign(tps)
    await consumer.seek_to_end(*tps)
    for tp in tps:
        await consumer.position(tp)

    async def read(until, take) -> None:
        """Read ts.tokens until `until()`, handing `take` each event and when its fetch arrived."""
        while not until():
            for records in (await consumer.getmany(timeout_ms=100)).values():
                now = time.perf_counter()
                for rec in unpack_all(records):  # a step record: its chunks, in order
                    take(decode_record(rec, TOKENS), now)

    try:
        pending = {r["rid"] for r in spec["warm"]}
        for i, r in enumerate(spec["warm"]):
            await publish(producer, topic, _request(spec, i, r), wait=False)
        await read(
            lambda: not pending, lambda ev, _: isinstance(ev, Completion) and pending.discard(ev.request_id)
        )
        print("warm", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)

        work = spec["requests"]
        sent: dict[str, float] = {}
        chunks: dict[str, list[tuple[float, int]]] = {r["rid"]: [] for r in work}
        outputs: dict[str, list[int]] = {}
        done: dict[str, int] = {}

        async def feed() -> None:
            t0 = time.perf_counter()
            for i, r in enumerate(work):
                wait = r["arrival"] - (time.perf_counter() - t0)
                if wait > 0:
                    await asyncio.sleep(wait)
                sent[r["rid"]] = time.perf_counter()
                await publish(producer, topic, _request(spec, i, r), wait=False)

        def take(ev, now: float) -> None:
            if ev.request_id not in chunks:
                return
            if isinstance(ev, Completion):
                done[ev.request_id] = ev.usage.completion_tokens
            else:
                chunks[ev.request_id].append((now, len(ev.token_ids)))
                outputs.setdefault(ev.request_id, []).extend(ev.token_ids)  # in order per request

        cpu0, t0 = time.process_time(), time.perf_counter()
        feeder = asyncio.create_task(feed())
        await read(lambda: len(done) == len(work), take)
        wall = time.perf_counter() - t0
        await feeder
        return {
            "sent": sent,
            "chunks": chunks,
            "outputs": outputs,
            "completion_tokens": done,
            "wall_s": wall,
            "cpu_s": round(time.process_time() - cpu0, 2),
        }
    finally:
        await consumer.stop()
        await producer.stop()


if __name__ == "__main__":
    import logging

    logging.getLogger("aiokafka").setLevel(logging.ERROR)
    bootstrap, src, dst = sys.argv[1:4]
    got = asyncio.run(run(bootstrap, json.loads(Path(src).read_text())))
    Path(dst).write_text(json.dumps(got))
