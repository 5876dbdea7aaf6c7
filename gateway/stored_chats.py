"""Stored chat completions (`store: true`): the answer and the messages that asked for it, kept in the
durable store for RESPONSE_TTL_S, listed, read, re-labelled (`metadata`) and deleted by their owner
(gateway/routes/chat_store.py).

A completion is stored once its answer has ended and someone saw it end (the Completion on the log
reached this gateway for a client, streamed or not, or from the cache), as OpenAI stores a completion
once it is complete; a stream abandoned before its end is not stored. A record is kept sealed with the
key of the chat's conversation (common/sealing.py): `tokenstream erase` reaches copies of the store too.
"""

from __future__ import annotations

from typing import Any

from common import sealing
from gateway import openai_api as api
from schemas import Completion
from schemas import keys as K


def completion_of(
    rid: str, created: int, model: str, done: Completion, metadata: dict[str, str]
) -> dict[str, Any]:
    calls = [
        {
            "id": c.id,
            "type": "function",
            "function": {"name": c.function.name, "arguments": c.function.arguments},
        }
        for c in done.tool_calls
    ]
    body = api.completion_body(
        api.completion_id(rid),
        created,
        model,
        done.text,
        api.finish_reason_for_client(done.finish_reason),
        done.usage.prompt_tokens,
        done.usage.completion_tokens,
        done.usage.cached_tokens,
        tool_calls=calls,
    )
    return {**body, "metadata": metadata, "request_id": None, "service_tier": "default"}


def _sealed(record: dict[str, Any]) -> bytes:
    return sealing.seal_json(record["tenant"], record.get("scope", ""), record)


class StoredChats:
    def __init__(self, redis) -> None:
        self.redis = redis

    def _store(self):
        if self.redis is None:
            raise api.unavailable(
                "Stored completions need the durable store, which this gateway has not got."
            )
        return self.redis

    async def keep(
        self, tenant: str, scope: str, rid: str, completion: dict[str, Any], messages: list[dict[str, Any]]
    ) -> None:
        """Keep a completion (`scope`: the conversation its events were sealed under)."""
        record = {"tenant": tenant, "scope": scope, "completion": completion, "messages": messages}
        sealed = await sealing.unblocked(_sealed, record)
        async with self._store().pipeline(transaction=True) as pipe:
            pipe.set(K.stored_chat(rid), sealed, ex=K.RESPONSE_TTL_S)
            pipe.zadd(K.tenant_chats(tenant), {rid: completion["created"]})
            await pipe.execute()

    async def owned(self, tenant: str, completion_id: str) -> tuple[str, dict[str, Any]]:
        """(request id, record) of a stored completion of `tenant`; 404 otherwise."""
        try:
            rid = api.request_id_of(completion_id)
        except ValueError:
            rid = None
        raw = await self._store().get(K.stored_chat(rid)) if rid else None
        record = await sealing.unblocked(sealing.open_json, raw)
        if record is None or record["tenant"] != tenant:
            raise api.not_found(f"No stored chat completion with id {completion_id!r}.")
        return rid, record

    async def all(self, tenant: str) -> list[dict[str, Any]]:
        """The tenant's stored completions, oldest first (ids whose record expired are forgotten)."""
        rids = [r.decode() for r in await self._store().zrange(K.tenant_chats(tenant), 0, -1)]
        raws = await self.redis.mget([K.stored_chat(r) for r in rids]) if rids else []
        gone = [r for r, raw in zip(rids, raws) if raw is None]
        if gone:
            await self.redis.zrem(K.tenant_chats(tenant), *gone)
        records = await sealing.unblocked(lambda: list(map(sealing.open_json, raws)))
        return [record for record in records if record is not None]

    async def relabel(self, rid: str, record: dict[str, Any], metadata: dict[str, str]) -> dict[str, Any]:
        record["completion"]["metadata"] = metadata
        await self._store().set(K.stored_chat(rid), await sealing.unblocked(_sealed, record), keepttl=True)
        return record["completion"]

    async def forget(self, tenant: str, rid: str) -> None:
        async with self._store().pipeline(transaction=True) as pipe:
            pipe.delete(K.stored_chat(rid))
            pipe.zrem(K.tenant_chats(tenant), rid)
            await pipe.execute()
