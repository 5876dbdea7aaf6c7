"""POST /v1/chat/completions: admit the request, hand it to the pipeline as a ChatRequest event,
and answer from the token events on this instance's partitions (SSE or one JSON body)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import msgspec
from fastapi import APIRouter, Depends, Request

from common import tracing
from common.presets import presets
from gateway import context
from gateway import openai_api as api
from gateway.answers import collect, live_events, sse_response
from gateway.auth import principal
from gateway.cache import Entry, hit_events
from gateway.caching import look_up
from gateway.chat_fields import refuse_unhonoured
from gateway.conversations import chat_items
from gateway.deps import pipeline
from gateway.framing import Framer
from gateway.pipeline import Gateway
from gateway.ratelimit import estimate_prompt_tokens
from gateway.resume import NOTHING_SEEN, new_request_id
from gateway.stored_chats import completion_of
from gateway.tool_params import BadField, check_tool_messages, output_spec
from producers import publish
from schemas import (
    ChatMessage,
    ChatRequest,
    Completion,
    Event,
    FunctionCall,
    MessageToolCall,
    OutputSpec,
    SafetyVerdict,
    SamplingParams,
    TraceContext,
)
from schemas.keys import ApiKey, conversation_key
from topics import CHAT_REQUESTS, TOKENS

log = logging.getLogger(__name__)
DEFAULT_MAX_TOKENS = 256
router = APIRouter(prefix="/v1")


@router.post("/chat/completions")
async def chat_completions(
    body: api.ChatCompletionRequest,
    request: Request,
    gw: Gateway = Depends(pipeline),
    key: ApiKey = Depends(principal),
):
    stream_label = "true" if body.stream else "false"
    try:
        return await _chat(gw, body, request, key)
    except api.APIError as exc:
        gw.metrics.requests.labels(body.model, stream_label, str(exc.status)).inc()
        raise


def sampling_of(body: api.ChatCompletionRequest, vocab: int | None = None) -> SamplingParams:
    """The request's sampling; `vocab`: the model's token count, which logit_bias ids must stay under."""
    bias = {int(token): value for token, value in (body.logit_bias or {}).items()}
    beyond = next((t for t in bias if vocab is not None and t >= vocab), None)
    if beyond is not None:
        raise api.invalid_request(
            f"logit_bias names token {beyond}, beyond this model's {vocab} tokens", "logit_bias"
        )
    try:
        return SamplingParams(
            max_tokens=body.max_completion_tokens or body.max_tokens or DEFAULT_MAX_TOKENS,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            stop=body.stop_list(),
            seed=body.seed,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            logit_bias=bias,
            logprobs=body.logprobs_asked(),
            stream_interval=body.stream_interval,
            stream_interval_ms=body.stream_interval_ms,
        )
    except ValueError as exc:
        raise api.invalid_request(str(exc)) from None


def messages_of(body: api.ChatCompletionRequest) -> list[ChatMessage]:
    return [
        ChatMessage(
            role="system" if msg.role == "developer" else msg.role,
            content=msg.text(),
            name=msg.name,
            tool_call_id=msg.tool_call_id,
            tool_calls=[
                MessageToolCall(
                    id=c.id, function=FunctionCall(name=c.function.name, arguments=c.function.arguments)
                )
                for c in msg.tool_calls or []
            ],
        )
        for msg in body.messages
    ]


def output_of(body: api.ChatCompletionRequest) -> OutputSpec:
    try:
        check_tool_messages(body.messages, continued=body.conversation_id is not None)
        return output_spec(body.tools, body.tool_choice, body.parallel_tool_calls, body.response_format)
    except BadField as exc:
        raise api.invalid_request(str(exc), exc.param) from None


def admit(gw: Gateway, model: str, share: float = 1.0) -> None:
    """Refuse before anything is written: not connected (503), too many streams or too much lag (429; with
    `share` < 1 already when the estimated wait passes that share of the budget)."""
    if gw.fanout is None or gw.producer is None:
        raise api.unavailable("The gateway is not connected to the inference pipeline yet.")
    if len(gw.fanout.streams) >= gw.cfg.max_active_streams:
        gw.metrics.rejections.labels(model).inc()
        raise api.APIError(
            429,
            f"This gateway instance holds {gw.cfg.max_active_streams} open streams; retry after 1s.",
            "rate_limit_error",
            code="rate_limit_exceeded",
            headers={"Retry-After": "1"},
        )
    gw.admission.admit(model, share)  # 429 / 503 from the worker group's lag


async def _chat(gw: Gateway, body: api.ChatCompletionRequest, request: Request, key: ApiKey):
    if body.model not in gw.cfg.models:
        raise api.model_not_found(body.model)
    if body.assistant is not None and body.assistant not in presets():
        raise api.APIError(
            404,
            f"The assistant preset `{body.assistant}` does not exist.",
            "invalid_request_error",
            param="assistant",
            code="preset_not_found",
        )
    if body.assistant is not None and presets()[body.assistant].tools:
        raise api.invalid_request(
            f"The assistant preset `{body.assistant}` runs server tools; use POST /v1/responses with it.",
            "assistant",
        )
    refuse_unhonoured(body)
    if body.metadata and not body.store:
        raise api.invalid_request(
            "metadata is kept with a stored completion: send store true with it.", "metadata"
        )
    # the tokenizer is loaded once per model, off the event loop (a first load can take seconds)
    vocab = await asyncio.to_thread(context.vocabulary, body.model) if body.logit_bias else None
    sampling = sampling_of(body, vocab)
    output = output_of(body)
    asked = messages_of(body)
    conversation = api.conversation_of(body.conversation)
    if conversation and body.conversation_id:
        raise api.invalid_request("Send conversation or conversation_id, not both.", "conversation_id")
    # a conversation's items come before the messages sent: the whole context, sent as such
    messages = await gw.conversations.history(conversation, key.tenant) + asked if conversation else asked
    await context.check(
        body.model,
        messages,
        sampling.max_tokens,
        "max_completion_tokens" if body.max_completion_tokens else "max_tokens",
        output,
    )
    admit(gw, body.model)
    partition = gw.reply_partition()
    created_at = time.time()
    rid = new_request_id(partition, created_at)
    reserve = estimate_prompt_tokens([m.content for m in messages]) + sampling.max_tokens
    ticket = await gw.limiter.take(
        key, reserve, rid, gw.cfg.max_streams(key.max_streams, key.tier), gw.cfg.stream_lease_s
    )
    created = int(created_at)
    note = {
        "tenant": key.tenant,
        "model": body.model,
        "created": created,
        "include_usage": body.include_usage(),
        **ticket.note(),
    }
    gw.inflight.track(rid, note)  # from here its slot is released and its usage counted when it ends
    try:
        if conversation:
            await gw.conversations.hold(conversation, rid)
        caches = await look_up(gw, key, body, messages, sampling)
    except BaseException:
        await gw.inflight.finish(rid, None)  # never reached the pipeline: nothing there will end it
        if conversation:  # frees it if this request held it (another's hold is left alone)
            await gw.conversations.release(conversation, rid)
        raise
    headers = {**ticket.headers, **caches.headers}
    started = time.monotonic()
    event = ChatRequest(
        request_id=rid,
        conversation_id=conversation or body.conversation_id or rid,
        full_history=conversation is not None,
        created_at=created_at,
        tenant=key.tenant,
        tier=key.tier,
        priority=key.priority,
        model=body.model,
        messages=messages,
        sampling=sampling,
        output=output,
        stream=body.stream,
        user=body.user or body.safety_identifier,
        assistant=body.assistant,
        reply_partition=partition,
        gateway_id=gw.cfg.instance_id,
        screening=gw.cfg.screening,
        cache_key=body.prompt_cache_key or "",
    )
    include_usage = note["include_usage"]
    # the root of the request's trace (or the child of the client's W3C traceparent), ended with the answer
    span = tracing.hop(
        f"chat {body.model}",
        TraceContext.parse(request.headers.get("traceparent")),
        role="gateway",
        kind="server",
        attributes={
            **tracing.request_attributes(event),
            "http.request.method": "POST",
            "http.route": "/v1/chat/completions",
            "tokenstream.stream": body.stream,
            "tokenstream.screening": gw.cfg.screening,
            "tokenstream.gateway_id": gw.cfg.instance_id,
        },
    )
    if caches.entry is not None:
        note["cached"] = True
        return await _from_cache(gw, body, request, event, note, headers, caches.entry, started, span)
    fanout = gw.fanout
    stream = fanout.subscribe(rid)
    # the write to the pipeline and the two Redis notes go out together
    written, generation = await asyncio.gather(
        asyncio.wait_for(
            publish(
                gw.producer,
                CHAT_REQUESTS,
                event,
                trace=span.trace,
                key=conversation_key(key.tenant, event.conversation_id),
            ),
            timeout=10,
        ),
        gw.admitted(rid, {**note, "screening": gw.cfg.screening}),  # a resume holds the answer like this one
        return_exceptions=True,
    )
    if isinstance(written, BaseException) or isinstance(generation, BaseException):
        fanout.unsubscribe(rid)
        await gw.inflight.finish(rid, None)
        if conversation:
            await gw.conversations.release(conversation, rid)
        exc = written if isinstance(written, BaseException) else generation
        span.fail(f"not handed to the pipeline: {exc or type(exc).__name__}", "unavailable")
        span.end()
        raise api.unavailable(f"Could not hand the request to the pipeline: {exc or type(exc).__name__}")
    gw.metrics.requests.labels(body.model, "true" if body.stream else "false", "200").inc()

    async def settle(done: Completion, sent: list[str]) -> None:
        # usage and the slot: gw.inflight, from the Completion on the log (before this stream saw it)
        if not done.error:
            await caches.store(
                gw,
                key.tenant,
                body.model,
                Entry(
                    chunks=sent,
                    finish_reason=done.finish_reason,
                    request_id=rid,
                    prompt_tokens=done.usage.prompt_tokens,
                    completion_tokens=done.usage.completion_tokens,
                ),
            )
        await _keep(gw, key.tenant, body, rid, created, done)

    async def before_end(done: Completion) -> None:
        # in the conversation before the client sees the end, so what it reads (items, its next turn) has it
        await _into_conversation(gw, key.tenant, conversation, rid, asked, done)

    def cleanup() -> None:
        fanout.unsubscribe(rid)
        span.end()
        if conversation:  # an answer its client left before the end is not kept; the conversation is free
            gw.background(gw.conversations.release(conversation, rid))

    source = live_events(gw, stream, observe=lambda batch: observe(span, batch, body.model))
    if body.stream:
        framer = Framer(rid, body.model, created, include_usage, NOTHING_SEEN)
        return sse_response(
            gw,
            framer,
            source,
            generation,
            started,
            cleanup=cleanup,
            settle=settle,
            before_end=before_end if conversation else None,
            headers=headers,
        )
    return await collect(
        gw,
        rid,
        body.model,
        created,
        source,
        generation,
        request,
        cleanup=cleanup,
        settle=settle,
        before_end=before_end if conversation else None,
        headers=headers,
        logprobs=body.logprobs is True,
    )


async def _into_conversation(
    gw: Gateway, tenant: str, conversation: str, rid: str, asked: list[ChatMessage], done: Completion
) -> None:
    try:
        if done.finish_reason not in ("error", "cancelled"):
            await gw.conversations.append(conversation, tenant, chat_items(rid, asked, done))
    except Exception as exc:  # noqa: BLE001 - the answer went out; only the conversation misses it
        log.warning("chat completion %s not added to conversation %s: %s", rid, conversation, exc)
    finally:
        await gw.conversations.release(conversation, rid)


async def _keep(
    gw: Gateway, tenant: str, body: api.ChatCompletionRequest, rid: str, created: int, done: Completion
) -> None:
    """With store: the ended answer and its messages kept for GET /v1/chat/completions (its owner only)."""
    if not body.store or done.finish_reason == "error":
        return
    cid = api.completion_id(rid)
    asked = [{"id": f"{cid}-{i}", **m.model_dump(exclude_none=True)} for i, m in enumerate(body.messages)]
    try:
        scope = (
            api.conversation_of(body.conversation) or body.conversation_id or rid
        )  # as its events were sealed
        await gw.stored_chats.keep(
            tenant, scope, rid, completion_of(rid, created, body.model, done, body.metadata or {}), asked
        )
    except Exception as exc:  # noqa: BLE001 - the answer went out; only the stored copy is missing
        log.warning("chat completion %s not stored: %s", rid, exc)


def observe(span: tracing.Hop, batch: list[Event], model: str) -> None:
    """What the request's span records of the answer as it passes: its end, or a blocking verdict."""
    if span.span is None:
        return
    for ev in batch:
        if isinstance(ev, Completion):
            span.set(tracing.completion_attributes(ev, model))
            if ev.finish_reason == "error":
                span.fail(ev.error or "error", ev.error_code or "error")
        elif isinstance(ev, SafetyVerdict) and ev.blocked:
            span.set(
                {
                    "gen_ai.response.finish_reasons": ["content_filter"],
                    "tokenstream.safety.blocked_stage": ev.stage,
                }
            )


async def _from_cache(
    gw: Gateway,
    body: api.ChatCompletionRequest,
    request: Request,
    event: ChatRequest,
    note: dict,
    headers: dict[str, str],
    entry: Entry,
    started: float,
    span: tracing.Hop,
):
    """Answer from the exact cache, framed like a live answer under a request id of its own.

    The request (marked `cached_from`) and its answer's events are written to the log as well:
    an audit sees every answer, and a resume on any instance replays it like any other.
    """
    rid = event.request_id
    events = hit_events(entry, event)
    span.set({"tokenstream.cache": "hit", "tokenstream.cached_request": entry.request_id})
    observe(span, events, body.model)
    span.end()  # answered here: nothing further of this request is traced
    generation = await gw.admitted(rid, note)
    audit = msgspec.structs.replace(event, cached_from=entry.request_id)
    gw.background(
        _write(gw, audit, events, span.trace)
    )  # while the answer goes out: a resume waits for it on the log
    gw.metrics.requests.labels(body.model, "true" if body.stream else "false", "200").inc()
    headers = {**headers, "x-tokenstream-cached-request": entry.request_id}

    async def settle(done: Completion, _: list[str]) -> None:
        await gw.inflight.finish(rid, done)  # unless the fan-out saw the hit's Completion on the log first
        await _keep(gw, event.tenant, body, rid, note["created"], done)

    async def source() -> AsyncIterator[list[Event]]:
        for ev in events:
            yield [ev]

    if body.stream:
        framer = Framer(rid, body.model, note["created"], note["include_usage"], NOTHING_SEEN)
        return sse_response(
            gw, framer, source(), generation, started, cleanup=lambda: None, settle=settle, headers=headers
        )
    return await collect(
        gw,
        rid,
        body.model,
        note["created"],
        source(),
        generation,
        request,
        cleanup=lambda: None,
        settle=settle,
        headers=headers,
    )


async def _write(gw: Gateway, audit: ChatRequest, events: list[Event], trace: TraceContext) -> None:
    """The cached answer's request and events onto the log (acks=all)."""
    try:
        key = conversation_key(audit.tenant, audit.conversation_id)
        acks = [await publish(gw.producer, CHAT_REQUESTS, audit, key=key, wait=False, trace=trace)]
        for ev in events:
            acks.append(
                await publish(
                    gw.producer, TOKENS, ev, partition=audit.reply_partition, wait=False, trace=trace
                )
            )
        await asyncio.gather(*acks)
    except Exception as exc:  # noqa: BLE001
        log.warning("cached answer %s not written to the log: %s", audit.request_id, exc)
