"""What this worker tells the router on ts.kv.prefixes (schemas/routing.py): the conversation prefix
each answer left in its KV cache, and a heartbeat with its partitions and batch.

A hint, never a promise: an announced prefix may since have been evicted (the next turn then
prefills it here again, as it would anywhere), and a dead worker's announcements go stale with its
heartbeat. Both backends keep finished requests' pages for reuse (the own engine's prefix cache,
vLLM's prefix caching, salted per tenant), so both announce. Announcing is off when the topic does
not exist (a deployment whose topics predate it) or `TOKENSTREAM_WORKER_ANNOUNCE_PREFIXES=false`.
"""

from __future__ import annotations

import asyncio
import logging

from producers import publish
from schemas import ChatMessage, InferenceRequest, PrefixHeld, WorkerLoad, conversation_digest
from topics import KV_PREFIXES
from topics.admin import partition_counts

log = logging.getLogger(__name__)


class Announcer:
    def __init__(self, producer, model: str, worker_id: str, bootstrap: str, enabled: bool = True) -> None:
        self.producer, self.model, self.worker_id = producer, model, worker_id
        self.bootstrap = bootstrap
        self.enabled = enabled

    async def start(self) -> None:
        if not self.enabled:
            return
        try:
            self.enabled = KV_PREFIXES.name in await partition_counts(self.bootstrap)
        except Exception as exc:  # noqa: BLE001 - a hint only: serving goes on without it
            log.warning("worker: cannot check %s (%s): not announcing prefixes", KV_PREFIXES.name, exc)
            self.enabled = False
        if not self.enabled:
            log.warning(
                "worker: topic %s does not exist (`tokenstream topics apply`): not announcing prefixes; "
                "routers route this model's turns without them",
                KV_PREFIXES.name,
            )

    async def held(self, request: InferenceRequest, answer: str) -> None:
        """The answer of `request` ended in text: its messages plus the answer are in the cache now."""
        if not self.enabled or request.output.callable_tools or request.output.constrained:
            return  # (a turn with tools continues with calls and results: not a plain next turn)
        messages = [*request.messages, ChatMessage(role="assistant", content=answer)]
        digest = conversation_digest(request.tenant, self.model, messages)
        event = PrefixHeld(
            request_id=request.request_id,
            conversation_id=request.conversation_id,
            tenant=request.tenant,
            model=self.model,
            worker_id=self.worker_id,
            digest=digest,
        )
        await publish(self.producer, KV_PREFIXES, event, key=digest, wait=False)

    async def load(self, partitions: list[int], running: int, waiting: int, max_running: int) -> None:
        if not self.enabled:
            return
        event = WorkerLoad(
            request_id=f"load-{self.worker_id}",
            model=self.model,
            worker_id=self.worker_id,
            partitions=sorted(partitions),
            running=running,
            waiting=waiting,
            max_running=max_running,
        )
        await publish(
            self.producer, KV_PREFIXES, event, key=f"load:{self.model}:{self.worker_id}", wait=False
        )

    async def heartbeat(self, worker, stop: asyncio.Event, interval_s: float = 1.0) -> None:
        """Every `interval_s`: this worker's partitions of its topic and its batch."""
        while self.enabled and not stop.is_set():
            try:
                tps = worker.consumer.assignment()
                await self.load(
                    [tp.partition for tp in tps if tp.topic == worker.spec.name],
                    len(worker.engine.running),
                    worker.engine.queued,
                    worker.engine.max_running,
                )
            except Exception as exc:  # noqa: BLE001 - the broker may be away: the next beat tries again
                log.debug("worker: heartbeat not sent: %s", exc)
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
            except TimeoutError:
                pass
