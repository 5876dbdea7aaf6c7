"""Once per call id: a claim while a call runs, its result once it completed, a mark once published.

    claim      SET NX with a lease renewed while the call runs. A processor killed mid-run stops
               renewing; the lease lapses and the next processor to read the call runs it again
               (the run it interrupted never completed, so the call still completes once).
    result     the encoded ToolResult, written when the run completes and before it is published:
               a processor that dies after this replays the stored result, it never re-runs.
    published  set after the broker acknowledged the result; a call read again is then skipped.

Only a process killed between the acknowledgement and the `published` mark (one Redis round trip)
publishes a result twice, and then the same result (same call id, same output).
"""

from __future__ import annotations

import asyncio
import contextlib

import redis.asyncio as aioredis

from schemas import ToolResult, decode, encode
from schemas.keys import EFFECT_TTL_S, tool_claim, tool_published, tool_result
from common.config import settings


class CallLedger:
    def __init__(self, owner: str, lease_s: float, url: str | None = None) -> None:
        self.owner, self.lease_ms = owner, max(1, int(lease_s * 1000))
        self.redis = aioredis.Redis.from_url(url or settings().redis_url)

    async def close(self) -> None:
        await self.redis.aclose()

    async def published(self, call_id: str) -> bool:
        return bool(await self.redis.exists(tool_published(call_id)))

    async def result(self, call_id: str) -> ToolResult | None:
        raw = await self.redis.get(tool_result(call_id))
        return decode(raw, ToolResult) if raw else None

    async def claim(self, call_id: str) -> bool:
        """True when this process now holds the call (no live processor holds it)."""
        return bool(await self.redis.set(tool_claim(call_id), self.owner, nx=True, px=self.lease_ms))

    async def release(self, call_id: str) -> None:
        await self.redis.delete(tool_claim(call_id))

    @contextlib.asynccontextmanager
    async def holding(self, call_id: str):
        """Renew the claim every third of the lease while the body runs."""
        async def renew() -> None:
            while True:
                await asyncio.sleep(self.lease_ms / 3000)
                await self.redis.set(tool_claim(call_id), self.owner, xx=True, px=self.lease_ms)

        task = asyncio.create_task(renew())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def complete(self, result: ToolResult) -> ToolResult:
        """Store `result` unless one is stored already; return the stored one (the one to publish)."""
        if await self.redis.set(tool_result(result.call_id), encode(result), nx=True, ex=EFFECT_TTL_S):
            return result
        return await self.result(result.call_id) or result

    async def mark_published(self, call_id: str) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(tool_published(call_id), 1, ex=EFFECT_TTL_S)
            pipe.delete(tool_claim(call_id))
            await pipe.execute()
