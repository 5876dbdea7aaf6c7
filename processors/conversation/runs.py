"""Response runs (schemas/runs.py) in the conversation processor: pure steps on the table row.

The history agent calls these with the conversation's row; every decision is a function of the
row and the event, so a processor that re-reads events after a restart reaches the same state
(events of steps already left behind are ignored), and what it emits is done once per id
(processors.effects.Ledger: the prepared step by its request id, an in-band result by its call id).
"""

from __future__ import annotations

import hashlib
import json
import time

import msgspec

from schemas import (
    ChatMessage,
    ChatRequest,
    Completion,
    ConversationHistory,
    RunState,
    SamplingParams,
    ToolResult,
)
from schemas.ids import step_request_id
from schemas.runs import TOOL_MESSAGE_CHARS
from schemas.tools import notebook_logs


def start(request: ChatRequest) -> RunState:
    """The run a ChatRequest with `run` starts (at step 0, its own request id)."""
    assert request.run is not None
    return RunState(
        run_id=request.request_id,
        spec=request.run,
        model=request.model,
        sampling=request.sampling,
        output=request.output,
        assistant=request.assistant,
        reply_partition=request.reply_partition,
        screening=request.screening,
        tier=request.tier,
        priority=request.priority,
        cache_key=request.cache_key,
        admitted_at=request.created_at,
        since=time.time(),
    )


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
    run.asked = {c.id: _digest(c.function.name, _canonical(c.function.arguments)) for c in done.tool_calls}
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
    """What the model reads of a result, cut to TOOL_MESSAGE_CHARS: a code run as a notebook shows it
    (a small model quotes a number it reads as text, not one inside a JSON object), another tool's
    output, or why it failed."""
    if result.name == "code_interpreter":
        text = notebook_logs(result) or "(the code ran and printed nothing)"
        files = _written(result.output)
        if files:
            text += ("" if text.endswith("\n") else "\n") + "files written: " + ", ".join(files)
    else:
        text = result.output if result.ok else json.dumps({"error": result.error or "the tool failed"})
    if len(text) > TOOL_MESSAGE_CHARS:
        text = text[:TOOL_MESSAGE_CHARS] + " ...[cut]"
    return ChatMessage(role="tool", tool_call_id=result.call_id, name=result.name, content=text)


def next_step(run: RunState, results: list[ToolResult]) -> ChatRequest:
    """Advance `run` past the step whose `results` are in, and return the next step's request (its
    history is in the row). A step that repeated a call of the run and got the same outcome again
    (the same code failing the same way, or printing the same number) learnt nothing new: a model
    that does so is going in circles, so the next step must answer in text instead of calling again."""
    outcomes = [
        _digest(run.asked.get(r.call_id, r.call_id), str(r.ok), r.output, r.error or "") for r in results
    ]
    circling = any(o in run.made for o in outcomes)
    run.made = [*run.made, *outcomes]
    output = run.spec.output_for(run.step + 1, run.output)
    if circling:
        output = msgspec.structs.replace(output, tool_choice="none", tool_name=None, allowed=[])
    run.step += 1
    run.calls, run.results, run.asked, run.since = None, {}, {}, time.time()
    return ChatRequest(
        request_id=current_step(run),
        conversation_id=results[0].conversation_id,
        tenant=results[0].tenant,
        model=run.model,
        messages=[],
        sampling=_within_budget(run),
        output=output,
        assistant=run.assistant,
        reply_partition=run.reply_partition,
        screening=run.screening,
        tier=run.tier,
        priority=run.priority,
        cache_key=run.cache_key,
    )


def _written(output: str) -> list[str]:
    try:
        files = json.loads(output or "{}").get("files") or []
    except (ValueError, AttributeError):
        return []
    return [str(f.get("path")) for f in files if isinstance(f, dict)]


def _canonical(arguments: str) -> str:
    """Arguments as compact, key-sorted JSON, so spacing and key order do not make a call new."""
    try:
        return json.dumps(json.loads(arguments or "{}"), sort_keys=True, separators=(",", ":"))
    except ValueError:
        return arguments


def _digest(*parts: str) -> str:
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:16]


def _within_budget(run: RunState) -> SamplingParams:
    """The run's sampling, its max_tokens cut to what the response's max_output_tokens leaves."""
    left = run.spec.tokens_left(run.written)
    if left is None or left >= run.sampling.max_tokens:
        return run.sampling
    return msgspec.structs.replace(run.sampling, max_tokens=left)
