"""Conversations (`/v1/conversations`): durable objects of one tenant holding items in order, and what
a response created in one reads and adds.

A conversation lives in the durable Redis until deleted (schemas/keys.py). A response created with
`conversation` sends the conversation's items, as chat messages, as the whole history
(ChatRequest.full_history: the conversation processor replaces what it kept) under the
conversation's id, so the code interpreter's working folder is the conversation's. When the
response ends, its input and output items are appended once, whichever gateway sees the end: their
ids come from the log and the append skips ids already there. One response at a time runs in a
conversation (409 `conversation_locked` otherwise), as the processor serves one turn at a time.

Server tool calls of earlier turns are read back by the model as their recorded outputs (the logs of
a code run, the results of a search), which is what the model read when they ran, less the fields
the response object does not keep.
"""

from __future__ import annotations

import json
import time
from typing import Any

from common import sealing
from gateway import openai_api as api
from gateway.compaction import summary_message, superseded, unseal
from gateway.responses_api import joins_calls
from gateway.responses_framing import function_call_item
from schemas import ChatMessage, Completion, FunctionCall, MessageToolCall
from schemas import keys as K
from schemas.ids import new_conversation_id

# KEYS: record, items, order. ARGV: the most items, then (id, JSON) pairs (ids distinct).
# -1: no such conversation; -2: it would hold more than the most; else how many were new.
_APPEND = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local fresh = {}
for i = 2, #ARGV, 2 do
  if redis.call('HEXISTS', KEYS[2], ARGV[i]) == 0 then fresh[#fresh + 1] = i end
end
if redis.call('ZCARD', KEYS[3]) + #fresh > tonumber(ARGV[1]) then return -2 end
for _, i in ipairs(fresh) do
  local position = redis.call('HINCRBY', KEYS[1], 'next', 1)
  redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
  redis.call('ZADD', KEYS[3], position, ARGV[i])
end
return #fresh
"""
# KEYS: busy. ARGV: run id. Release only the holder's hold.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def conversation_object(conv_id: str, record: dict[str, str]) -> dict[str, Any]:
    return {
        "id": conv_id,
        "object": "conversation",
        "created_at": int(record["created_at"]),
        "metadata": json.loads(record.get("metadata") or "{}"),
    }


class Conversations:
    def __init__(self, redis, max_items: int) -> None:
        self.redis, self.max_items = redis, max_items
        self._append = redis.register_script(_APPEND) if redis is not None else None
        self._release = redis.register_script(_RELEASE) if redis is not None else None

    def _store(self):
        if self.redis is None:
            raise api.unavailable("Conversations need the durable store, which this gateway has not got.")
        return self.redis

    async def create(self, tenant: str, metadata: dict[str, str]) -> tuple[str, dict[str, str]]:
        conv_id = new_conversation_id()
        record = {
            "tenant": tenant,
            "created_at": str(int(time.time())),
            "metadata": json.dumps(metadata),
            "next": "0",
        }
        await self._store().hset(K.conversation(conv_id), mapping=record)
        return conv_id, record

    async def owned(self, conv_id: str, tenant: str, param: str | None = None) -> dict[str, str]:
        """The conversation's record; 404 when it does not exist or is another tenant's."""
        raw = await self._store().hgetall(K.conversation(conv_id)) if conv_id.startswith("conv_") else {}
        record = {k.decode(): v.decode() for k, v in raw.items()}
        if record.get("tenant") != tenant:
            raise api.APIError(
                404,
                f"Conversation with id {conv_id!r} not found.",
                "invalid_request_error",
                param=param,
                code="not_found",
            )
        return record

    async def set_metadata(self, conv_id: str, metadata: dict[str, str]) -> None:
        await self._store().hset(K.conversation(conv_id), "metadata", json.dumps(metadata))

    async def delete(self, conv_id: str) -> None:
        await self._store().delete(
            K.conversation(conv_id),
            K.conversation_items(conv_id),
            K.conversation_order(conv_id),
            K.conversation_busy(conv_id),
        )

    async def append(self, conv_id: str, tenant: str, items: list[dict[str, Any]]) -> int:
        """Append the items whose ids are not there yet, in order; how many were new. Each is kept sealed
        with the conversation's key (common/sealing.py), so `erase` reaches copies of the store too."""
        self._store()
        args: list[Any] = [self.max_items]
        seen: set[str] = set()
        for item in items:
            if item["id"] not in seen:
                seen.add(item["id"])
                args += [item["id"], await sealing.unblocked(sealing.seal_json, tenant, conv_id, item)]
        added = await self._append(
            keys=[K.conversation(conv_id), K.conversation_items(conv_id), K.conversation_order(conv_id)],
            args=args,
        )
        if added == -1:
            raise api.not_found(f"Conversation with id {conv_id!r} not found.")
        if added == -2:
            raise api.invalid_request(
                f"A conversation holds at most {self.max_items} items: delete some first.", "items"
            )
        return added

    async def items(self, conv_id: str) -> list[dict[str, Any]]:
        """Every item, oldest first."""
        ids = await self._store().zrange(K.conversation_order(conv_id), 0, -1)
        if not ids:
            return []
        raw = await self.redis.hmget(K.conversation_items(conv_id), ids)
        items = await sealing.unblocked(lambda: list(map(sealing.open_json, raw)))
        return [item for item in items if item is not None]

    async def item(self, conv_id: str, item_id: str) -> dict[str, Any] | None:
        raw = await self._store().hget(K.conversation_items(conv_id), item_id)
        return await sealing.unblocked(sealing.open_json, raw)

    async def remove(self, conv_id: str, item_id: str) -> bool:
        async with self._store().pipeline(transaction=True) as pipe:
            pipe.hdel(K.conversation_items(conv_id), item_id)
            pipe.zrem(K.conversation_order(conv_id), item_id)
            removed, _ = await pipe.execute()
        return bool(removed)

    async def hold(self, conv_id: str, run_id: str) -> None:
        """Mark `run_id` the conversation's response in progress; a 409 when another holds it."""
        if not await self._store().set(
            K.conversation_busy(conv_id), run_id, nx=True, ex=K.CONVERSATION_BUSY_S
        ):
            raise api.APIError(
                409,
                f"Another response is in progress in conversation {conv_id!r}: retry when it has ended.",
                "invalid_request_error",
                param="conversation",
                code="conversation_locked",
            )

    async def history(self, conv_id: str, tenant: str) -> list[ChatMessage]:
        """The tenant's conversation (else a 404 naming `conversation`) as the messages the model reads."""
        await self.owned(conv_id, tenant, "conversation")
        return history(await self.items(conv_id), tenant)

    async def release(self, conv_id: str, run_id: str) -> None:
        await self._release(keys=[K.conversation_busy(conv_id)], args=[run_id])


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(str(part.get("text", "")) for part in content or [] if isinstance(part, dict))


def _call(call_id: str, name: str, arguments: dict | str) -> MessageToolCall:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return MessageToolCall(id=call_id, function=FunctionCall(name=name, arguments=args))


def _server_call(item: dict[str, Any]) -> tuple[MessageToolCall, str | None]:
    """A server tool's call item as the call the model made and the output it read (None: no result)."""
    call_id = item["id"].split("_", 1)[1]
    kind, result = item["type"], item.get("result")
    if kind == "code_interpreter_call":
        logs = next((o.get("logs", "") for o in item.get("outputs") or [] if o.get("type") == "logs"), None)
        output = None if logs is None else json.dumps({"stdout": logs, **(result or {})})
        return _call(call_id, "code_interpreter", {"code": item.get("code", "")}), output
    if kind == "file_search_call":
        results = item.get("results")
        query = (item.get("queries") or [""])[0]
        return _call(call_id, "file_search", {"query": query}), None if results is None else json.dumps(
            {"results": results}
        )
    url = (item.get("action") or {}).get("url", "")
    return _call(call_id, "web_fetch", {"url": url}), None if result is None else json.dumps(result)


def history(items: list[dict[str, Any]], tenant: str) -> list[ChatMessage]:
    """A conversation's items as the chat messages the model reads: calls in a row joined into one
    assistant turn, a run's server calls followed by their outputs (as the step that made them was)."""
    out: list[ChatMessage] = []
    outputs: list[ChatMessage] = []  # server calls' outputs, after the turn that made them
    commentary = False  # the last message is an assistant's commentary (and the calls after it)

    def add_call(call: MessageToolCall) -> None:
        if out and joins_calls(out[-1], commentary):
            out[-1].tool_calls.append(call)
        else:
            out.append(ChatMessage(role="assistant", content="", tool_calls=[call]))

    for item in items:
        kind = item.get("type", "message")
        if kind in ("code_interpreter_call", "file_search_call", "web_search_call"):
            call, output = _server_call(item)
            add_call(call)
            if output is not None:
                outputs.append(
                    ChatMessage(role="tool", tool_call_id=call.id, name=call.function.name, content=output)
                )
            continue
        out += outputs
        outputs = []
        if kind != "function_call":
            commentary = kind == "message" and item.get("phase") == "commentary"
        if kind == "message":
            role = "system" if item.get("role") == "developer" else item.get("role", "user")
            out.append(ChatMessage(role=role, content=_text(item.get("content"))))
        elif kind == "function_call":
            add_call(_call(item["call_id"], item["name"], item.get("arguments", "")))
        elif kind == "function_call_output":
            out.append(
                ChatMessage(role="tool", tool_call_id=item["call_id"], content=_text(item.get("output")))
            )
        elif kind == "compaction":
            summary = summary_message(
                unseal(tenant, item.get("encrypted_content", ""), f"items[{item['id']}]")
            )
            out = superseded(out) + [summary]
    return out + outputs


def chat_items(rid: str, asked: list[ChatMessage], done: Completion) -> list[dict[str, Any]]:
    """A chat completion's messages and its answer as conversation items (ids from the request id, so a
    second append of the same answer adds nothing)."""
    items: list[dict[str, Any]] = []
    for i, m in enumerate(asked):
        if m.role == "tool":
            items.append(
                {
                    "id": f"fco_{rid}_{i}",
                    "type": "function_call_output",
                    "call_id": m.tool_call_id,
                    "output": m.content,
                }
            )
            continue
        if m.content or not m.tool_calls:
            kind = "output_text" if m.role == "assistant" else "input_text"
            items.append(
                {
                    "id": f"msg_{rid}_{i}",
                    "type": "message",
                    "role": m.role,
                    "status": "completed",
                    "content": [{"type": kind, "text": m.content}],
                }
            )
        items += [function_call_item(c.id, c.function.name, c.function.arguments) for c in m.tool_calls]
    if done.text or not done.tool_calls:
        items.append(
            {
                "id": f"msg_{rid}",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": done.text, "annotations": []}],
            }
        )
    items += [function_call_item(c.id, c.function.name, c.function.arguments) for c in done.tool_calls]
    return items
