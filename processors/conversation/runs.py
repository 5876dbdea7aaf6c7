"""Response runs (schemas/runs.py) in the conversation processor: pure steps on the table row.

The history agent calls these with the conversation's row; every decision is a function of the
row and the event, so a processor that re-reads events after a restart reaches the same state
(events of steps already left behind are ignored), and what it emits is done once per id
(processors.effects.Ledger: the prepared step by its request id, an in-band result by its call id).
"""

from __future__ import annotations

import json
import time

import msgspec

from schemas import ChatMessage, ChatRequest, Completion, ConversationHistory, RunState, SamplingParams, ToolResult
from schemas.ids import step_request_id
from schemas.runs import TOOL_MESSAGE_CHARS


def start(request: ChatRequest) -> RunState:
    """The run a ChatRequest with `run` starts (at step 0, its own request id)."""
    assert request.run is not None
    return RunState(run_id=request.request_id, spec=request.run, model=request.model, sampling=request.sampling,
                    output=request.output, assistant=request.assistant, reply_partition=request.reply_partition,
                    screening=request.screening, tier=request.tier, priority=request.priority,
                    cache_key=request.cache_key,
                    admitted_at=request.created_at, since=time.time())


def busy(state: ConversationHistory, timeout_s: float) -> bool:
    """A run of this conversation still waits for tool results (a new turn must wait for it too)."""
    return state.run is not None and time.time() - state.run.since < timeout_s


def current_step(run: RunState) -> str:
    return step_request_id(run.run_id, run.step)


def on_answer(run: RunState, done: Completion) -> RunState | None:
    """After the current step's answer: the run waiting for its calls' results, or None when it ended."""
    run.written += done.usage.completion_tokens
    if not run.spec.continues(run.step, done, run.written):
        return None
    run.calls = [c.id for c in done.tool_calls]
    return run


def on_result(run: RunState, result: ToolResult) -> bool:
    """Record a result of the current step; False for one of another step, or seen already."""
    if result.request_id != current_step(run) or result.call_id in run.results:
        return False
    if run.calls is not None and result.call_id not in run.calls:
        return False
    run.results[result.call_id] = result
    return True


def ready(run: RunState) -> list[ToolResult] | None:
    """The current step's results in call order once every call has one, else None."""
    if run.calls is None or any(c not in run.results for c in run.calls):
        return None
    return [run.results[c] for c in run.calls]


def tool_message(result: ToolResult) -> ChatMessage:
    """What the model reads of a result: its output (or error), cut to TOOL_MESSAGE_CHARS."""
    text = result.output if result.ok else json.dumps({"error": result.error or "the tool failed"})
    if len(text) > TOOL_MESSAGE_CHARS:
        text = text[:TOOL_MESSAGE_CHARS] + " ...[cut]"
    return ChatMessage(role="tool", tool_call_id=result.call_id, name=result.name, content=text)


def next_step(run: RunState, conversation_id: str, tenant: str) -> ChatRequest:
    """Advance `run` to its next step and return that step's request (its history is in the row)."""
    run.step += 1
    run.calls, run.results, run.since = None, {}, time.time()
    return ChatRequest(request_id=current_step(run), conversation_id=conversation_id, tenant=tenant,
                       model=run.model, messages=[], sampling=_within_budget(run),
                       output=run.spec.output_for(run.step, run.output), assistant=run.assistant,
                       reply_partition=run.reply_partition, screening=run.screening, tier=run.tier,
                       priority=run.priority, cache_key=run.cache_key)


def _within_budget(run: RunState) -> SamplingParams:
    """The run's sampling, its max_tokens cut to what the response's max_output_tokens leaves."""
    left = run.spec.tokens_left(run.written)
    if left is None or left >= run.sampling.max_tokens:
        return run.sampling
    return msgspec.structs.replace(run.sampling, max_tokens=left)
