"""One gateway instance's connections to the pipeline: producer, tokens fan-out, admission, cancels.

Connects in the background and reconnects when the broker goes away; `ready` says whether a
request can be handed to the pipeline now. Routes reach it through `gateway.deps.pipeline`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging

from common.config import settings
from common.redis_pool import bounded
from gateway import replays
from gateway.admission import Admission
from gateway.cache import ExactCache
from gateway.cancel import Canceller
from gateway.config import GatewaySettings
from gateway.conversations import Conversations
from gateway.fanout import Fanout
from gateway.inflight import Inflight
from gateway.key_homes import KeyHomes
from gateway.metrics import Metrics
from gateway.ratelimit import RateLimiter
from gateway.searches import ToolSearches
from gateway.semantic import SemanticCache
from gateway.sse import Streams
from gateway.stored_chats import StoredChats
from gateway.uploads import Uploads
from producers import start_consumer, start_producer
from schemas import keys as K
from schemas.keys import GATEWAY_META_TTL_S as META_TTL_S
from topics import TOKENS

log = logging.getLogger(__name__)


class Gateway:
    """Connections to the broker and the per-instance machinery; connects in the background."""

    def __init__(
        self, cfg: GatewaySettings, bootstrap: str, redis_url: str | None, cache_url: str | None = None
    ) -> None:
        """redis_url: the durable store (keys, limits, usage, files, ledgers; never evicts); cache_url: the
        evicting store, which holds the exact response cache alone (no cache_url: no exact cache)."""
        self.cfg = cfg
        self.bootstrap = bootstrap
        self.metrics = Metrics()
        self.admission = Admission(
            bootstrap,
            cfg.models,
            self.metrics,
            budget_s=cfg.admission_budget_s,
            poll_s=cfg.admission_poll_s,
            window_s=cfg.admission_window_s,
            min_rate=cfg.admission_min_rate,
            stale_s=cfg.broker_stale_s,
        )
        self.canceller = Canceller(redis_url, cfg.cancel_grace_s, self.metrics)
        self.redis = self.canceller._redis
        self.limiter = RateLimiter(self.redis, self.metrics)
        self.inflight = Inflight(
            self.limiter,
            self.canceller,
            lease_s=cfg.stream_lease_s,
            progress_timeout_s=cfg.progress_timeout_s,
        )
        self.inflight.attached = lambda rid: self.fanout is not None and rid in self.fanout.streams
        self.cache_redis = (
            bounded(cache_url, socket_timeout=1, socket_connect_timeout=1) if cache_url else None
        )
        self.exact_cache = ExactCache(
            self.cache_redis, cfg.exact_cache_ttl_s, cfg.exact_cache_max_chars, self.metrics
        )
        base = settings()
        self.semantic_cache = SemanticCache(
            base.weaviate_host,
            base.weaviate_http_port,
            base.weaviate_grpc_port,
            cfg.semantic_cache_threshold,
            cfg.semantic_cache_ttl_s,
            cfg.exact_cache_max_chars,
            self.metrics,
            timeout_s=cfg.semantic_cache_timeout_s,
        )
        # files and vector stores: their own Redis connection, with room for a file's bytes
        self.files_redis = (
            bounded(redis_url, socket_timeout=10, socket_connect_timeout=2) if redis_url else None
        )
        self.uploads = Uploads(self.files_redis, cfg.tenant_files_max_bytes) if self.files_redis else None
        self.searches = ToolSearches(bootstrap)
        self.conversations = Conversations(self.redis, cfg.conversation_max_items)
        self.stored_chats = StoredChats(self.redis)
        self.region, self.regions = base.region, dict(base.regions)
        self.key_homes = (
            KeyHomes(bootstrap, base.region, list(base.regions), self.redis)
            if base.region and base.regions
            else None
        )
        self.sse = Streams(cfg.ping_s, stuck_s=cfg.slow_reader_s)  # the open SSE streams (gateway/sse.py)
        self.key_lookups: dict[str, asyncio.Future] = {}  # API key lookups in flight (gateway/auth.py)
        self._background: set[asyncio.Task] = set()
        self.producer = None
        self.fanout: Fanout | None = None
        self.partitions: list[int] = []
        self._next = itertools.count()
        self._tasks: list[asyncio.Task] = []

    @property
    def ready(self) -> bool:
        """The pipeline side: connected to the tokens partitions and the broker answers."""
        return self.streaming and self.admission.healthy()

    @property
    def streaming(self) -> bool:
        """Whether the tokens fan-out reads its partitions now."""
        return self.fanout is not None and self.fanout.connected

    async def redis_reachable(self) -> bool:
        """Whether the durable Redis answers now: without it no API key or rate limit can be checked
        (503s)."""
        return await _answers(self.redis)

    async def cache_reachable(self) -> bool:
        """Whether the cache Redis answers now (without it the exact cache misses: degraded, still ready);
        True when no cache store is configured, as there is nothing missing then."""
        return self.cache_redis is None or await _answers(self.cache_redis)

    async def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._connect(), name="gateway-connect"))
        self._tasks.append(asyncio.create_task(self.admission.run(), name="gateway-admission"))
        self._tasks.append(asyncio.create_task(self.inflight.run(), name="gateway-inflight"))
        self._tasks.append(asyncio.create_task(self.sse.run(), name="gateway-sse"))
        if self.key_homes is not None:
            self._tasks += self.key_homes.tasks()

    async def _connect(self) -> None:
        while True:
            consumer = None
            try:
                self.producer = self.producer or await start_producer(
                    self.bootstrap, request_timeout_ms=10_000
                )
                self.canceller.producer = self.producer
                consumer = await start_consumer(group=None, bootstrap=self.bootstrap)
                total = consumer.partitions_for_topic(TOKENS.name)
                if not total:
                    await consumer._client.force_metadata_update()
                    total = consumer.partitions_for_topic(TOKENS.name)
                if not total:
                    raise RuntimeError(f"topic {TOKENS.name} does not exist (run `tokenstream topics apply`)")
                self.partitions = self.cfg.owned_partitions(len(total))
                if not self.partitions:
                    raise RuntimeError("this instance owns no tokens partition")
                if self.fanout is None:
                    self.fanout = Fanout(
                        None,
                        self.partitions,
                        self.metrics,
                        self.cfg.buffer_events,
                        self.cfg.coalesce_chars,
                        watcher=self.inflight,
                    )
                elif [tp.partition for tp in self.fanout.partitions] != self.partitions:
                    raise RuntimeError(f"tokens partitions changed under a live gateway: {self.partitions}")
                # the same Fanout across reconnects: its live streams continue where they were
                await self.fanout.attach(consumer)
                log.info("gateway %s owns tokens partitions %s", self.cfg.instance_id, self.partitions)
                await self.fanout.run()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001
                log.warning("gateway not connected to the pipeline: %s", exc)
                if self.fanout is not None:
                    self.fanout.connected = False
                if consumer is not None:
                    with contextlib.suppress(Exception):
                        await consumer.stop()
                await asyncio.sleep(1.0)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        await self.admission.close()
        await self.canceller.close()
        await self.semantic_cache.close()
        await self.searches.close()
        for client in (self.files_redis, self.cache_redis):
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.aclose()
        if self.fanout is not None:
            with contextlib.suppress(Exception):
                await self.fanout.consumer.stop()
        with contextlib.suppress(Exception):  # the resumes' readers and their Redis client
            await replays.hub(self.bootstrap).close()
        if self.producer is not None:
            with contextlib.suppress(Exception):
                await self.producer.stop()

    def background(self, coro) -> None:
        """Run `coro` without waiting for it (bookkeeping after an answer was delivered)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def reply_partition(self) -> int:
        return self.partitions[next(self._next) % len(self.partitions)]

    async def admitted(self, request_id: str, meta: dict) -> int:
        """Note a request admitted here (its owner, the tenant, and what a resume elsewhere needs to
        rebuild its chunks: model, usage option) and make its first attachment (`canceller.attach`), in
        one round trip; returns the attachment's generation."""
        if self.redis is None:
            return await self.canceller.attach(request_id)
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.set(K.gateway_request(request_id), json.dumps(meta), ex=META_TTL_S)
            self.canceller.attaching(pipe, request_id)
            _, generation, _ = await pipe.execute()
            return int(generation)
        except Exception:  # noqa: BLE001 - Redis away: the canceller's own fallback (local state)
            return await self.canceller.attach(request_id)

    async def recall(self, request_id: str) -> dict | None:
        """The notes of an admitted request; {} when Redis cannot say, None when it never was admitted."""
        if self.redis is not None:
            try:
                raw = await self.redis.get(K.gateway_request(request_id))
            except Exception:  # noqa: BLE001 - without Redis, the log alone serves the resume
                return {}
            return json.loads(raw) if raw else None
        return {}


async def _answers(client) -> bool:
    if client is None:
        return False
    try:
        async with asyncio.timeout(1.0):
            return bool(await client.ping())
    except Exception:  # noqa: BLE001 - unreachable, refused, timed out: not answering
        return False
