"""Once per call id: a claim while a call runs, its result once it completed, a mark once published.

    claim      SET NX of this processor's token with a lease renewed while the call runs. A processor
               killed mid-run stops renewing; the lease lapses and the next processor to read the call
               runs it again (the run it interrupted never completed, so the call still completes once).
               Renewing and releasing act only while the claim still holds this processor's token
               (one Lua script each, so the check and the act are one step in Redis): a processor
               stalled past its lease finds another's claim and leaves it alone.
    result     the encoded ToolResult, written when the run completes and before it is published:
               a processor that dies after this replays the stored result, it never re-runs.
    published  set after the broker acknowledged the result; a call read again is then skipped.

Replaying a stored result takes the claim too, and a result stored but not marked is first looked
for in the log (tools/published_check.py): a process killed between the broker's acknowledgement
and the `published` mark does not make its result written twice. Only a processor stalled past its
lease (not dead) can still publish a result another has published, and then the same result (same
call id, same output).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import redis.asyncio as aioredis

from common.config import settings
from common.unblocked import unblocked
from schemas import ToolResult, decode, encode
from schemas.keys import EFFECT_TTL_S, tool_claim, tool_published, tool_result

log = logging.getLogger("tools.ledger")

# KEYS[1] the claim; ARGV[1] the holder's token (ARGV[2] the lease, ms). 1 when done, 0 when not ours.
RENEW = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end "
    "return 0"
)
RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
# KEYS[1] the published mark, KEYS[2] the claim; ARGV[1] the token, ARGV[2] the mark's lifetime (s)
PUBLISHED = (
    "redis.call('set', KEYS[1], 1, 'EX', ARGV[2]) "
    "if redis.call('get', KEYS[2]) == ARGV[1] then redis.call('del', KEYS[2]) end return 1"
)


class CallLedger:
    def __init__(self, owner: str, lease_s: float, url: str | None = None) -> None:
        self.owner, self.lease_ms = owner, max(1, int(lease_s * 1000))
        self.redis = aioredis.Redis.from_url(url or settings().redis_url)
        self._renew, self._release = self.redis.register_script(RENEW), self.redis.register_script(RELEASE)
        self._published = self.redis.register_script(PUBLISHED)

    async def close(self) -> None:
        await self.redis.aclose()

    async def published(self, call_id: str) -> bool:
        return bool(await self.redis.exists(tool_published(call_id)))

    async def result(self, call_id: str) -> ToolResult | None:
        raw = await self.redis.get(tool_result(call_id))
        return await unblocked(decode, raw, ToolResult) if raw else None

    async def claim(self, call_id: str) -> bool:
        """True when this process now holds the call (no live processor holds it)."""
        return bool(await self.redis.set(tool_claim(call_id), self.owner, nx=True, px=self.lease_ms))

    async def renew(self, call_id: str) -> bool:
        """Extend this process's claim by a lease; False (and nothing done) when the claim is not its own."""
        return bool(await self._renew(keys=[tool_claim(call_id)], args=[self.owner, self.lease_ms]))

    async def release(self, call_id: str) -> bool:
        """Drop this process's claim; False (and nothing done) when the claim is not its own."""
        return bool(await self._release(keys=[tool_claim(call_id)], args=[self.owner]))

    @contextlib.asynccontextmanager
    async def holding(self, call_id: str):
        """Renew the claim every third of the lease while the body runs; stop once it is another's."""

        async def renew() -> None:
            while True:
                await asyncio.sleep(self.lease_ms / 3000)
                if not await self.renew(call_id):
                    log.warning(
                        "the claim of call %s lapsed and is held by another processor (or none): "
                        "this run goes on; only the first result stored is published",
                        call_id,
                    )
                    return

        task = asyncio.create_task(renew())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def complete(self, result: ToolResult) -> ToolResult:
        """Store `result` unless one is stored already; return the stored one (the one to publish)."""
        sealed = await unblocked(encode, result)
        if await self.redis.set(tool_result(result.call_id), sealed, nx=True, ex=EFFECT_TTL_S):
            return result
        return await self.result(result.call_id) or result

    async def mark_published(self, call_id: str) -> None:
        """Mark the call published and drop the claim if it is still this process's (one step)."""
        await self._published(
            keys=[tool_published(call_id), tool_claim(call_id)], args=[self.owner, EFFECT_TTL_S]
        )
