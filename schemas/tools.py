"""Tool use: the model asks, the tool processor answers."""

from __future__ import annotations

from typing import ClassVar

import msgspec

from schemas.base import Event


class ToolCall(Event, tag="tool_call"):
    """A model's request to run a tool; arguments is a JSON object as text (OpenAI style)."""

    content: ClassVar[frozenset[str]] = frozenset({"arguments"})  # sealed (schemas/sealing.py)

    call_id: str
    name: str
    arguments: str = "{}"


class ToolResult(Event, tag="tool_result"):
    """Outcome of one ToolCall. ok is False when the tool failed or was stopped."""

    content: ClassVar[frozenset[str]] = frozenset({"output", "error", "meta"})  # sealed (schemas/sealing.py)

    call_id: str
    name: str
    ok: bool
    output: str = ""
    error: str | None = None
    duration_s: float = 0.0
    meta: dict[str, str] = msgspec.field(default_factory=dict)
