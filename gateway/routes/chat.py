"""POST /v1/chat/completions: admit the request, hand it to the pipeline as a ChatRequest event,
and answer from the token events on this instance's partitions (SSE or one JSON body)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request

from gateway import openai_api as api
from gateway.answers import collect, sse_response
from gateway.deps import pipeline
from gateway.framing import Framer
from gateway.pipeline import Gateway
from gateway.resume import NOTHING_SEEN, new_request_id
from gateway.tool_params import BadField, check_tool_messages, output_spec
from producers import publish
from schemas import ChatMessage, ChatRequest, Event, FunctionCall, MessageToolCall, OutputSpec, SamplingParams
from topics import CHAT_REQUESTS

DEFAULT_MAX_TOKENS = 256
router = APIRouter(prefix="/v1")


@router.post("/chat/completions")
async def chat_completions(body: api.ChatCompletionRequest, request: Request, gw: Gateway = Depends(pipeline)):
    stream_label = "true" if body.stream else "false"
    try:
        return await _chat(gw, body, request)
    except api.APIError as exc:
        gw.metrics.requests.labels(body.model, stream_label, str(exc.status)).inc()
        raise


def sampling_of(body: api.ChatCompletionRequest) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=body.max_completion_tokens or body.max_tokens or DEFAULT_MAX_TOKENS,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            stop=body.stop_list(), seed=body.seed)
    except ValueError as exc:
        raise api.invalid_request(str(exc)) from None


def messages_of(body: api.ChatCompletionRequest) -> list[ChatMessage]:
    return [ChatMessage(role="system" if msg.role == "developer" else msg.role, content=msg.text(),
                        name=msg.name, tool_call_id=msg.tool_call_id,
                        tool_calls=[MessageToolCall(id=c.id, function=FunctionCall(
                            name=c.function.name, arguments=c.function.arguments)) for c in msg.tool_calls or []])
            for msg in body.messages]


def output_of(body: api.ChatCompletionRequest) -> OutputSpec:
    try:
        check_tool_messages(body.messages, continued=body.conversation_id is not None)
        return output_spec(body.tools, body.tool_choice, body.parallel_tool_calls, body.response_format)
    except BadField as exc:
        raise api.invalid_request(str(exc), exc.param) from None


def admit(gw: Gateway, model: str) -> None:
    """Refuse before anything is written: not connected (503), too many streams or too much lag (429)."""
    if gw.fanout is None or gw.producer is None:
        raise api.unavailable("The gateway is not connected to the inference pipeline yet.")
    if len(gw.fanout.streams) >= gw.cfg.max_active_streams:
        gw.metrics.rejections.labels(model).inc()
        raise api.APIError(429, f"This gateway instance holds {gw.cfg.max_active_streams} open streams; "
                                "retry after 1s.", "rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": "1"})
    gw.admission.admit(model)  # 429 / 503 from the worker group's lag


async def _chat(gw: Gateway, body: api.ChatCompletionRequest, request: Request):
    if body.model not in gw.cfg.models:
        raise api.model_not_found(body.model)
    sampling = sampling_of(body)
    output = output_of(body)
    messages = messages_of(body)
    admit(gw, body.model)

    partition = gw.reply_partition()
    started = time.monotonic()
    created_at = time.time()
    rid = new_request_id(partition, created_at)
    event = ChatRequest(request_id=rid, conversation_id=body.conversation_id or rid, created_at=created_at,
                        tenant=request.headers.get("x-tenant", "default"), model=body.model,
                        messages=messages, sampling=sampling, output=output, stream=body.stream, user=body.user,
                        assistant=body.assistant, reply_partition=partition, gateway_id=gw.cfg.instance_id)
    fanout = gw.fanout
    stream = fanout.subscribe(rid)
    created = int(created_at)
    include_usage = body.include_usage()
    # the write to the pipeline and the two Redis notes go out together
    written, _, generation = await asyncio.gather(
        asyncio.wait_for(publish(gw.producer, CHAT_REQUESTS, event, key=event.conversation_id), timeout=10),
        gw.remember(rid, {"model": body.model, "created": created, "include_usage": include_usage}),
        gw.canceller.attach(rid), return_exceptions=True)
    if isinstance(written, BaseException) or isinstance(generation, BaseException):
        fanout.unsubscribe(rid)
        exc = written if isinstance(written, BaseException) else generation
        raise api.unavailable(f"Could not hand the request to the pipeline: {exc or type(exc).__name__}")
    gw.metrics.requests.labels(body.model, "true" if body.stream else "false", "200").inc()

    async def live() -> AsyncIterator[list[Event]]:
        while True:
            batch = await stream.take(gw.cfg.request_timeout_s)
            if not batch:
                return
            yield batch

    if body.stream:
        framer = Framer(rid, body.model, created, include_usage, NOTHING_SEEN)
        return sse_response(gw, framer, live(), generation, started, cleanup=lambda: fanout.unsubscribe(rid))
    return await collect(gw, rid, body.model, created, live(), generation, request,
                         cleanup=lambda: fanout.unsubscribe(rid))
