"""The gateway's tokens fan-out through a failure of its reading: the real pipeline object of a gateway
(gateway/pipeline.py) against the real broker, its consumer made to fail mid-stream. Every live stream
keeps its place and gets each of its tokens once, in order."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from aiokafka.errors import KafkaConnectionError

from gateway.config import GatewaySettings
from gateway.pipeline import Gateway
from producers import publish, start_producer
from schemas import Completion, TokenChunk
from topics import CONTROL, TOKENS
from topics.admin import apply

pytestmark = pytest.mark.slow
STREAMS, TOKENS_EACH = 24, 30


async def _wait(condition, timeout: float) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.05)


async def _read(stream, seen: dict[str, int]) -> str:
    """The text of one stream's chunks, up to its Completion; `seen` counts its chunks."""
    text = ""
    while True:
        for event in await stream.take(timeout=30):
            if isinstance(event, Completion):
                return text
            text += event.text
            seen[stream.request_id] = event.seq + 1


async def test_live_streams_survive_a_failure_of_the_fanout_reading(stack, unique):
    await apply([TOKENS, CONTROL], stack.kafka.address)
    gw = Gateway(GatewaySettings(models=["smollm2"]), stack.kafka.address, redis_url=None)
    connect = asyncio.create_task(gw._connect())
    producer = await start_producer(stack.kafka.address)
    try:
        await _wait(lambda: gw.streaming, 60)
        fanout = gw.fanout
        rids = [f"fault-{unique}-{i}" for i in range(STREAMS)]
        partition = {rid: gw.partitions[i % len(gw.partitions)] for i, rid in enumerate(rids)}
        seen: dict[str, int] = {}
        readers = [asyncio.create_task(_read(fanout.subscribe(rid), seen)) for rid in rids]
        failures = 0

        async def fail_once(*args, **kwargs):
            nonlocal failures
            failures += 1
            raise KafkaConnectionError("the fan-out's connection dropped (injected)")

        for seq in range(TOKENS_EACH):
            if seq == TOKENS_EACH // 2:  # mid-stream: the next read of the fan-out fails
                await producer.flush()
                await _wait(lambda half=seq: all(seen.get(rid) == half for rid in rids), 30)
                fanout.consumer.getmany = fail_once
                await _wait(lambda: failures == 1, 10)
            for rid in rids:
                await publish(
                    producer,
                    TOKENS,
                    TokenChunk(request_id=rid, seq=seq, text=f" t{seq}"),
                    partition=partition[rid],
                    wait=False,
                )
        for rid in rids:
            await publish(
                producer,
                TOKENS,
                Completion(request_id=rid, seq=TOKENS_EACH, finish_reason="stop"),
                partition=partition[rid],
                wait=False,
            )
        await producer.flush()
        texts = await asyncio.wait_for(asyncio.gather(*readers), 60)
        assert failures == 1 and gw.fanout is fanout and gw.streaming
        expected = "".join(f" t{seq}" for seq in range(TOKENS_EACH))
        assert texts == [expected] * STREAMS  # every token once, in order, on every stream
    finally:
        connect.cancel()
        with contextlib.suppress(BaseException):
            await connect
        await producer.stop()
        if gw.producer is not None:
            await gw.producer.stop()
        if gw.fanout is not None and gw.fanout.consumer is not None:
            await gw.fanout.consumer.stop()
        await gw.canceller.close()
        await gw.admission.close()
        await gw.semantic_cache.close()
        await gw.searches.close()
