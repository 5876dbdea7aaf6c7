"""The Responses API: `POST /v1/responses` (streamed or not), `GET /v1/responses/{id}` (the stored
response, or with `stream=true` its events again from the log, after `Last-Event-ID` or
`starting_after`).

A response is a run (schemas/runs.py): the gateway writes step 0 as a ChatRequest carrying a
RunSpec and follows every step's events on its own tokens partition (each step's request id is
derived from the run id); the conversation processor drives the loop through the tool processor.
Owner checks are those of chat streams: the tenant noted at admission, 404 for anyone else.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import APIRouter, Depends, Header
from fastapi.responses import JSONResponse
from pydantic import TypeAdapter, ValidationError

from common import sealing
from common.models import load_tokenizer
from common.presets import presets
from gateway import background, compaction, context
from gateway import openai_api as api
from gateway.answers import live_events
from gateway.auth import principal
from gateway.deps import pipeline
from gateway.input_files import read_files
from gateway.pipeline import Gateway
from gateway.ratelimit import estimate_prompt_tokens
from gateway.response_owners import owned_response, previous_response, response_run_id
from gateway.responses_api import ResponseCreate, ResponseTool, input_items, messages_of, output_and_run
from gateway.responses_framing import ResponseFramer, base_response
from gateway.resume import NOTHING_SEEN, new_request_id, parse_last_event_id, replay
from gateway.routes.chat import admit
from gateway.screening import held_until_screened
from gateway.sse import SSEResponse, frame
from producers import publish
from schemas import ChatRequest, Completion, Event, RunSpec, SamplingParams, Usage
from schemas import keys as K
from schemas.ids import event_id, step_request_id
from schemas.prompt import prompt_ids
from topics import CHAT_REQUESTS

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1")
DEFAULT_MAX_TOKENS = 256
FLEX_PRIORITY = -1  # below the free tier's 0 (schemas.keys.TIER_PRIORITY)
FLEX_SHARE = 0.25  # of the admission wait budget
_tools = TypeAdapter(list[ResponseTool])


def _preset_tools(name: str | None) -> list:
    if name is None:
        return []
    preset = presets().get(name)
    if preset is None:
        raise api.APIError(
            404,
            f"The assistant preset `{name}` does not exist.",
            "invalid_request_error",
            param="assistant",
            code="preset_not_found",
        )
    try:
        return _tools.validate_python(preset.tools)
    except ValidationError as exc:
        raise api.APIError(
            500,
            f"The assistant preset `{name}` names invalid tools: {exc.errors()[0]['msg']}",
            "server_error",
            code="preset_invalid",
        ) from None


def _sampling(body: ResponseCreate) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=body.max_output_tokens or DEFAULT_MAX_TOKENS,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            logprobs=body.logprobs_asked(),
            stream_interval=body.stream_interval,
            stream_interval_ms=body.stream_interval_ms,
        )
    except ValueError as exc:
        raise api.invalid_request(str(exc)) from None


def _echo(body: ResponseCreate, tools: list, sampling: SamplingParams) -> dict[str, Any]:
    """The request fields a response object repeats."""
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    return {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "parallel_tool_calls": body.parallel_tool_calls is not False and body.max_tool_calls is None,
        "previous_response_id": body.previous_response_id,
        "store": body.store,
        "background": body.background,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty,
        "safety_identifier": body.safety_identifier,
        "prompt_cache_key": body.prompt_cache_key,
        "text": {
            "format": body.text.format.model_dump(by_alias=True, exclude_none=True)
            if body.text and body.text.format
            else {"type": "text"}
        },
        "tool_choice": choice if isinstance(choice, str) else choice.model_dump(exclude_none=True),
        "tools": [_tool_echo(t) for t in tools],
        "user": body.user,
        "metadata": body.metadata or {},
        "assistant": body.assistant,
        "conversation": {"id": body.conversation_id} if body.conversation is not None else None,
        "truncation": body.truncation or "disabled",
        "max_tool_calls": body.max_tool_calls,
        "top_logprobs": body.top_logprobs or 0,
        "service_tier": "flex" if flex(body) else "default",
    }


def _tool_echo(tool) -> dict[str, Any]:
    """A tool as the response object lists it: a function's arguments always follow its schema (the
    grammar forces them), so its `strict` is true unless the request said otherwise."""
    echo = tool.model_dump(exclude_none=True)
    if echo.get("type") == "function":  # Open Responses: description and parameters present, null if unset
        echo = {"description": None, "parameters": None, **echo}
        echo.setdefault("strict", True)
    return echo


@router.post("/responses")
async def create(body: ResponseCreate, gw: Gateway = Depends(pipeline), key: K.ApiKey = Depends(principal)):
    return await create_response(body, gw, key)


async def create_response(
    body: ResponseCreate, gw: Gateway, key: K.ApiKey, unstored: frozenset[str] = frozenset()
):
    """A response, over HTTP or a WebSocket; `unstored`: the store-false responses it may continue (its
    WebSocket connection's own, as OpenAI's WebSocket mode keeps them on the connection)."""
    field = body.unsupported()
    if field is not None:
        raise api.invalid_request(f"`{field}` is not supported by this server.", field)
    if body.background and not body.store:
        raise api.invalid_request(
            "A background response must be stored: background needs store true.", "store"
        )
    if body.model not in gw.cfg.models:
        raise api.model_not_found(body.model)
    if body.moderation is not None and (refused := body.moderation.refused()) is not None:
        raise api.invalid_request(*refused)
    tools = [*_preset_tools(body.assistant), *(body.tools or [])]
    output, run = output_and_run(tools, body, gw.cfg.responses_max_steps)
    if body.moderation is not None:
        output = msgspec.structs.replace(output, moderated=True)
    sampling = _sampling(body)
    conversation, earlier = await in_conversation(gw, body, key.tenant)
    await read_files(gw, key.tenant, body)
    messages = messages_of(body, key.tenant, earlier)
    if body.previous_response_id is not None:
        before = await previous_response(gw, body.previous_response_id, key.tenant, unstored)
        conversation = before["conversation_id"]
    if body.context_management and body.previous_response_id is not None:
        raise api.invalid_request(
            "context_management compacts the history the request brings (its input, or its "
            "conversation); a previous response's history is the conversation processor's.",
            "context_management",
        )
    await context.check(body.model, messages, sampling.max_tokens, "max_output_tokens", output)
    admit(gw, body.model, FLEX_SHARE if flex(body) else 1.0)
    partition, created_at = gw.reply_partition(), time.time()
    rid = new_request_id(partition, created_at)
    if body.conversation is not None:
        await gw.conversations.hold(conversation, rid)
    try:
        messages, compacted = await _compacted(gw, key, body, messages, output)
        if run.truncation == "disabled":
            await context.check_whole(body.model, messages, sampling.max_tokens, output)
        ticket = await gw.limiter.take(
            key,
            estimate_prompt_tokens([m.content for m in messages]) + sampling.max_tokens,
            rid,
            gw.cfg.max_streams(key.max_streams, key.tier),
            gw.cfg.stream_lease_s,
        )
    except BaseException:
        if body.conversation is not None:
            await gw.conversations.release(conversation, rid)
        raise
    conversation = conversation or rid
    event = ChatRequest(
        request_id=rid,
        conversation_id=conversation,
        created_at=created_at,
        tenant=key.tenant,
        tier=key.tier,
        priority=FLEX_PRIORITY if flex(body) else key.priority,
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
        run=run,
        full_history=body.conversation is not None,
        cache_key=body.prompt_cache_key or "",
    )
    created = int(created_at)
    note = {
        "tenant": key.tenant,
        "model": body.model,
        "created": created,
        "conversation_id": conversation,
        "store": body.store,
        "background": body.background,
        "screening": gw.cfg.screening,
        "in_conversation": body.conversation is not None,
        "compacted": compacted,
        "echo": _echo(body, tools, sampling),
        "moderated": body.moderation is not None,
        "run": {
            "server_tools": run.server_tools,
            "max_steps": run.max_steps,
            "max_output_tokens": run.max_output_tokens,
        },
        **ticket.note(),
    }
    gw.inflight.track(rid, note)  # its slot held while it runs; released, and usage counted, by _finish
    steps = tuple(step_request_id(rid, k) for k in range(1, run.max_steps))
    stream = gw.fanout.subscribe(rid, steps)
    written, generation, kept_input = await asyncio.gather(
        asyncio.wait_for(
            publish(gw.producer, CHAT_REQUESTS, event, key=K.conversation_key(key.tenant, conversation)),
            timeout=10,
        ),
        gw.admitted(rid, note),
        _keep_input(gw, body, rid, note),
        return_exceptions=True,
    )
    kept = (
        written
        if isinstance(written, BaseException)
        else generation
        if isinstance(generation, BaseException)
        else kept_input
        if isinstance(kept_input, BaseException) and body.conversation
        else None
    )
    if kept is not None:
        gw.fanout.unsubscribe(rid)
        await gw.inflight.finish(rid, None)
        if body.conversation is not None:
            await gw.conversations.release(conversation, rid)
        exc = kept
        raise api.unavailable(f"Could not hand the request to the pipeline: {exc or type(exc).__name__}")

    source = live_events(gw, stream)
    framer = _framer(rid, note)
    cleanup = lambda: gw.fanout.unsubscribe(rid)
    if body.background:  # followed here to its end; any instance answers GET from the log meanwhile
        gw.background(background.follow(gw, framer, source, generation, cleanup, _finisher(gw, note)))
        queued = _framer(rid, note).response
        queued["status"] = "queued"
        return JSONResponse(queued, headers=ticket.headers)
    if body.stream:
        return _sse(gw, framer, source, NOTHING_SEEN, generation, note, cleanup, headers=ticket.headers)
    if not await background.fold(framer, source, cleanup):
        gw.canceller.no_progress(rid, generation)
        gw.background(_finish_when_ended(gw, rid, note))
        raise api.APIError(
            504,
            f"The model made no progress for {gw.cfg.progress_timeout_s:.0f}s; the response "
            "was cancelled. Please retry.",
            "server_error",
            code="timeout",
        )
    gw.canceller.release(rid)
    if body.conversation is not None:  # in the conversation before the client can send its next turn
        await _finish(gw, rid, note, framer)
    else:
        gw.background(_finish(gw, rid, note, framer))
    return JSONResponse(framer.response, headers=ticket.headers)


def flex(body: ResponseCreate) -> bool:
    """`service_tier: "flex"`: below every tier at the workers, and admitted only while the model's queue is
    short (a quarter of the wait budget); the response says it ran as flex."""
    return body.service_tier == "flex"


def summary_run(
    gw: Gateway,
    key: K.ApiKey,
    model: str,
    cache_key: str | None = None,
    service_tier: str | None = None,
):
    """compaction.summarise's runner: a stored-false, greedy response run of this key through the pipeline,
    with the compaction request's prompt_cache_key and service_tier."""

    async def run(instructions: str, text: str, max_tokens: int) -> dict:
        body = ResponseCreate(
            model=model,
            instructions=instructions,
            input=text,
            store=False,
            temperature=0,
            max_output_tokens=max_tokens,
            prompt_cache_key=cache_key,
            service_tier=service_tier,
        )
        return json.loads((await create(body, gw, key)).body)

    return run


async def _compacted(
    gw: Gateway, key: K.ApiKey, body: ResponseCreate, messages: list, output
) -> tuple[list, dict | None]:
    """With context_management: the history before the newest message condensed (the user's messages
    kept, the model's summary for the rest) when the prompt would pass the threshold."""
    if not body.context_management or len(messages) < 3 or messages[-1].role != "user":
        return messages, None  # (a function's output answers a call the compaction would condense)
    window = context.window(body.model)
    threshold = body.context_management[0].compact_threshold or (window or 2048) * 3 // 4
    try:
        count = await asyncio.to_thread(lambda: len(prompt_ids(load_tokenizer(body.model), messages, output)))
    except (OSError, ValueError):  # no tokenizer here for this model: the estimate the limits use
        count = estimate_prompt_tokens([m.content for m in messages])
    if count <= threshold:
        return messages, None
    summary, _ = await compaction.summarise(summary_run(gw, key, body.model), messages[:-1], window)
    item = compaction.item(key.tenant, summary)
    if body.conversation is not None:  # the conversation reads the item in place of what it condenses
        await gw.conversations.append(body.conversation_id, key.tenant, [item])
    return [*compaction.superseded(messages[:-1]), compaction.summary_message(summary), messages[-1]], item


async def in_conversation(gw: Gateway, body: ResponseCreate, tenant: str) -> tuple[str | None, list]:
    """The conversation the response runs in (its items as the history the model reads), if any."""
    conv = body.conversation_id
    if conv is None:
        return None, []
    if body.previous_response_id is not None:
        raise api.invalid_request(
            "Send conversation or previous_response_id, not both.", "previous_response_id"
        )
    if not body.store:
        raise api.invalid_request("A response in a conversation is kept in it: store must be true.", "store")
    return conv, await gw.conversations.history(conv, tenant)


def _framer(rid: str, note: dict) -> ResponseFramer:
    spec = RunSpec(**note["run"])
    return ResponseFramer(
        rid,
        spec,
        base_response(rid, note["created"], note["model"], note["echo"]),
        note["conversation_id"],
        preface=[note["compacted"]] if note.get("compacted") else [],
        moderated=bool(note.get("moderated")),
    )


async def _keep_input(gw: Gateway, body: ResponseCreate, rid: str, note: dict) -> None:
    """A stored response's input items, for GET .../input_items (best effort: the answer does not wait
    on it)."""
    if body.store and gw.redis is not None:
        items = input_items(body, rid)
        sealed = await sealing.unblocked(sealing.seal_json, note["tenant"], note["conversation_id"], items)
        await gw.redis.set(K.response_input(rid), sealed, ex=K.RESPONSE_TTL_S)


def _finisher(gw: Gateway, note: dict) -> background.Finish:
    return lambda framer: _finish(gw, framer.run_id, note, framer)


async def _finish(gw: Gateway, rid: str, note: dict, framer: ResponseFramer) -> None:
    """A run's end: its usage counted once (all steps), the response stored for GET when asked."""
    prompt, completion, cached, written = framer.tokens
    done = Completion(
        request_id=rid,
        seq=0,
        finish_reason="stop",
        usage=Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            cached_tokens=cached,
            cache_write_tokens=written,
        ),
    )
    if rid in gw.inflight:
        await gw.inflight.finish(rid, done)  # frees its open-request slot too
    else:  # read to its end through a resume on this instance: usage counted once, whichever instance
        await gw.limiter.settle_answer(rid, note, done)
    if note.get("in_conversation"):  # before it is stored: a client that sees it ended may go on
        await _into_conversation(gw, rid, note, framer.response)
    if note.get("store") and gw.redis is not None:
        try:
            sealed = await sealing.unblocked(
                sealing.seal_json, note["tenant"], note["conversation_id"], framer.response
            )
            await gw.redis.set(K.stored_response(rid), sealed, ex=K.RESPONSE_TTL_S)
        except Exception as exc:  # noqa: BLE001 - the answer went out; only GET misses it
            log.warning("response %s not stored: %s", rid, exc)


async def _finish_when_ended(gw: Gateway, rid: str, note: dict) -> None:
    """A run nobody follows any more (its client left, or it made no progress): read its state from the
    log now and then until it has ended (resumed or cancelled), so that its conversation is freed then
    rather than when the hold expires."""
    delay = gw.cfg.cancel_grace_s + 1
    deadline = time.monotonic() + K.CONVERSATION_BUSY_S
    while time.monotonic() < deadline:
        await asyncio.sleep(delay)
        try:
            state = await background.snapshot(gw, _framer(rid, note), note, _finisher(gw, note))
        except Exception as exc:  # noqa: BLE001 - the log or Redis away: try again later
            log.warning("response %s: its end not read yet: %s", rid, exc)
            state = {}
        if state.get("status") not in (None, "queued", "in_progress"):
            return
        delay = min(delay * 2, 60)


async def _into_conversation(gw: Gateway, rid: str, note: dict, response: dict) -> None:
    """The ended response's input and output items appended to its conversation (once: the ids are the
    log's), then the conversation free for its next response."""
    conv = note["conversation_id"]
    try:
        given = await sealing.unblocked(sealing.open_json, await gw.redis.get(K.response_input(rid))) or []
        await gw.conversations.append(conv, note["tenant"], [*given, *response["output"]])
    except api.APIError as exc:  # deleted meanwhile, or full: the response stands on its own
        log.warning("response %s not added to conversation %s: %s", rid, conv, exc.message)
    except Exception as exc:  # noqa: BLE001 - the hold expires; a later GET of the response retries
        log.warning("response %s not added to conversation %s yet: %s", rid, conv, exc)
        return
    await gw.conversations.release(conv, rid)


def _sse(
    gw: Gateway,
    framer: ResponseFramer,
    source: AsyncIterator[list[Event]],
    last: int,
    generation: int,
    note: dict,
    cleanup,
    headers: dict[str, str] | None = None,
) -> SSEResponse:
    """Stream the run's events after position `last` (NOTHING_SEEN: all of them)."""

    def frames(events: list[dict]) -> list[bytes]:
        return [
            frame(
                json.dumps(e, separators=(",", ":")),
                event=e["type"],
                id=event_id(framer.run_id, e["sequence_number"]),
            )
            for e in events
            if e["sequence_number"] > last
        ]

    async def run():
        try:
            yield frames(framer.start())
            async for batch in source:
                shown = frames(framer.feed(batch))
                if framer.done and note.get("in_conversation"):  # in it before the client sees the end
                    await _into_conversation(gw, framer.run_id, note, framer.response)
                yield shown
                if framer.done:
                    return
            yield [
                frame(
                    json.dumps(
                        {
                            "type": "error",
                            "code": "timeout",
                            "message": f"The model made no progress for {gw.cfg.progress_timeout_s:.0f}s; "
                            "the response was cancelled.",
                            "param": None,
                            "sequence_number": framer.seq,
                        }
                    ),
                    event="error",
                )
            ]
        finally:
            cleanup()
            await source.aclose()
            if framer.done:
                gw.canceller.release(framer.run_id)
                gw.background(_finish(gw, framer.run_id, note, framer))
            else:
                gw.canceller.detached(framer.run_id, generation)
                if note.get("in_conversation"):  # the conversation waits for the run's end: see it here
                    gw.background(_finish_when_ended(gw, framer.run_id, note))

    return gw.sse.response(run(), headers)


@router.get("/responses/{response}")
async def retrieve(
    response: str,
    stream: bool = False,
    starting_after: int | None = None,
    last_event_id: str | None = Header(None),
    gw: Gateway = Depends(pipeline),
    key: K.ApiKey = Depends(principal),
):
    """The stored response (store=true), or, with stream=true, its events replayed from the log."""
    rid = response_run_id(response)
    meta = await owned_response(gw, rid, response, key.tenant)
    if stream:
        try:
            last = (
                parse_last_event_id(last_event_id, rid)
                if last_event_id
                else (NOTHING_SEEN if starting_after is None else starting_after)
            )
        except ValueError as exc:
            raise api.invalid_request(str(exc), param="Last-Event-ID") from None
        framer = _framer(rid, meta)
        steps = [step_request_id(rid, k) for k in range(1, framer.spec.max_steps)]
        source = replay(
            gw.bootstrap, rid, idle_timeout_s=gw.cfg.progress_timeout_s, also=steps, ends=lambda _: False
        )
        if meta.get("screening") == "parallel":
            source = held_until_screened(source)
        generation = await gw.canceller.attach(rid)
        gw.metrics.resumes.inc()
        return _sse(
            gw, framer, source, last, generation, meta, cleanup=lambda: None
        )  # settles once, anywhere
    if not meta.get("store"):
        raise api.not_found(f"Response {response!r} was created with store false.")
    kept = await background.stored(gw, rid)
    if kept is not None:
        return JSONResponse(kept)
    if meta.get("background"):  # where it stands on the log now
        return JSONResponse(await background.snapshot(gw, _framer(rid, meta), meta, _finisher(gw, meta)))
    return JSONResponse(_framer(rid, meta).response)  # still running: in_progress, no output yet


@router.post("/responses/{response}/cancel")
async def cancel(response: str, gw: Gateway = Depends(pipeline), key: K.ApiKey = Depends(principal)):
    """Cancel a background response (OpenAI cancels background responses only)."""
    rid = response_run_id(response)
    meta = await owned_response(gw, rid, response, key.tenant)
    if not meta.get("background"):
        raise api.invalid_request(
            "Only a response created with background true can be cancelled.", "response"
        )
    kept = await background.stored(gw, rid)
    if kept is not None:  # it ended already
        return JSONResponse(kept)
    return JSONResponse(await background.cancel(gw, lambda: _framer(rid, meta), meta, _finisher(gw, meta)))


@router.delete("/responses/{response}")
async def delete(response: str, gw: Gateway = Depends(pipeline), key: K.ApiKey = Depends(principal)):
    """Forget a stored response: GET and previous_response_id answer 404 from now on (its events stay on
    the log for their retention, as every event does)."""
    rid = response_run_id(response)
    await owned_response(gw, rid, response, key.tenant)
    await gw.redis.delete(K.stored_response(rid), K.response_input(rid), K.gateway_request(rid))
    return {"id": response, "object": "response", "deleted": True}
