"""Cancelling abandoned requests.

Each connection that serves a request (the first, or a resume on any instance) takes a
new attachment generation for it in Redis. When a connection drops before the answer is
complete, the gateway waits the grace period; if the generation is unchanged (nobody
resumed anywhere), it writes a Cancel event to the control topic, and the worker frees
the slot. Without Redis the generation is kept in this process only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiokafka import AIOKafkaProducer

from common.redis_pool import bounded
from gateway.metrics import Metrics
from producers import publish
from schemas import Cancel
from schemas import keys as K
from schemas.keys import GATEWAY_ATTACH_TTL_S as TTL_S
from topics import CONTROL

log = logging.getLogger(__name__)


class Canceller:
    def __init__(self, redis_url: str | None, grace_s: float, metrics: Metrics) -> None:
        self.grace_s = grace_s
        self.metrics = metrics
        self.producer: AIOKafkaProducer | None = None
        self.on_cancel: Callable[[str], None] = lambda request_id: None  # after a Cancel was written
        self._local: dict[str, int] = {}
        self._timers: set[asyncio.Task] = set()
        self._redis = None
        if redis_url:
            # the gateway's durable-store client (keys, limits, attachments): a busy event loop reads
            # an answer late, so the timeout leaves room for a burst's queue before it calls Redis away
            self._redis = bounded(redis_url, socket_timeout=5, socket_connect_timeout=1)

    @staticmethod
    def _key(request_id: str) -> str:
        return K.gateway_attachment(request_id)

    def attaching(self, pipe, request_id: str) -> None:
        """Queue on `pipe` the commands of `attach`; the generation is the first of their results."""
        pipe.incr(self._key(request_id))
        pipe.expire(self._key(request_id), TTL_S)

    async def attach(self, request_id: str) -> int:
        """A connection now serves `request_id`: returns its generation."""
        if self._redis is not None:
            try:
                pipe = self._redis.pipeline()
                self.attaching(pipe, request_id)
                gen, _ = await pipe.execute()
                return int(gen)
            except Exception as exc:  # noqa: BLE001
                log.warning("redis unavailable for attachments, using local state: %s", exc)
        gen = self._local[request_id] = self._local.get(request_id, 0) + 1
        return gen

    async def _generation(self, request_id: str) -> int:
        if self._redis is not None:
            try:
                value = await self._redis.get(self._key(request_id))
                return int(value or 0)
            except Exception as exc:  # noqa: BLE001 - Redis away: this instance's own count serves
                log.debug("cancel generation of %s from Redis failed: %s", request_id, exc)
        return self._local.get(request_id, 0)

    def release(self, request_id: str) -> None:
        """The answer was delivered in full: nothing to cancel, forget the local generation."""
        self._local.pop(request_id, None)

    def detached(
        self,
        request_id: str,
        generation: int,
        *,
        grace_s: float | None = None,
        reason: str = "client_disconnected",
    ) -> None:
        """The connection of `generation` dropped before the end: cancel unless resumed in time."""
        task = asyncio.get_running_loop().create_task(
            self._cancel_later(request_id, generation, self.grace_s if grace_s is None else grace_s, reason)
        )
        self._timers.add(task)
        task.add_done_callback(self._timers.discard)

    async def _cancel_later(self, request_id: str, generation: int, grace_s: float, reason: str) -> None:
        await asyncio.sleep(grace_s)
        if await self._generation(request_id) != generation:
            return  # resumed somewhere
        try:
            await self.cancel(request_id, reason)
        except Exception as exc:  # noqa: BLE001 - the broker is away: the worker's own limits end it
            log.warning("could not cancel %s (%s): %s", request_id, reason, exc)

    def no_progress(self, request_id: str, generation: int) -> None:
        """Nothing arrived for the request within the deadline: cancel it now."""
        self.detached(request_id, generation, grace_s=0, reason="deadline")

    async def cancel(self, request_id: str, reason: str) -> None:
        if self.producer is None:
            raise RuntimeError("gateway not connected to the broker")
        await publish(self.producer, CONTROL, Cancel(request_id=request_id, reason=reason), key=request_id)
        self._local.pop(request_id, None)
        self.on_cancel(request_id)
        self.metrics.cancels.labels(reason).inc()
        log.info("cancelled %s (%s)", request_id, reason)

    async def close(self) -> None:
        for task in list(self._timers):
            task.cancel()
        if self._redis is not None:
            await self._redis.aclose()
