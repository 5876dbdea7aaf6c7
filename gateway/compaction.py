"""Compaction (`POST /v1/responses/compact`): a long input condensed by the model itself into a
`compaction` item, as the seeds' conversation manager summarises old messages.

The model writes the summary through the whole pipeline (a stored-false response run with the
instructions below, counted against the key's limits and usage like any other). The item's
`encrypted_content` is that summary sealed with AES-GCM under a key derived from the deployment's id
key (HKDF, its own label), the tenant bound in as associated data: a client can carry it but not
read, forge or alter it, and another tenant's item does not open. A later input (or conversation)
holding the item gives the model the summary as a system message in its place.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Awaitable, Callable
from functools import lru_cache

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from gateway import openai_api as api
from schemas import ChatMessage
from schemas.ids import new_item_id

INSTRUCTIONS = (
    "Summarise the conversation below for whoever continues it: keep every name, number, "
    "decision, question still open and what the user asked for. Write the summary only."
)
SUMMARY_PREFIX = "Summary of the earlier conversation: "
SUMMARY_TOKENS = 256  # the longest summary the model may write
_VERSION = b"c1"


@lru_cache(maxsize=1)
def _aead() -> AESGCM:
    from common import id_key

    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=b"tokenstream compaction v1").derive(
        id_key.load()
    )
    return AESGCM(key)


def seal(tenant: str, summary: str) -> str:
    nonce = os.urandom(12)
    sealed = _aead().encrypt(nonce, json.dumps({"summary": summary}).encode(), _VERSION + tenant.encode())
    return base64.urlsafe_b64encode(_VERSION + nonce + sealed).decode()


def unseal(tenant: str, content: str, where: str) -> str:
    """The summary a compaction item holds; a 400 naming `where` if it is not one this deployment
    sealed for this tenant."""
    try:
        raw = base64.urlsafe_b64decode(content.encode())
        if raw[:2] != _VERSION:
            raise ValueError("version")
        plain = _aead().decrypt(raw[2:14], raw[14:], _VERSION + tenant.encode())
        return str(json.loads(plain)["summary"])
    except (ValueError, InvalidTag, KeyError, TypeError):
        raise api.invalid_request(
            f"{where}: the compaction item's encrypted_content is not one this server made "
            "for this organization (changed, or another's).",
            where,
        ) from None


def summary_message(summary: str) -> ChatMessage:
    return ChatMessage(role="system", content=SUMMARY_PREFIX + summary)


def superseded(before: list[ChatMessage]) -> list[ChatMessage]:
    """What a compaction item leaves of the messages before it: the user's messages and the system
    instructions (not an older summary: the new one covers it); the rest it summarises."""
    return [
        m
        for m in before
        if m.role == "user" or (m.role == "system" and not m.content.startswith(SUMMARY_PREFIX))
    ]


async def summarise(
    run: Callable[[str, str, int], Awaitable[dict]], messages: list[ChatMessage], window: int | None
) -> tuple[str, dict]:
    """The model's summary of `messages` and the usage of writing it. `run(instructions, input,
    max_output_tokens)` answers a stored-false response run through the pipeline."""
    room = (window or 2048) - SUMMARY_TOKENS - 256  # the instructions' and the chat template's share
    answer = await run(
        INSTRUCTIONS, transcript(messages, max(room, 256) * 3), SUMMARY_TOKENS
    )  # ~3 chars a token
    summary = "".join(
        part["text"]
        for item in answer["output"]
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    ).strip()
    if answer["status"] not in ("completed", "incomplete") or not summary:
        raise api.APIError(
            502,
            "The model wrote no summary to compact the input into; nothing was compacted.",
            "server_error",
            code="compaction_failed",
        )
    return summary, answer["usage"]


def item(tenant: str, summary: str) -> dict:
    return {"id": new_item_id("cmp"), "type": "compaction", "encrypted_content": seal(tenant, summary)}


def transcript(messages: list[ChatMessage], most_chars: int) -> str:
    """The conversation as text for the summariser, its newest `most_chars` characters if longer."""
    lines = []
    for m in messages:
        if m.tool_calls:
            calls = "; ".join(f"{c.function.name}({c.function.arguments})" for c in m.tool_calls)
            lines.append(f"assistant called: {calls}" + (f"\nassistant: {m.content}" if m.content else ""))
        elif m.role == "tool":
            lines.append(f"tool result: {m.content}")
        else:
            lines.append(f"{m.role}: {m.content}")
    text = "\n".join(lines)
    return text if len(text) <= most_chars else "..." + text[-most_chars:]
