"""Idempotent effects by request id: a processor that re-reads an event does not emit twice.

Faust runs the processors at-least-once: after a crash, events since the last offset commit
(at most broker_commit_interval ago) are processed again. Before emitting for a request, a
processor asks the ledger whether that effect is already done; after the broker has
acknowledged the output, it records it. Only a process killed between that acknowledgement
and the record (a Redis round trip, about a millisecond) can emit twice; the worker drops a
request id it is already serving or has completed, so the tokens stay unique.

Faust's exactly_once mode was tried first and rejected: it commits an output's transaction
only when the output's *partition number* next commits input offsets, so a re-keyed output
(answers re-keyed by conversation, refusals sent to a reply partition) can wait forever.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from schemas.keys import EFFECT_TTL_S as TTL_S, effect_done
from tokenstream.config import settings



class Ledger:
    def __init__(self, role: str, url: str | None = None) -> None:
        self.role = role
        self._redis = aioredis.Redis.from_url(url or settings().redis_url)

    def _key(self, effect: str, request_id: str) -> str:
        return effect_done(self.role, effect, request_id)

    async def once(self, effect: str, request_id: str, emit: Callable[[], Awaitable[object]]) -> bool:
        """Await `emit()` unless `effect` is already done for `request_id`; False when it was.

        `emit` returns once the broker has acknowledged what it wrote; only then is the effect
        recorded, so a crash in between re-emits rather than loses.
        """
        key = self._key(effect, request_id)
        if await self._redis.exists(key):
            return False
        await emit()
        await self._redis.set(key, 1, ex=TTL_S)
        return True
