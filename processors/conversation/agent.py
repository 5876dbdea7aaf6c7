"""The conversation processor: ts.chat.requests (+ finished answers, tool results) -> ts.requests.prepared.

One agent reads both the chat requests and the answers re-keyed by conversation (the table row
and both topics' keys are `schemas.keys.conversation_key(tenant, conversation_id)`, so one
tenant's conversation id never reaches another tenant's history), so every
event of a conversation is handled on the same partition, in order, against the same
table row. Two more agents re-key completions from ts.tokens and tool results from
ts.tool.results to ts.conversation.turns.

Response runs (schemas/runs.py, processors/conversation/runs.py) are driven here: the history is
what the next step's prompt is made of, and the row (changelog-backed) holds the run's state, so
the loop survives a restart of this processor or of the tool processor.

A turn that needs the previous answer waits for it in the row's `parked` list, but not for
ever: a timer writes a `TurnDeadline` to ts.conversation.turns when the oldest parked turn of a
conversation has waited `parked_timeout_s` since its admission, and the history agent, reading
it in the conversation's order, gives up that answer and refuses the parked turns with a clear
error (code previous_turn_unanswered); the client's next try is prepared at once.
"""

from __future__ import annotations

import logging
import time

from common import sealing, tracing
from common.config import settings
from common.models import load_tokenizer, prompt_budget
from processors.conversation import runs
from processors.conversation.config import ConversationSettings
from processors.conversation.history import (
    bounded,
    carries_full_history,
    merge,
    unmatched_tool_message,
    with_answer,
    without_unanswered,
)
from processors.conversation.presets import apply_preset, presets
from processors.conversation.window import PromptTooLong, prompt_counter, trim
from processors.effects import Ledger
from processors.faust_app import get, make_app, put, send, table, topic, traced, typed
from schemas import (
    ChatMessage,
    ChatRequest,
    Completion,
    ConversationHistory,
    InferenceRequest,
    OutputSpec,
    ToolResult,
    Transcript,
    TurnDeadline,
    decode,
)
from schemas.keys import conversation_key
from topics import (
    CHAT_REQUESTS,
    CONVERSATION_TURNS,
    CONVERSATIONS,
    DEAD_LETTER,
    PREPARED,
    TOKENS,
    TOOL_RESULTS,
    TRANSCRIPTS,
)

log = logging.getLogger(__name__)
SEEN_KEPT = 64  # request ids remembered per conversation, to drop a request delivered twice

cfg = ConversationSettings()
app = make_app("conversation")
ledger = Ledger("conversation")
history_table = table(app, CONVERSATIONS, "history")
inbox = app.topic(
    CHAT_REQUESTS.name,
    CONVERSATION_TURNS.name,
    key_type=bytes,
    value_type=bytes,
    key_serializer="raw",
    value_serializer="raw",
)
tokens_in = topic(app, TOKENS)
results_in = topic(app, TOOL_RESULTS)
prepared_out = topic(app, PREPARED)
turns_out = topic(app, CONVERSATION_TURNS)
tokens_out = topic(app, TOKENS)
dead_letters = topic(app, DEAD_LETTER)
transcripts_out = topic(app, TRANSCRIPTS)
# rows with parked turns on this member -> (deadline of the oldest, that turn); the timer's work list
parked_due: dict[bytes, tuple[float, ChatRequest]] = {}


def _counter(model: str, output: OutputSpec):
    name = cfg.tokenizer_by_model.get(model, model)
    try:
        return prompt_counter(load_tokenizer(name), output)
    except ValueError:
        return prompt_counter(load_tokenizer("smollm2"), output)


def warm_up() -> None:
    """Load the tokenizers before consuming (see processors.faust_app.run for why)."""
    for model in {"smollm2", *settings().models, *cfg.tokenizer_by_model}:
        _counter(model, OutputSpec())([ChatMessage(role="user", content="warm-up")])


async def _refuse(request: ChatRequest, reason: str, trace, code: str) -> None:
    """End a request that cannot be prepared, on the tokens partition its client listens to."""
    await send(
        tokens_out,
        TOKENS,
        Completion(
            request_id=request.request_id,
            conversation_id=request.conversation_id,
            tenant=request.tenant,
            seq=0,
            finish_reason="error",
            error=reason,
            error_code=code,
        ),
        key=request.request_id,
        partition=request.reply_partition,
        trace=trace,
    )


async def _prepare(request: ChatRequest, state: ConversationHistory, trace) -> bool:
    """Emit the inference request for `request`; False when it was refused instead."""
    kept = [] if request.full_history else state.messages
    messages, model, sampling = merge(kept, request.messages), request.model, request.sampling
    if request.assistant:
        preset = presets().get(request.assistant)
        if preset is None:
            await _refuse(
                request, f"unknown assistant preset {request.assistant!r}", trace, "preset_not_found"
            )
            return False
        messages, model, sampling = apply_preset(preset, messages, model, sampling)
    unmatched = unmatched_tool_message(messages)
    if unmatched is not None:
        await _refuse(
            request,
            f"tool message answers {unmatched!r}, a call no earlier assistant message made",
            trace,
            "invalid_tool_message",
        )
        return False
    window = cfg.window_for(model)
    if sampling.max_tokens > window:
        await _refuse(
            request,
            f"max_tokens {sampling.max_tokens} exceeds the model's context of {window} tokens",
            trace,
            "context_length_exceeded",
        )
        return False
    try:
        prompt, dropped = trim(
            messages,
            _counter(model, request.output),
            prompt_budget(window, sampling.max_tokens),
            request.output,
        )
    except PromptTooLong as exc:
        await _refuse(request, f"{exc} (context window {window} tokens)", trace, "context_length_exceeded")
        return False
    spec = request.run or (state.run.spec if state.run is not None else None)
    if dropped and spec is not None and spec.truncation == "disabled":
        await _refuse(
            request,
            f"the conversation takes more than the context window ({window} tokens, the answer's "
            f"room included) and truncation is disabled",
            trace,
            "context_length_exceeded",
        )
        return False
    state.messages = bounded(messages, cfg.max_history_messages)
    state.pending_request_id, state.pending_since = request.request_id, time.time()
    if request.run is not None:
        state.run = runs.start(request)
    prepared = InferenceRequest(
        request_id=request.request_id,
        conversation_id=request.conversation_id,
        tenant=request.tenant,
        model=model,
        messages=prompt,
        sampling=sampling,
        output=request.output,
        reply_partition=request.reply_partition,
        dropped_messages=dropped,
        admitted_at=request.created_at,
        screening=request.screening,
        tier=request.tier,
        priority=request.priority,
        cache_key=request.cache_key,
    )
    # after a restart the request may have been emitted already: then only the table row is rebuilt
    await ledger.once(
        "prepared",
        request.request_id,
        lambda: send(prepared_out, PREPARED, prepared, key=request.request_id, trace=trace),
    )
    return True


async def _on_request(request: ChatRequest, state: ConversationHistory, trace) -> None:
    if request.cached_from:
        return  # answered from the gateway's cache; on the log for the audit only
    if request.request_id in state.seen_request_ids:
        return  # delivered twice upstream: already prepared
    state.seen_request_ids = [*state.seen_request_ids[-(SEEN_KEPT - 1) :], request.request_id]
    if state.parked and not _busy(state):  # given up on that answer: the turns waiting for it end first
        await _give_up(state, trace)
    if _busy(state) and not (request.full_history or carries_full_history(request.messages)):
        state.parked.append(request)  # its history needs the answer (or the run) still being generated
        return
    state.run = None  # a run that stopped waiting long ago is abandoned
    await _prepare(request, state, trace)


def _waiting(state: ConversationHistory) -> bool:
    return bool(state.pending_request_id) and time.time() - state.pending_since < cfg.pending_timeout_s


def _busy(state: ConversationHistory) -> bool:
    """A new turn must wait: the previous answer, or a response run's tools, are still to come."""
    return _waiting(state) or runs.busy(state, cfg.pending_timeout_s)


def _overdue(request: ChatRequest, now: float) -> bool:
    return now - request.created_at >= cfg.parked_timeout_s


async def _on_deadline(state: ConversationHistory, trace) -> None:
    """A parked turn's deadline passed (the timer's word; checked again here): end the wait."""
    now = time.time()
    if any(_overdue(r, now) for r in state.parked) or (state.parked and not _busy(state)):
        await _give_up(state, trace)


async def _give_up(state: ConversationHistory, trace) -> None:
    """Stop waiting for the pending answer and refuse every turn parked for it.

    Its unanswered question leaves the history, so the model never sees a turn without its
    reply, and the client's next try (the refused turn sent again) is prepared at once. Should
    the answer come after all, it is recorded for the audit but no longer joins the history.
    """
    lost, now = state.pending_request_id, time.time()
    if lost:
        state.messages = without_unanswered(state.messages)
        state.pending_request_id = None
    for request in state.parked:
        why = (
            f"The previous turn of this conversation (request {lost}) got no answer within "
            f"{cfg.parked_timeout_s:.0f}s, so this turn, which needs that answer, was not started "
            f"(it waited {now - request.created_at:.0f}s). The unanswered turn was dropped from the "
            "conversation: send this message again, or the whole conversation in `messages`."
        )
        await ledger.once(
            "refused",
            request.request_id,
            lambda r=request, why=why: _refuse(r, why, trace, "previous_turn_unanswered"),
        )
    log.warning(
        "conversation %s: gave up waiting for the answer to %s; refused %d parked turn(s)",
        state.conversation_id,
        lost,
        len(state.parked),
    )
    state.parked = []


async def _on_answer(done: Completion, state: ConversationHistory, trace) -> None:
    await _record(done, state, trace)
    if done.request_id != state.pending_request_id:
        return  # an answer to a request this history no longer waits for
    state.messages = with_answer(state.messages, done)
    state.pending_request_id = None
    if state.run is not None and done.request_id == runs.current_step(state.run):
        state.run = runs.on_answer(state.run, done)
        if state.run is not None:
            await _advance(state, trace)
    while state.parked and state.pending_request_id is None and state.run is None:
        await _prepare(state.parked.pop(0), state, trace)


async def _on_result(result: ToolResult, state: ConversationHistory, trace) -> None:
    if state.run is not None and runs.on_result(state.run, result):
        await _advance(state, trace)


async def _advance(state: ConversationHistory, trace) -> None:
    """Once every server call of the run's step has its result: each result in band to the client
    (in call order, once per call id), the tool messages into the history, the next step prepared."""
    run = state.run
    results = runs.ready(run)
    if results is None:
        return
    for result in results:
        await ledger.once(
            "run-result",
            result.call_id,
            lambda r=result: send(
                tokens_out, TOKENS, r, key=r.request_id, partition=run.reply_partition, trace=trace
            ),
        )
    state.messages = [*state.messages, *(runs.tool_message(r) for r in results)]
    step = runs.next_step(run, results)
    if not await _prepare(step, state, trace):
        state.run = None


async def _record(done: Completion, state: ConversationHistory, trace) -> None:
    """The request's final record for auditors: the turn it added and its whole answer, once."""
    question: list[ChatMessage] = []
    if done.request_id == state.pending_request_id:
        for message in reversed(state.messages):
            if message.role == "assistant":
                break
            if message.role != "system":
                question.insert(0, message)
    record = Transcript(
        request_id=done.request_id,
        conversation_id=done.conversation_id,
        tenant=done.tenant,
        question=question,
        answer=done,
    )
    await ledger.once(
        "transcript",
        done.request_id,
        lambda: send(transcripts_out, TRANSCRIPTS, record, key=done.conversation_id, trace=trace),
    )


@app.agent(inbox)
async def conversations(stream):
    specs = {CHAT_REQUESTS.name: CHAT_REQUESTS, CONVERSATION_TURNS.name: CONVERSATION_TURNS}
    async for event, raw in typed(stream, specs, dead_letters):
        key = conversation_key(event.tenant, event.conversation_id or event.request_id)
        state = await sealing.unblocked(get, history_table, key, ConversationHistory)
        if state is None:
            if isinstance(event, TurnDeadline):
                continue  # nothing waits there
            state = ConversationHistory(request_id=event.request_id, conversation_id=key, tenant=event.tenant)
        if isinstance(event, ChatRequest):
            with traced(raw, f"prepare {event.model}", tracing.request_attributes(event)) as span:
                await _on_request(event, state, span.trace)
        elif isinstance(event, ToolResult):
            with traced(
                raw,
                f"record tool result {event.name}",
                {"tokenstream.request_id": event.request_id, "gen_ai.tool.call.id": event.call_id},
            ) as span:
                await _on_result(event, state, span.trace)
        elif isinstance(event, TurnDeadline):
            with traced(raw, "turn deadline", {"tokenstream.request_id": event.request_id}) as span:
                await _on_deadline(state, span.trace)
        else:
            with traced(raw, "record answer", tracing.completion_attributes(event)) as span:
                await _on_answer(event, state, span.trace)
        state.request_id = event.request_id
        await sealing.unblocked(put, history_table, key, state)
        _index(key.encode(), state)


def _index(row: bytes, state: ConversationHistory) -> None:
    if state.parked:
        oldest = min(state.parked, key=lambda r: r.created_at)
        parked_due[row] = (oldest.created_at + cfg.parked_timeout_s, oldest)
    else:
        parked_due.pop(row, None)


@history_table.on_recover
async def index_parked() -> None:
    """After a rebalance's table recovery: find the rows with parked turns (ours or not: a marker
    for a row another member owns is handled there)."""
    parked_due.clear()
    for row, raw in list(history_table.items()):
        if raw and b'"parked":[{' in raw:  # a cheap filter; JSON strings cannot hold this unescaped
            _index(row, await sealing.unblocked(decode, raw, ConversationHistory))


@app.timer(interval=1.0)
async def wake_overdue_turns() -> None:
    """Tell the history agent, in the conversation's order, about each parked turn past its deadline."""
    now = time.time()
    for row, (due, turn) in list(parked_due.items()):
        if due <= now and parked_due.get(row, (None,))[0] == due:
            del parked_due[row]  # the agent indexes the row again when a turn still waits
            await send(
                turns_out,
                CONVERSATION_TURNS,
                TurnDeadline(
                    request_id=turn.request_id, conversation_id=turn.conversation_id, tenant=turn.tenant
                ),
                key=row.decode(),
            )


@app.agent(tokens_in)
async def answers(stream):
    """Completions, re-keyed by conversation so the history agent sees them in its partition (every
    other record on ts.tokens, token chunks above all, is passed over unopened)."""
    async for event, raw in typed(stream, {TOKENS.name: TOKENS}, dead_letters, wants=(Completion,)):
        if event.conversation_id:
            with traced(raw, "rekey answer", {"tokenstream.request_id": event.request_id}) as span:
                await send(
                    turns_out,
                    CONVERSATION_TURNS,
                    event,
                    key=conversation_key(event.tenant, event.conversation_id),
                    trace=span.trace,
                )


@app.agent(results_in)
async def results(stream):
    """Tool results, re-keyed by conversation so a response run goes on in its conversation's partition."""
    async for event, raw in typed(stream, {TOOL_RESULTS.name: TOOL_RESULTS}, dead_letters):
        if event.conversation_id:
            with traced(raw, "rekey tool result", {"tokenstream.request_id": event.request_id}) as span:
                await send(
                    turns_out,
                    CONVERSATION_TURNS,
                    event,
                    key=conversation_key(event.tenant, event.conversation_id),
                    trace=span.trace,
                )
