"""An admitted request after the fact: resume its stream from the log, or cancel it.

Both are for the request's owner only: the tenant noted in Redis at admission must be the
tenant of the caller's key, else 404 (the same answer as for an id that never existed).
"""

from __future__ import annotations

import contextlib

from fastapi import APIRouter, Depends, Header

from gateway import openai_api as api
from gateway.answers import sse_response
from gateway.auth import principal
from gateway.deps import pipeline
from gateway.framing import Framer
from gateway.pipeline import Gateway
from gateway.resume import parse_last_event_id, parse_request_id, replay
from gateway.screening import held_until_screened
from schemas import Completion
from schemas.keys import ApiKey

router = APIRouter(prefix="/v1/chat/completions", dependencies=[Depends(principal)])


def request_id(completion: str) -> str:
    """The request id inside a completion id; 404 for an id this system did not make."""
    rid = api.request_id_of(completion)
    try:
        parse_request_id(rid)
    except ValueError:
        raise api.not_found(f"No completion with id {completion!r}.") from None
    return rid


async def owned(gw: Gateway, rid: str, completion: str, key: ApiKey) -> dict:
    """The request's notes if the caller's tenant owns it; 404 otherwise, 503 if Redis cannot say."""
    if gw.producer is None:
        raise api.unavailable("The gateway is not connected to the inference pipeline yet.")
    meta = await gw.recall(rid)
    if meta == {}:
        raise api.unavailable("The owner of this completion cannot be checked right now (Redis unreachable).")
    if meta is None or meta.get("tenant") != key.tenant:
        raise api.not_found(f"No completion with id {completion!r} (or it has expired).")
    return meta


@router.get("/{completion}/stream")
async def resume(
    completion: str,
    last_event_id: str | None = Header(None),
    last_event_id_query: str | None = None,
    include_usage: bool | None = None,
    gw: Gateway = Depends(pipeline),
    key: ApiKey = Depends(principal),
):
    """Resume a stream on any instance: the frames after `Last-Event-ID`, replayed from the log."""
    rid = request_id(completion)
    try:
        last = parse_last_event_id(last_event_id or last_event_id_query, rid)
    except ValueError as exc:
        raise api.invalid_request(str(exc), param="Last-Event-ID") from None
    meta = await owned(gw, rid, completion, key)
    usage = meta.get("include_usage", False) if include_usage is None else include_usage
    framer = Framer(
        rid, meta.get("model", "unknown"), meta.get("created", parse_request_id(rid)[1] // 1000), usage, last
    )
    generation = await gw.canceller.attach(rid)
    gw.metrics.resumes.inc()
    source = replay(gw.bootstrap, rid, idle_timeout_s=gw.cfg.progress_timeout_s)
    if meta.get("screening") == "parallel":
        source = held_until_screened(source)

    async def settle(done: Completion, _: list[str]) -> None:
        # once per request: a no-op if the admitting instance counted it already (it normally has); a
        # blocking verdict ends the stream before the worker's own Completion, which counts the usage
        if done.finish_reason != "content_filter":
            await gw.limiter.settle_answer(rid, meta, done)

    return sse_response(gw, framer, source, generation, 0.0, cleanup=lambda: None, settle=settle)


@router.post("/{completion}/cancel")
async def cancel(completion: str, gw: Gateway = Depends(pipeline), key: ApiKey = Depends(principal)) -> dict:
    """Stop generating now (the chat page's stop button)."""
    rid = request_id(completion)
    meta = await owned(gw, rid, completion, key)
    await gw.canceller.cancel(rid, "client_cancelled")
    with contextlib.suppress(Exception):  # its slot, whichever instance admitted it (else its lease lapses)
        await gw.limiter.release(rid, meta)
    return {"id": completion, "object": "chat.completion.cancel", "cancelled": True}
