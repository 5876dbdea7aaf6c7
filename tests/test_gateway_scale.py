"""Fan-out at scale, the small form of `tokenstream bench gateway`: 500 live SSE streams through one
real gateway process, every token of every stream delivered once and in order.

The tokens come from the benchmark's synthetic worker (it reads ts.chat.requests and writes token
events to each request's reply partition); the gateway, Kafka, Redis and sealing are the real ones.
A change that breaks fan-out past a few hundred streams (a Redis pool that refuses the 101st
concurrent command did) fails here.
"""

from __future__ import annotations

import resource

import psutil
import pytest

from bench.gateway import SyntheticWorker, fanout, synthetic_gateway

pytestmark = pytest.mark.slow
STREAMS = 500
TOKENS = 8


async def test_every_token_of_500_concurrent_streams_arrives_in_order(stack, tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    async with synthetic_gateway(stack, tmp_path, "scale test") as (gateway, port, key):
        worker = await SyntheticWorker(stack.kafka.address).start()
        try:
            result = await fanout(port, key, worker, psutil.Process(gateway.pid), STREAMS, 4.0, TOKENS)
        finally:
            await worker.stop()
    assert result["streams_open"] == STREAMS and result["connect_errors"] == 0, result
    assert result["tokens_delivered"] == STREAMS * TOKENS and result["tokens_missing"] == 0, result
    assert result["frames_out_of_order"] == 0, result
