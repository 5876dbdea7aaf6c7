"""The state the conversation processor keeps per conversation (in a changelog-backed table)."""

from __future__ import annotations

from typing import ClassVar

import msgspec

from schemas.base import Event
from schemas.requests import ChatMessage, ChatRequest, SamplingParams, Screening
from schemas.runs import RunSpec
from schemas.structured import OutputSpec
from schemas.tools import ToolResult


class RunState(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A run in progress, kept in the conversation's table row (ConversationHistory.run).

    `calls` are the server calls of the current step once its Completion arrived (None before);
    `results` the results that arrived (in any order, before or after it), by call id.
    `written` the completion tokens of the steps answered so far.
    `asked` holds a digest of each server call of the current step (name and arguments, by call id);
    `made` a digest of every call the run has made with its outcome (processors.conversation.runs:
    a step that repeats one of them to the same outcome is going in circles, and the next must answer).
    """

    run_id: str
    step: int = 0
    spec: RunSpec
    model: str
    sampling: SamplingParams
    output: OutputSpec
    assistant: str | None = None
    reply_partition: int = 0
    screening: Screening = "serial"
    tier: str = ""
    priority: int = 0
    cache_key: str = ""  # ChatRequest.cache_key, for every step
    admitted_at: float = 0.0
    calls: list[str] | None = None
    results: dict[str, ToolResult] = msgspec.field(default_factory=dict)
    since: float = 0.0
    written: int = 0  # tokens the answers of the steps so far wrote (RunSpec.max_output_tokens)
    asked: dict[str, str] = msgspec.field(default_factory=dict)
    made: list[str] = msgspec.field(default_factory=list)


class ConversationHistory(Event, tag="conversation_history"):
    """Every turn of one conversation so far; request_id is the last request that changed it.

    pending_request_id is a request whose answer has not been appended yet; a request that
    arrives meanwhile carrying only its new message waits in `parked` until that answer
    lands (or, during a run, until the run ends), so the model never sees a history with a
    missing reply.
    """

    content: ClassVar[frozenset[str]] = frozenset(
        {"messages", "parked", "run"}
    )  # sealed (schemas/sealing.py)

    messages: list[ChatMessage] = msgspec.field(default_factory=list)
    pending_request_id: str | None = None
    pending_since: float = 0.0
    parked: list[ChatRequest] = msgspec.field(default_factory=list)
    seen_request_ids: list[str] = msgspec.field(default_factory=list)
    run: RunState | None = None  # a response run waiting for its tools' results (schemas/runs.py)


class TurnDeadline(Event, tag="turn_deadline"):
    """A parked turn has waited its deadline for the previous answer (TOKENSTREAM_CONVERSATION_
    PARKED_TIMEOUT_S since its admission).

    The conversation processor's timer writes it to ts.conversation.turns, keyed by the
    conversation like the turn itself, so the history agent reads it in the conversation's
    order: request_id is the parked turn. The agent then gives up the answer that never came
    and refuses every parked turn with a clear error (a deadline passed is checked again there,
    so a late or repeated marker changes nothing).
    """
