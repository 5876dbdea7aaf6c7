"""The state the conversation processor keeps per conversation (in a changelog-backed table)."""

from __future__ import annotations

import msgspec

from schemas.base import Event
from schemas.requests import ChatMessage, ChatRequest


class ConversationHistory(Event, tag="conversation_history"):
    """Every turn of one conversation so far; request_id is the last request that changed it.

    pending_request_id is a request whose answer has not been appended yet; a request that
    arrives meanwhile carrying only its new message waits in `parked` until that answer
    lands, so the model never sees a history with a missing reply.
    """

    messages: list[ChatMessage] = msgspec.field(default_factory=list)
    pending_request_id: str | None = None
    pending_since: float = 0.0
    parked: list[ChatRequest] = msgspec.field(default_factory=list)
    seen_request_ids: list[str] = msgspec.field(default_factory=list)


class TurnDeadline(Event, tag="turn_deadline"):
    """A parked turn has waited its deadline for the previous answer (TOKENSTREAM_CONVERSATION_
    PARKED_TIMEOUT_S since its admission).

    The conversation processor's timer writes it to ts.conversation.turns, keyed by the
    conversation like the turn itself, so the history agent reads it in the conversation's
    order: request_id is the parked turn. The agent then gives up the answer that never came
    and refuses every parked turn with a clear error (a deadline passed is checked again there,
    so a late or repeated marker changes nothing).
    """
