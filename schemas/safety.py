"""A safety classifier's judgement of a request's input or of a window of its output."""

from __future__ import annotations

from typing import ClassVar, Literal

import msgspec

from schemas.base import Event

Stage = Literal["input", "output"]

#: What a client is told when its input is blocked (the answer's only text, then content_filter).
REFUSAL = "I can't help with that request."


class SafetyVerdict(Event, tag="safety_verdict"):
    """scores maps OpenAI moderation categories (e.g. "violence", "self-harm") to [0, 1].

    For output verdicts, window_end_seq is the last token seq the window covered; a verdict over a
    whole moderated answer (OutputSpec.moderated) has the Completion's seq, and its highest scores.
    Written to ts.safety.verdicts always; also in band on the request's ts.tokens partition when it
    ends the answer (a blocked output window), and for every input verdict of a request screened
    in parallel (the gateway releases or refuses the held answer on it).
    """

    stage: Stage
    blocked: bool
    categories: list[str] = msgspec.field(default_factory=list)
    scores: dict[str, float] = msgspec.field(default_factory=dict)
    policy_version: str = ""
    window_end_seq: int = -1


class OutputWindow(Event, tag="output_window"):
    """The safety processor's view of one streaming answer (its table row, keyed by request_id).

    text is the tail of the answer still to be judged together with what comes next;
    last_seq is the last chunk folded in (a replayed chunk with seq <= last_seq is ignored);
    pending_tokens counts tokens since the last judgement.
    """

    content: ClassVar[frozenset[str]] = frozenset({"text"})  # sealed (schemas/sealing.py)

    text: str = ""
    last_seq: int = -1
    pending_tokens: int = 0
    blocked: bool = False
    peak: dict[str, float] = msgspec.field(default_factory=dict)  # each category's highest score so far
