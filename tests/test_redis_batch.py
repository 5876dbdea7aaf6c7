"""common/redis_batch.py against a real Redis: calls made together go as one script call, each caller
gets its own result, and an error reaches every caller of the batch."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from common.redis_batch import Batched

# one call: INCRBY KEYS[1] by ARGV[1]; the batched form does it for each call and answers each new value
INCR_EACH = """
local out = {}
for j = 1, #KEYS do out[j] = redis.call('INCRBY', KEYS[j], tonumber(ARGV[j])) end
return out
"""


async def test_concurrent_calls_share_one_script_call_and_get_their_own_results(stack, unique):
    client = aioredis.Redis.from_url(stack.redis.address)
    script = client.register_script(INCR_EACH)
    sent = []

    async def counted(keys, args):
        sent.append(len(keys))
        return await script(keys=keys, args=args)

    batched = Batched(counted, 1, 1, most=3)
    try:
        await client.set(f"{unique}:5", 100)
        got = await asyncio.gather(*(batched([f"{unique}:{i}"], [i]) for i in range(7)))
        assert sent == [3, 3, 1]  # gathered in one pass of the loop, sent at most 3 at a time
        assert got == [0, 1, 2, 3, 4, 105, 6]
        await client.set(f"{unique}:text", "not a number")
        with pytest.raises(aioredis.ResponseError):
            await asyncio.gather(batched([f"{unique}:text"], [1]), batched([f"{unique}:0"], [1]))
        with pytest.raises(ValueError):
            await batched([f"{unique}:0", f"{unique}:1"], [1])
    finally:
        await client.aclose()
