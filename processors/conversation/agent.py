"""The conversation processor: ts.chat.requests (+ finished answers) -> ts.requests.prepared.

One agent reads both the chat requests and the answers re-keyed by conversation (the table row
and both topics' keys are `schemas.keys.conversation_key(tenant, conversation_id)`, so one
tenant's conversation id never reaches another tenant's history), so every
event of a conversation is handled on the same partition, in order, against the same
table row. A second agent re-keys completions from ts.tokens to ts.conversation.turns.
"""

from __future__ import annotations

import logging
import time

from processors.conversation.config import ConversationSettings
from processors.conversation.history import (
    bounded,
    carries_full_history,
    merge,
    unmatched_tool_message,
    with_answer,
)
from processors.conversation.presets import apply_preset, presets
from processors.conversation.window import PromptTooLong, prompt_counter, trim
from processors.effects import Ledger
from processors.faust_app import get, make_app, put, send, table, topic, trace_of, typed
from schemas import (
    ChatMessage,
    ChatRequest,
    Completion,
    ConversationHistory,
    InferenceRequest,
    OutputSpec,
    Transcript,
)
from schemas.keys import conversation_key
from tokenstream.config import settings
from tokenstream.models import load_tokenizer, prompt_budget
from topics import CHAT_REQUESTS, CONVERSATION_TURNS, CONVERSATIONS, DEAD_LETTER, PREPARED, TOKENS, TRANSCRIPTS

log = logging.getLogger(__name__)
SEEN_KEPT = 64  # request ids remembered per conversation, to drop a request delivered twice

cfg = ConversationSettings()
app = make_app("conversation")
ledger = Ledger("conversation")
history_table = table(app, CONVERSATIONS, "history")
inbox = app.topic(CHAT_REQUESTS.name, CONVERSATION_TURNS.name, key_type=bytes, value_type=bytes,
                  key_serializer="raw", value_serializer="raw")
tokens_in = topic(app, TOKENS)
prepared_out = topic(app, PREPARED)
turns_out = topic(app, CONVERSATION_TURNS)
tokens_out = topic(app, TOKENS)
dead_letters = topic(app, DEAD_LETTER)
transcripts_out = topic(app, TRANSCRIPTS)


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
    await send(tokens_out, TOKENS, Completion(
        request_id=request.request_id, conversation_id=request.conversation_id, tenant=request.tenant,
        seq=0, finish_reason="error", error=reason, error_code=code), key=request.request_id,
        partition=request.reply_partition, trace=trace)


async def _prepare(request: ChatRequest, state: ConversationHistory, trace) -> bool:
    """Emit the inference request for `request`; False when it was refused instead."""
    messages, model, sampling = merge(state.messages, request.messages), request.model, request.sampling
    if request.assistant:
        preset = presets().get(request.assistant)
        if preset is None:
            await _refuse(request, f"unknown assistant preset {request.assistant!r}", trace, "preset_not_found")
            return False
        messages, model, sampling = apply_preset(preset, messages, model, sampling)
    unmatched = unmatched_tool_message(messages)
    if unmatched is not None:
        await _refuse(request, f"tool message answers {unmatched!r}, a call no earlier assistant message made",
                      trace, "invalid_tool_message")
        return False
    window = cfg.window_for(model)
    if sampling.max_tokens > window:
        await _refuse(request, f"max_tokens {sampling.max_tokens} exceeds the model's context of {window} tokens",
                      trace, "context_length_exceeded")
        return False
    try:
        prompt, dropped = trim(messages, _counter(model, request.output), prompt_budget(window, sampling.max_tokens))
    except PromptTooLong as exc:
        await _refuse(request, f"{exc} (context window {window} tokens)", trace, "context_length_exceeded")
        return False
    state.messages = bounded(messages, cfg.max_history_messages)
    state.pending_request_id, state.pending_since = request.request_id, time.time()
    prepared = InferenceRequest(
        request_id=request.request_id, conversation_id=request.conversation_id, tenant=request.tenant,
        model=model, messages=prompt, sampling=sampling, output=request.output,
        reply_partition=request.reply_partition, dropped_messages=dropped, admitted_at=request.created_at,
        screening=request.screening, tier=request.tier, priority=request.priority)
    # after a restart the request may have been emitted already: then only the table row is rebuilt
    await ledger.once("prepared", request.request_id,
                      lambda: send(prepared_out, PREPARED, prepared, key=request.request_id, trace=trace))
    return True


async def _on_request(request: ChatRequest, state: ConversationHistory, trace) -> None:
    if request.cached_from:
        return  # answered from the gateway's cache; on the log for the audit only
    if request.request_id in state.seen_request_ids:
        return  # delivered twice upstream: already prepared
    state.seen_request_ids = [*state.seen_request_ids[-(SEEN_KEPT - 1):], request.request_id]
    waiting = state.pending_request_id and time.time() - state.pending_since < cfg.pending_timeout_s
    if waiting and not carries_full_history(request.messages):
        state.parked.append(request)  # its history needs the answer still being generated
        return
    await _prepare(request, state, trace)


async def _on_answer(done: Completion, state: ConversationHistory, trace) -> None:
    await _record(done, state, trace)
    if done.request_id != state.pending_request_id:
        return  # an answer to a request this history no longer waits for
    state.messages = with_answer(state.messages, done)
    state.pending_request_id = None
    while state.parked and state.pending_request_id is None:
        await _prepare(state.parked.pop(0), state, trace)


async def _record(done: Completion, state: ConversationHistory, trace) -> None:
    """The request's final record for auditors: the turn it added and its whole answer, once."""
    question: list[ChatMessage] = []
    if done.request_id == state.pending_request_id:
        for message in reversed(state.messages):
            if message.role == "assistant":
                break
            if message.role != "system":
                question.insert(0, message)
    record = Transcript(request_id=done.request_id, conversation_id=done.conversation_id, tenant=done.tenant,
                        question=question, answer=done)
    await ledger.once("transcript", done.request_id,
                      lambda: send(transcripts_out, TRANSCRIPTS, record, key=done.conversation_id, trace=trace))


@app.agent(inbox)
async def conversations(stream):
    specs = {CHAT_REQUESTS.name: CHAT_REQUESTS, CONVERSATION_TURNS.name: CONVERSATION_TURNS}
    async for event, raw in typed(stream, specs, dead_letters):
        key = conversation_key(event.tenant, event.conversation_id or event.request_id)
        state = get(history_table, key, ConversationHistory) or ConversationHistory(
            request_id=event.request_id, conversation_id=key, tenant=event.tenant)
        if isinstance(event, ChatRequest):
            await _on_request(event, state, trace_of(raw))
        else:
            await _on_answer(event, state, trace_of(raw))
        state.request_id = event.request_id
        put(history_table, key, state)


@app.agent(tokens_in)
async def answers(stream):
    """Completions, re-keyed by conversation so the history agent sees them in its partition."""
    async for event, raw in typed(stream, {TOKENS.name: TOKENS}, dead_letters):
        if isinstance(event, Completion) and event.conversation_id:
            await send(turns_out, CONVERSATION_TURNS, event, key=conversation_key(event.tenant, event.conversation_id),
                       trace=trace_of(raw))
