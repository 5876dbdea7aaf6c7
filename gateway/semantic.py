"""The semantic response cache (Weaviate): a question close enough in meaning to one answered before
gets that answer, with its similarity and the request id that produced it.

Only where a replayed answer cannot be wrong for its context: the key opts in (`keys create
--semantic-cache`), the request allows caches (`"cache": true`, the default), it is single-turn
(an optional system message and one user message; no stored `conversation_id`, no `assistant`
preset) and asks for no tools or response format. Entries are scoped by tenant, model and the exact
system message; a hit needs a cosine similarity of at least `semantic_cache_threshold` between the
user messages (all-MiniLM-L6-v2 embeddings, computed on the CPU in a thread) and an entry younger
than `semantic_cache_ttl_s`. The embedder loads on the first eligible request.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from dataclasses import dataclass

from common import sealing
from common.vectordb import Breaker, client_config
from gateway.cache import Entry
from schemas import ChatMessage
from schemas.keys import SEMANTIC_CACHE_COLLECTION

log = logging.getLogger(__name__)
STORE_TIMEOUT_S = 5.0  # a store follows the answer: time for a first connect and the collection's creation


def digest(system: str) -> str:
    """What an entry keeps of its system message: enough to match it, nothing to read."""
    return hashlib.sha256(system.encode()).hexdigest()


def single_turn(messages: list[ChatMessage]) -> tuple[str, str] | None:
    """(system text, user text) of a single-turn request, or None."""
    if len(messages) == 1 and messages[0].role == "user":
        return "", messages[0].content
    if len(messages) == 2 and messages[0].role == "system" and messages[1].role == "user":
        return messages[0].content, messages[1].content
    return None


@dataclass
class Hit:
    entry: Entry
    similarity: float


class SemanticCache:
    """Each lookup bounded by `timeout_s` (connecting included), each store (after the answer) by
    STORE_TIMEOUT_S or `timeout_s` if longer; while Weaviate is away (a failure, then a pause
    doubling to 2 s, see common.vectordb.Breaker) every lookup is a miss at once and nothing is
    stored, and the next try after the pause connects a new client."""

    def __init__(
        self,
        host: str,
        http_port: int,
        grpc_port: int,
        threshold: float,
        ttl_s: float,
        max_chars: int,
        metrics,
        timeout_s: float = 1.0,
    ) -> None:
        self.host, self.http_port, self.grpc_port = host, http_port, grpc_port
        self.threshold, self.ttl_s, self.max_chars, self.metrics = threshold, ttl_s, max_chars, metrics
        self.timeout_s = timeout_s
        self.breaker = Breaker()
        self._client = None
        self._lock = asyncio.Lock()
        self._embedder = None
        self._closing: set[asyncio.Task] = set()

    def _close_later(self, client) -> None:
        """Close a client in the background: a request never waits on a server that is gone."""
        task = asyncio.get_running_loop().create_task(_close_quietly(client))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _collection(self):
        async with self._lock:
            if self._client is None:
                import weaviate

                client = weaviate.use_async_with_local(
                    host=self.host,
                    port=self.http_port,
                    grpc_port=self.grpc_port,
                    skip_init_checks=True,
                    additional_config=client_config(self.timeout_s),
                )
                try:
                    await client.connect()
                    await self._ensure(client)
                except BaseException:
                    self._close_later(client)
                    raise
                self._client = client
        return self._client.collections.get(SEMANTIC_CACHE_COLLECTION)

    async def _bounded(self, work, timeout_s: float):
        """`work()` within timeout_s; _SKIPPED at once while the breaker is open, or when it fails (which
        opens the breaker and drops the client, so that the next try connects afresh)."""
        if not self.breaker.allow():
            return _SKIPPED
        import weaviate  # noqa: F401 - imported (once, slowly) outside the timeout

        try:
            async with asyncio.timeout(timeout_s):
                result = await work()
        except Exception as exc:  # noqa: BLE001 - without Weaviate every request is a miss
            was_up = self.breaker.up
            pause = self.breaker.failed(
                exc if not isinstance(exc, TimeoutError) else f"no answer within {timeout_s:g} s"
            )
            if was_up:
                log.warning(
                    "semantic cache: Weaviate failed (%s); lookups are misses, next try in %.2f s",
                    self.breaker.last_error,
                    pause,
                )
            client, self._client = self._client, None
            if client is not None:
                self._close_later(client)
            return _SKIPPED
        if not self.breaker.up:
            log.warning("semantic cache: Weaviate answers again")
        self.breaker.succeeded()
        return result

    @staticmethod
    async def _ensure(client) -> None:
        from weaviate.classes.config import Configure, DataType, Property, Tokenization, VectorDistances

        if await client.collections.exists(SEMANTIC_CACHE_COLLECTION):
            return
        # whole-field tokenization: the scope filters compare exact values, not words
        text = [
            Property(name=n, data_type=DataType.TEXT, tokenization=Tokenization.FIELD)
            for n in ("tenant", "model", "system", "prompt", "chunks", "finish_reason", "request_id")
        ]
        numbers = [
            Property(name=n, data_type=DataType.NUMBER)
            for n in ("prompt_tokens", "completion_tokens", "created_at")
        ]
        try:
            await client.collections.create(
                SEMANTIC_CACHE_COLLECTION,
                properties=text + numbers,
                vector_config=Configure.Vectors.self_provided(
                    vector_index_config=Configure.VectorIndex.hnsw(distance_metric=VectorDistances.COSINE)
                ),
            )
        except Exception:
            if not await client.collections.exists(SEMANTIC_CACHE_COLLECTION):
                raise

    async def embed(self, text: str) -> list[float]:
        if self._embedder is None:

            def load():
                import transformers

                transformers.utils.logging.disable_progress_bar()
                from common.embeddings import sentence_embedder

                return sentence_embedder()

            self._embedder = await asyncio.to_thread(load)
        return await asyncio.to_thread(self._embedder.embed, text)

    async def lookup(self, tenant: str, model: str, system: str, vector: list[float]) -> Hit | None:
        """The closest entry of this tenant, model and system message, if similar enough and fresh."""
        from weaviate.classes.query import Filter, MetadataQuery

        started = time.perf_counter()

        async def query():
            collection = await self._collection()
            return await collection.query.near_vector(
                near_vector=vector,
                limit=1,
                distance=1 - self.threshold,
                filters=(
                    Filter.by_property("tenant").equal(tenant)
                    & Filter.by_property("model").equal(model)
                    & Filter.by_property("system").equal(digest(system))
                    & Filter.by_property("created_at").greater_than(time.time() - self.ttl_s)
                ),
                return_metadata=MetadataQuery(distance=True),
            )

        try:
            found = await self._bounded(query, self.timeout_s)
        finally:
            self.metrics.semantic_lookup_seconds.observe(time.perf_counter() - started)
        if found is _SKIPPED:
            self.metrics.cache.labels("semantic", "unavailable").inc()
            return None
        for obj in found.objects:
            p = obj.properties
            similarity = 1 - float(obj.metadata.distance)
            if (p.get("tenant"), p.get("model"), p.get("system") or "") != (
                tenant,
                model,
                digest(system),
            ) or similarity < self.threshold:
                continue
            chunks = await sealing.unblocked(sealing.open_text, p["chunks"])
            if chunks is None:  # its tenant was erased
                continue
            self.metrics.cache.labels("semantic", "hit").inc()
            return Hit(
                Entry(
                    chunks=json.loads(chunks),
                    finish_reason=p["finish_reason"],
                    prompt_tokens=int(p["prompt_tokens"]),
                    completion_tokens=int(p["completion_tokens"]),
                    request_id=p["request_id"],
                ),
                similarity,
            )
        self.metrics.cache.labels("semantic", "miss").inc()
        return None

    async def store(
        self, tenant: str, model: str, system: str, prompt: str, vector: list[float], entry: Entry
    ) -> None:
        if (
            entry.finish_reason not in ("stop", "length")
            or sum(len(c) for c in entry.chunks) > self.max_chars
        ):
            return

        async def insert():
            collection = await self._collection()
            chunks = json.dumps(entry.chunks)
            await collection.data.insert(
                {
                    "tenant": tenant,
                    "model": model,
                    "system": digest(system),
                    "prompt": await sealing.unblocked(sealing.seal_text, tenant, "", prompt),
                    "chunks": await sealing.unblocked(sealing.seal_text, tenant, "", chunks),
                    "finish_reason": entry.finish_reason,
                    "request_id": entry.request_id,
                    "prompt_tokens": entry.prompt_tokens,
                    "completion_tokens": entry.completion_tokens,
                    "created_at": time.time(),
                },
                vector=vector,
            )
            return True

        if await self._bounded(insert, max(STORE_TIMEOUT_S, self.timeout_s)) is _SKIPPED:
            log.info("semantic cache: %s not stored (Weaviate unavailable)", entry.request_id)

    async def close(self) -> None:
        if self._client is not None:
            await _close_quietly(self._client)


_SKIPPED = object()  # what _bounded returns when Weaviate was not (or could not be) asked


async def _close_quietly(client) -> None:
    # closing a client whose server is gone: its error is of no interest
    with contextlib.suppress(Exception):
        async with asyncio.timeout(2.0):
            await client.close()
