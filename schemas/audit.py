"""The final record of a request, kept for audits long after its tokens have expired."""

from __future__ import annotations

from typing import ClassVar

import msgspec

from schemas.base import Event
from schemas.requests import ChatMessage
from schemas.tokens import Completion


class Transcript(Event, tag="transcript", kw_only=True):
    """One answered request: the turn the user added and the Completion that answered it.

    Keyed by conversation_id on the transcripts topic, so a conversation's whole record lies
    in one partition. question holds the messages of the request after the previous answer
    (empty when the answer came after its history had moved on); answer is the Completion as
    the worker (or the processor that refused the request) wrote it, whole text included.
    """

    content: ClassVar[frozenset[str]] = frozenset({"question", "answer"})  # sealed (schemas/sealing.py)

    question: list[ChatMessage] = msgspec.field(default_factory=list)
    answer: Completion
