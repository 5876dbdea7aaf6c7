"""Tool use: the model asks, the tool processor answers."""

from __future__ import annotations

import json
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


def notebook_logs(result: ToolResult) -> str:
    """A code_interpreter run as a notebook shows it: what the code printed (stdout, stderr), then its
    last expression's value (`2**100` alone shows the number), then why it failed where the code's
    own traceback does not already say so (a limit, a timeout). The client's `logs` and what the model
    reads of the run are both this."""
    try:
        output = json.loads(result.output or "{}")
    except ValueError:
        output = {}
    if not isinstance(output, dict):
        output = {}
    logs = str(output.get("stdout") or "") + str(output.get("stderr") or "")
    value, error = output.get("value"), result.error
    for line in (value, None if error and error in logs else error):
        if line:
            logs += ("" if not logs or logs.endswith("\n") else "\n") + str(line)
    return logs
