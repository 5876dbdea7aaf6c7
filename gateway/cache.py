"""The exact response cache (Redis): a deterministic request asked again gets the same answer, at once.

Eligible: temperature 0 or a fixed seed; the key allows it (`keys create --no-exact-cache` opts a
key out), the request does not (`"cache": false`), and the request carries its whole context (no
stored `conversation_id`, no `assistant` preset whose settings could change). The entry is keyed
by the sha256 of the tenant, the model, the messages and every sampling field, holds the answer's
chunks as they were streamed, and expires after `exact_cache_ttl_s`; answers longer than
`exact_cache_max_chars` or that did not end normally (stop, length) are not stored.
"""

from __future__ import annotations

import hashlib
import logging

import msgspec

from common import sealing
from schemas import ChatMessage, ChatRequest, Completion, Event, SamplingParams, TokenChunk, Usage
from schemas import keys as K

log = logging.getLogger(__name__)
STORED_REASONS = ("stop", "length")


def deterministic(sampling: SamplingParams) -> bool:
    return sampling.temperature == 0 or sampling.seed is not None


#: sampling fields that shape how the answer is chunked, not the answer: not part of the key
NOT_KEYED = ("stream_interval", "stream_interval_ms")


def cache_key(tenant: str, model: str, messages: list[ChatMessage], sampling: SamplingParams) -> str:
    keyed = {k: v for k, v in msgspec.structs.asdict(sampling).items() if k not in NOT_KEYED}
    material = msgspec.json.encode(
        {"tenant": tenant, "model": model, "messages": messages, "sampling": keyed}
    )
    return K.exact_cache(hashlib.sha256(material).hexdigest())


class Entry(msgspec.Struct, kw_only=True):
    """A stored answer: its chunks as streamed, how it ended, its usage and the request that made it."""

    chunks: list[str]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    request_id: str


class ExactCache:
    def __init__(self, redis, ttl_s: float, max_chars: int, metrics) -> None:
        self.redis, self.ttl_s, self.max_chars, self.metrics = redis, ttl_s, max_chars, metrics

    async def get(self, key: str) -> Entry | None:
        if self.redis is None:
            return None
        try:
            raw = await self.redis.get(key)
        except Exception:  # noqa: BLE001 - without Redis every request is a miss
            return None
        if raw is None:
            self.metrics.cache.labels("exact", "miss").inc()
            return None
        plain = await sealing.unblocked(sealing.open_stored, raw)
        try:
            entry = msgspec.json.decode(plain or b"", type=Entry)  # b"": erased
        except msgspec.DecodeError:
            return None
        self.metrics.cache.labels("exact", "hit").inc()
        return entry

    async def put(self, key: str, tenant: str, entry: Entry) -> bool:
        if self.redis is None or entry.finish_reason not in STORED_REASONS:
            return False
        if sum(len(c) for c in entry.chunks) > self.max_chars:
            return False
        try:
            sealed = await sealing.unblocked(sealing.seal_stored, tenant, "", msgspec.json.encode(entry))
            await self.redis.set(key, sealed, ex=int(self.ttl_s), nx=True)
            return True
        except Exception as exc:  # noqa: BLE001
            log.warning("exact cache: could not store %s: %s", entry.request_id, exc)
            return False


def hit_events(entry: Entry, request: ChatRequest) -> list[Event]:
    """The token events of a cache hit for `request`: its chunks, then its completion."""
    ids = dict(request_id=request.request_id, conversation_id=request.conversation_id, tenant=request.tenant)
    worker = f"cache:{entry.request_id}"
    events: list[Event] = [
        TokenChunk(**ids, seq=i, text=text, worker_id=worker) for i, text in enumerate(entry.chunks)
    ]
    usage = Usage(prompt_tokens=entry.prompt_tokens, completion_tokens=entry.completion_tokens)
    events.append(
        Completion(
            **ids,
            seq=len(entry.chunks),
            finish_reason=entry.finish_reason,
            text="".join(entry.chunks),
            usage=usage,
            worker_id=worker,
            model=request.model,
            tier=request.tier,
        )
    )
    return events
