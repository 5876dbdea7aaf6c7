"""Which cache may answer a chat request, the lookup, and storing a live answer for next time.

The exact cache (gateway/cache.py) is asked first, then the semantic cache (gateway/semantic.py);
`x-tokenstream-cache` says `miss`, `hit` or `semantic-hit` on every request a cache could answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway import openai_api as api
from gateway.cache import Entry, cache_key, deterministic
from gateway.semantic import single_turn
from schemas import ChatMessage, SamplingParams
from schemas.keys import ApiKey

if TYPE_CHECKING:
    from gateway.pipeline import Gateway

HEADER = "x-tokenstream-cache"


def structured(body: api.ChatCompletionRequest) -> bool:
    """Whether the request asks for tools or a response format (never answered from a cache)."""
    extra = body.model_extra or {}
    return any(
        getattr(body, name, None) or extra.get(name)
        for name in ("tools", "tool_choice", "functions", "response_format")
    )


@dataclass
class Lookup:
    exact_key: str | None = None
    semantic: tuple[str, str, list[float]] | None = None  # system text, user text, its embedding
    entry: Entry | None = None  # the cached answer, on a hit
    headers: dict[str, str] = field(default_factory=dict)

    async def store(self, gw: Gateway, tenant: str, model: str, entry: Entry) -> None:
        if self.exact_key:
            await gw.exact_cache.put(self.exact_key, tenant, entry)
        if self.semantic:
            await gw.semantic_cache.store(tenant, model, *self.semantic, entry=entry)


async def look_up(
    gw: Gateway,
    key: ApiKey,
    body: api.ChatCompletionRequest,
    messages: list[ChatMessage],
    sampling: SamplingParams,
) -> Lookup:
    found = Lookup()
    if (
        not body.cache
        or body.conversation_id
        or body.conversation
        or body.assistant
        or structured(body)
        or body.logprobs
    ):
        # opted out, part of the context is stored server-side (and the answer goes into a conversation),
        # or the answer may hold tool calls or log probabilities (a cache entry keeps text chunks only)
        return found
    if key.exact_cache and deterministic(sampling):
        found.exact_key = cache_key(key.tenant, body.model, messages, sampling)
        found.headers[HEADER] = "miss"
        found.entry = await gw.exact_cache.get(found.exact_key)
        if found.entry is not None:
            found.headers[HEADER] = "hit"
            return found
    turn = single_turn(messages)
    if key.semantic_cache and turn and not sampling.shapes_tokens():  # a similar question's answer
        # was not drawn under this request's penalties or bias: only the exact cache (keyed by them) may
        # answer
        vector = await gw.semantic_cache.embed(turn[1])
        found.semantic = (*turn, vector)
        found.headers[HEADER] = "miss"
        hit = await gw.semantic_cache.lookup(key.tenant, body.model, turn[0], vector)
        if hit is not None:
            found.entry = hit.entry
            found.headers[HEADER] = "semantic-hit"
            found.headers["x-tokenstream-cache-similarity"] = f"{hit.similarity:.4f}"
    return found
