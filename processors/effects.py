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

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from common.config import settings
from schemas.keys import EFFECT_TTL_S as TTL_S
from schemas.keys import effect_done

log = logging.getLogger(__name__)


class RedisUnavailable(RuntimeError):
    """Redis stayed unreachable for longer than the outage budget: the process should exit."""


class Ledger:
    """Per-request records in Redis. A Redis outage is ridden out: each call retries with back-off
    (0.1 s doubling to 1 s) for up to `outage_s` (TOKENSTREAM_REDIS_OUTAGE_S), holding the agent's
    input meanwhile; beyond that it raises RedisUnavailable, which ends the process (see
    processors.faust_app.make_app) so that its supervisor restarts it."""

    def __init__(self, role: str, url: str | None = None, outage_s: float | None = None) -> None:
        self.role = role
        self.outage_s = settings().redis_outage_s if outage_s is None else outage_s
        # one retry policy, ours (time-bounded), instead of the client's own
        self._redis = aioredis.Redis.from_url(
            url or settings().redis_url,
            socket_timeout=2,
            socket_connect_timeout=1,
            retry=Retry(NoBackoff(), 0),
        )

    async def _patiently(self, call: Callable[[], Awaitable[object]]) -> object:
        deadline = time.monotonic() + self.outage_s
        delay, warned = 0.1, False
        while True:
            try:
                result = await call()
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                if time.monotonic() + delay > deadline:
                    raise RedisUnavailable(f"redis unreachable for {self.outage_s:.0f}s: {exc}") from exc
                if not warned:
                    log.warning(
                        "%s: redis unreachable (%s); retrying for up to %.0fs, input held",
                        self.role,
                        exc,
                        self.outage_s,
                    )
                    warned = True
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            if warned:
                log.warning("%s: redis reachable again", self.role)
            return result

    def _key(self, effect: str, request_id: str) -> str:
        return effect_done(self.role, effect, request_id)

    async def once(self, effect: str, request_id: str, emit: Callable[[], Awaitable[object]]) -> bool:
        """Await `emit()` unless `effect` is already done for `request_id`; False when it was.

        `emit` returns once the broker has acknowledged what it wrote; only then is the effect
        recorded, so a crash in between re-emits rather than loses.
        """
        key = self._key(effect, request_id)
        if await self._patiently(lambda: self._redis.exists(key)):
            return False
        await emit()
        await self._patiently(lambda: self._redis.set(key, 1, ex=TTL_S))
        return True
