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

from typing import Literal

from fastapi import APIRouter, Depends, Header
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ConfigDict, Field, TypeAdapter, ValidationError
from sse_starlette import EventSourceResponse, ServerSentEvent

from gateway import background, context
from gateway import openai_api as api
from gateway.answers import KeepAlive, live_events
from gateway.auth import principal
from gateway.deps import pipeline
from gateway.pipeline import Gateway
from gateway.ratelimit import estimate_prompt_tokens
from gateway.resume import NOTHING_SEEN, new_request_id, parse_last_event_id, replay
from gateway.file_objects import check_order, page
from gateway.responses_api import ResponseCreate, ResponseTool, input_items, messages_of, output_and_run
from gateway.responses_framing import ResponseFramer, base_response
from gateway.routes.chat import admit
from gateway.screening import held_until_screened
from producers import publish
from schemas import ChatRequest, Completion, Event, RunSpec, SamplingParams, Usage
from schemas import keys as K
from schemas.ids import event_id, run_id_of, step_request_id
from common.models import load_tokenizer
from common.presets import presets
from schemas.prompt import prompt_ids
from topics import CHAT_REQUESTS

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1")
DEFAULT_MAX_TOKENS = 256
_tools = TypeAdapter(list[ResponseTool])


def _run_id(response: str) -> str:
    try:
        return run_id_of(response)
    except ValueError:
        raise api.not_found(f"No response with id {response!r}.") from None


async def _owned(gw: Gateway, rid: str, response: str, tenant: str) -> dict:
    meta = await gw.recall(rid)
    if meta == {}:
        raise api.unavailable("The owner of this response cannot be checked right now (Redis unreachable).")
    if meta is None or meta.get("tenant") != tenant or "run" not in meta:
        raise api.not_found(f"No response with id {response!r} (or it has expired).")
    return meta


def _preset_tools(name: str | None) -> list:
    if name is None:
        return []
    preset = presets().get(name)
    if preset is None:
        raise api.APIError(404, f"The assistant preset `{name}` does not exist.", "invalid_request_error",
                           param="assistant", code="preset_not_found")
    try:
        return _tools.validate_python(preset.tools)
    except ValidationError as exc:
        raise api.APIError(500, f"The assistant preset `{name}` names invalid tools: {exc.errors()[0]['msg']}",
                           "server_error", code="preset_invalid") from None


def _sampling(body: ResponseCreate) -> SamplingParams:
    try:
        return SamplingParams(max_tokens=body.max_output_tokens or DEFAULT_MAX_TOKENS,
                              temperature=1.0 if body.temperature is None else body.temperature,
                              top_p=1.0 if body.top_p is None else body.top_p,
                              presence_penalty=body.presence_penalty or 0.0,
                              frequency_penalty=body.frequency_penalty or 0.0)
    except ValueError as exc:
        raise api.invalid_request(str(exc)) from None


def _echo(body: ResponseCreate, tools: list, sampling: SamplingParams) -> dict[str, Any]:
    """The request fields a response object repeats."""
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    return {"instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "store": body.store, "background": body.background,
            "temperature": sampling.temperature, "top_p": sampling.top_p,
            "presence_penalty": sampling.presence_penalty, "frequency_penalty": sampling.frequency_penalty,
            "safety_identifier": body.safety_identifier,
            "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)
                     if body.text and body.text.format else {"type": "text"}},
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(exclude_none=True),
            "tools": [_tool_echo(t) for t in tools], "user": body.user,
            "metadata": body.metadata or {}, "assistant": body.assistant}


def _tool_echo(tool) -> dict[str, Any]:
    """A tool as the response object lists it: a function's arguments always follow its schema (the
    grammar forces them), so its `strict` is true unless the request said otherwise."""
    echo = tool.model_dump(exclude_none=True)
    if echo.get("type") == "function":
        echo.setdefault("strict", True)
    return echo


@router.post("/responses")
async def create(body: ResponseCreate, gw: Gateway = Depends(pipeline), key: K.ApiKey = Depends(principal)):
    field = body.unsupported()
    if field is not None:
        raise api.invalid_request(f"`{field}` is not supported by this server.", field)
    if body.background and not body.store:
        raise api.invalid_request("A background response must be stored: background needs store true.", "store")
    if body.model not in gw.cfg.models:
        raise api.model_not_found(body.model)
    tools = [*_preset_tools(body.assistant), *(body.tools or [])]
    output, run = output_and_run(tools, body, gw.cfg.responses_max_steps)
    sampling = _sampling(body)
    messages = messages_of(body)
    conversation = None
    if body.previous_response_id is not None:
        before = await _owned(gw, _run_id(body.previous_response_id), body.previous_response_id, key.tenant)
        if not before.get("store"):
            raise api.APIError(404, f"Previous response {body.previous_response_id!r} was created with store "
                                    "false and cannot be continued.", "invalid_request_error",
                               param="previous_response_id", code="not_found")
        conversation = before["conversation_id"]
    await context.check(body.model, messages, sampling.max_tokens, "max_output_tokens", output)
    admit(gw, body.model)
    partition, created_at = gw.reply_partition(), time.time()
    rid = new_request_id(partition, created_at)
    ticket = await gw.limiter.take(key, estimate_prompt_tokens([m.content for m in messages]) + sampling.max_tokens,
                                   rid, gw.cfg.max_streams(key.max_streams, key.tier), gw.cfg.stream_lease_s)
    conversation = conversation or rid
    event = ChatRequest(request_id=rid, conversation_id=conversation, created_at=created_at, tenant=key.tenant,
                        tier=key.tier, priority=key.priority, model=body.model, messages=messages, sampling=sampling,
                        output=output, stream=body.stream, user=body.user or body.safety_identifier, assistant=body.assistant,
                        reply_partition=partition, gateway_id=gw.cfg.instance_id, screening=gw.cfg.screening, run=run)
    created = int(created_at)
    note = {"tenant": key.tenant, "model": body.model, "created": created, "conversation_id": conversation,
            "store": body.store, "background": body.background, "screening": gw.cfg.screening,
            "echo": _echo(body, tools, sampling),
            "run": {"server_tools": run.server_tools, "max_steps": run.max_steps,
                    "max_output_tokens": run.max_output_tokens}, **ticket.note()}
    gw.inflight.track(rid, note)  # its slot held while it runs; released, and usage counted, by _finish
    steps = tuple(step_request_id(rid, k) for k in range(1, run.max_steps))
    stream = gw.fanout.subscribe(rid, steps)
    written, _, generation, _ = await asyncio.gather(
        asyncio.wait_for(publish(gw.producer, CHAT_REQUESTS, event,
                                 key=K.conversation_key(key.tenant, conversation)), timeout=10),
        gw.remember(rid, note), gw.canceller.attach(rid), _keep_input(gw, body, rid), return_exceptions=True)
    if isinstance(written, BaseException) or isinstance(generation, BaseException):
        gw.fanout.unsubscribe(rid)
        await gw.inflight.finish(rid, None)
        exc = written if isinstance(written, BaseException) else generation
        raise api.unavailable(f"Could not hand the request to the pipeline: {exc or type(exc).__name__}")

    source = live_events(gw, stream)
    framer = _framer(rid, note)
    cleanup = lambda: gw.fanout.unsubscribe(rid)  # noqa: E731
    if body.background:  # followed here to its end; any instance answers GET from the log meanwhile
        gw.background(background.follow(gw, framer, source, generation, cleanup, _finisher(gw, note)))
        queued = _framer(rid, note).response
        queued["status"] = "queued"
        return JSONResponse(queued, headers=ticket.headers)
    if body.stream:
        return _sse(gw, framer, source, NOTHING_SEEN, generation, note, cleanup, headers=ticket.headers)
    if not await background.fold(framer, source, cleanup):
        gw.canceller.no_progress(rid, generation)
        raise api.APIError(504, f"The model made no progress for {gw.cfg.progress_timeout_s:.0f}s; the response "
                                "was cancelled. Please retry.", "server_error", code="timeout")
    gw.canceller.release(rid)
    gw.background(_finish(gw, rid, note, framer))
    return JSONResponse(framer.response, headers=ticket.headers)


def _framer(rid: str, note: dict) -> ResponseFramer:
    spec = RunSpec(**note["run"])
    return ResponseFramer(rid, spec, base_response(rid, note["created"], note["model"], note["echo"]),
                          note["conversation_id"])


async def _keep_input(gw: Gateway, body: ResponseCreate, rid: str) -> None:
    """A stored response's input items, for GET .../input_items (best effort: the answer does not wait on it)."""
    if body.store and gw.redis is not None:
        await gw.redis.set(K.response_input(rid), json.dumps(input_items(body, rid)), ex=K.RESPONSE_TTL_S)


def _finisher(gw: Gateway, note: dict) -> background.Finish:
    return lambda framer: _finish(gw, framer.run_id, note, framer)


async def _finish(gw: Gateway, rid: str, note: dict, framer: ResponseFramer) -> None:
    """A run's end: its usage counted once (all steps), the response stored for GET when asked."""
    prompt, completion, cached = framer.tokens
    done = Completion(request_id=rid, seq=0, finish_reason="stop",
                      usage=Usage(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached))
    if rid in gw.inflight:
        await gw.inflight.finish(rid, done)  # frees its open-request slot too
    else:  # read to its end through a resume on this instance: usage counted once, whichever instance
        await gw.limiter.settle_answer(rid, note, done)
    if note.get("store") and gw.redis is not None:
        try:
            await gw.redis.set(K.stored_response(rid), json.dumps(framer.response), ex=K.RESPONSE_TTL_S)
        except Exception as exc:  # noqa: BLE001 - the answer went out; only GET misses it
            log.warning("response %s not stored: %s", rid, exc)


def _sse(gw: Gateway, framer: ResponseFramer, source: AsyncIterator[list[Event]], last: int, generation: int,
         note: dict, cleanup, headers: dict[str, str] | None = None) -> EventSourceResponse:
    """Stream the run's events after position `last` (NOTHING_SEEN: all of them)."""
    def frames(events: list[dict]) -> list[ServerSentEvent]:
        return [ServerSentEvent(json.dumps(e, separators=(",", ":")), event=e["type"],
                                id=event_id(framer.run_id, e["sequence_number"]))
                for e in events if e["sequence_number"] > last]

    async def run():
        try:
            for frame in frames(framer.start()):
                yield frame
            async for batch in source:
                for frame in frames(framer.feed(batch)):
                    yield frame
                if framer.done:
                    return
            yield ServerSentEvent(json.dumps({"type": "error", "code": "timeout", "message":
                                              f"The model made no progress for {gw.cfg.progress_timeout_s:.0f}s; "
                                              "the response was cancelled.", "param": None,
                                              "sequence_number": framer.seq}), event="error")
        finally:
            cleanup()
            await source.aclose()
            if framer.done:
                gw.canceller.release(framer.run_id)
                gw.background(_finish(gw, framer.run_id, note, framer))
            else:
                gw.canceller.detached(framer.run_id, generation)

    return EventSourceResponse(run(), ping=gw.cfg.ping_s, ping_message_factory=KeepAlive, headers={
        "Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})


@router.get("/responses/{response}")
async def retrieve(response: str, stream: bool = False, starting_after: int | None = None,
                   last_event_id: str | None = Header(None), gw: Gateway = Depends(pipeline),
                   key: K.ApiKey = Depends(principal)):
    """The stored response (store=true), or, with stream=true, its events replayed from the log."""
    rid = _run_id(response)
    meta = await _owned(gw, rid, response, key.tenant)
    if stream:
        try:
            last = parse_last_event_id(last_event_id, rid) if last_event_id else (
                NOTHING_SEEN if starting_after is None else starting_after)
        except ValueError as exc:
            raise api.invalid_request(str(exc), param="Last-Event-ID") from None
        framer = _framer(rid, meta)
        steps = [step_request_id(rid, k) for k in range(1, framer.spec.max_steps)]
        source = replay(gw.bootstrap, rid, idle_timeout_s=gw.cfg.progress_timeout_s, also=steps,
                        ends=lambda _: False)
        if meta.get("screening") == "parallel":
            source = held_until_screened(source)
        generation = await gw.canceller.attach(rid)
        gw.metrics.resumes.inc()
        return _sse(gw, framer, source, last, generation, meta, cleanup=lambda: None)  # settles once, anywhere
    if not meta.get("store"):
        raise api.not_found(f"Response {response!r} was created with store false.")
    kept = await background.stored(gw, rid)
    if kept is not None:
        return JSONResponse(kept)
    if meta.get("background"):  # where it stands on the log now
        return JSONResponse(await background.snapshot(gw, _framer(rid, meta), meta, _finisher(gw, meta)))
    return JSONResponse(_framer(rid, meta).response)  # still running: in_progress, no output yet


class InputTokensRequest(api.UnicodeBody):
    """`POST /v1/responses/input_tokens`: the fields that make a response's input."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1, max_length=api.MAX_NAME_CHARS)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    truncation: Literal["auto"] | None = None
    # refused by name: the history of a previous response or conversation is the conversation
    # processor's, which the gateway does not read; the model does not reason
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None


@router.post("/responses/input_tokens")
async def input_tokens(body: InputTokensRequest, gw: Gateway = Depends(pipeline)):
    """How many tokens the model would read for this input: instructions, input items, and the tools and
    format as the worker writes them into the prompt (schemas/prompt.py)."""
    if body.model not in gw.cfg.models:
        raise api.model_not_found(body.model)
    for name in ("previous_response_id", "conversation", "reasoning"):
        if getattr(body, name) is not None:
            raise api.invalid_request(f"`{name}` is not supported when counting input tokens: only the input "
                                      "sent is counted here.", name)
    try:
        request = ResponseCreate.model_validate(body.model_dump(exclude_none=True))
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None
    output, _ = output_and_run(request.tools or [], request, gw.cfg.responses_max_steps)
    messages = messages_of(request)
    try:
        count = await asyncio.to_thread(lambda: len(prompt_ids(load_tokenizer(body.model), messages, output)))
    except (OSError, ValueError):
        raise api.APIError(400, f"This gateway has no tokenizer for `{body.model}` to count with.",
                           "invalid_request_error", param="model", code="tokenizer_unavailable") from None
    return {"object": "response.input_tokens", "input_tokens": count}


@router.get("/responses/{response}/input_items")
async def list_input_items(response: str, limit: int = 20, order: str = "desc", after: str | None = None,
                           before: str | None = None, gw: Gateway = Depends(pipeline),
                           key: K.ApiKey = Depends(principal)):
    """The input items of a stored response, in OpenAI's list shape."""
    rid = _run_id(response)
    meta = await _owned(gw, rid, response, key.tenant)
    raw = await gw.redis.get(K.response_input(rid)) if meta.get("store") and gw.redis is not None else None
    if raw is None:
        raise api.not_found(f"Response {response!r} has no stored input (created with store false, or expired).")
    check_order(order)
    if not 1 <= limit <= 100:
        raise api.invalid_request("limit must be from 1 to 100.", param="limit")
    return page(json.loads(raw), limit=limit, order=order, after=after, before=before)


@router.post("/responses/{response}/cancel")
async def cancel(response: str, gw: Gateway = Depends(pipeline), key: K.ApiKey = Depends(principal)):
    """Cancel a background response (OpenAI cancels background responses only)."""
    rid = _run_id(response)
    meta = await _owned(gw, rid, response, key.tenant)
    if not meta.get("background"):
        raise api.invalid_request("Only a response created with background true can be cancelled.", "response")
    kept = await background.stored(gw, rid)
    if kept is not None:  # it ended already
        return JSONResponse(kept)
    return JSONResponse(await background.cancel(gw, lambda: _framer(rid, meta), meta, _finisher(gw, meta)))


@router.delete("/responses/{response}")
async def delete(response: str, gw: Gateway = Depends(pipeline), key: K.ApiKey = Depends(principal)):
    """Forget a stored response: GET and previous_response_id answer 404 from now on (its events stay on
    the log for their retention, as every event does)."""
    rid = _run_id(response)
    await _owned(gw, rid, response, key.tenant)
    await gw.redis.delete(K.stored_response(rid), K.response_input(rid), K.gateway_request(rid))
    return {"id": response, "object": "response", "deleted": True}
