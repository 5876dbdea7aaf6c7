"""A safety classifier's judgement of a request's input or of a window of its output."""

from __future__ import annotations

from typing import Literal

import msgspec

from schemas.base import Event

Stage = Literal["input", "output"]


class SafetyVerdict(Event, tag="safety_verdict"):
    """scores maps OpenAI moderation categories (e.g. "violence", "self-harm") to [0, 1].

    For output verdicts, window_end_seq is the last token seq the window covered.
    """

    stage: Stage
    blocked: bool
    categories: list[str] = msgspec.field(default_factory=list)
    scores: dict[str, float] = msgspec.field(default_factory=dict)
    policy_version: str = ""
    window_end_seq: int = -1
