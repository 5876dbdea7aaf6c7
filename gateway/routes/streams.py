"""An admitted request after the fact: resume its stream from the log, or cancel it."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Header

from gateway import openai_api as api
from gateway.answers import sse_response
from gateway.deps import pipeline
from gateway.framing import Framer
from gateway.pipeline import Gateway
from gateway.resume import parse_last_event_id, parse_request_id, replay
from gateway.screening import held_until_screened

router = APIRouter(prefix="/v1/chat/completions")


def request_id(completion: str) -> str:
    """The request id inside a completion id; 404 for an id this system did not make."""
    rid = api.request_id_of(completion)
    try:
        parse_request_id(rid)
    except ValueError:
        raise api.not_found(f"No completion with id {completion!r}.") from None
    return rid


@router.get("/{completion}/stream")
async def resume(completion: str, last_event_id: str | None = Header(None),
                 last_event_id_query: str | None = None, include_usage: bool | None = None,
                 gw: Gateway = Depends(pipeline)):
    """Resume a stream on any instance: the frames after `Last-Event-ID`, replayed from the log."""
    rid = request_id(completion)
    try:
        last = parse_last_event_id(last_event_id or last_event_id_query, rid)
    except ValueError as exc:
        raise api.invalid_request(str(exc), param="Last-Event-ID") from None
    if gw.producer is None:
        raise api.unavailable("The gateway is not connected to the inference pipeline yet.")
    meta = await gw.recall(rid)
    if meta is None:
        raise api.not_found(f"No completion with id {completion!r} (or it has expired).")
    usage = meta.get("include_usage", False) if include_usage is None else include_usage
    framer = Framer(rid, meta.get("model", "unknown"), meta.get("created", parse_request_id(rid)[1] // 1000),
                    usage, last)
    generation = await gw.canceller.attach(rid)
    gw.metrics.resumes.inc()
    source = replay(gw.bootstrap, rid, idle_timeout_s=gw.cfg.progress_timeout_s)
    if meta.get("screening") == "parallel":
        source = held_until_screened(source)
    return sse_response(gw, framer, source, generation, 0.0, cleanup=lambda: None)


@router.post("/{completion}/cancel")
async def cancel(completion: str, gw: Gateway = Depends(pipeline)) -> dict:
    """Stop generating now (the chat page's stop button)."""
    rid = request_id(completion)
    if gw.producer is None:
        raise api.unavailable("The gateway is not connected to the inference pipeline yet.")
    await gw.canceller.cancel(rid, "client_cancelled")
    return {"id": completion, "object": "chat.completion.cancel", "cancelled": True}
