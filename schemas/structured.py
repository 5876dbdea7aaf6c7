"""Function calling and structured output: the tools a request offers, what it forces, and the calls made.

`OutputSpec` travels with a request (ChatRequest -> InferenceRequest); its defaults mean "plain
text, no tools", so events written before these fields existed decode unchanged. The worker turns
it into a grammar (gpu_workers/grammar.py). Generated calls reach the client as `ToolCallDelta`s
inside TokenChunks (the OpenAI stream shape) and are recorded whole in the Completion and as
ToolCall events on the tool-calls topic.
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

import msgspec

ToolChoice = Literal["none", "auto", "required", "function"]
ResponseFormat = Literal["text", "json_object", "json_schema"]


class FunctionSpec(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None  # a JSON schema; None: the function takes no arguments
    strict: bool = False


class ToolSpec(msgspec.Struct, kw_only=True, omit_defaults=True):
    type: Literal["function"] = "function"
    function: FunctionSpec


class OutputSpec(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What the answer may or must be.

    tool_choice "function" forces the tool named `tool_name`; `allowed` (allowed_tools) narrows the
    tools the model may call to these names (empty: all of `tools`). `json_schema` is the schema of
    a `json_schema` response format (json_object uses {"type": "object"}).
    """

    tools: list[ToolSpec] = msgspec.field(default_factory=list)
    tool_choice: ToolChoice = "auto"
    tool_name: str | None = None
    allowed: list[str] = msgspec.field(default_factory=list)
    parallel_tool_calls: bool = True
    response_format: ResponseFormat = "text"
    json_schema: dict[str, Any] | None = None
    schema_name: str | None = None
    # the client asked for the answer's moderation results (a response's `moderation`): the safety
    # processor writes its input verdict and, after the Completion, a verdict over the whole answer in band
    moderated: bool = False

    @property
    def callable_tools(self) -> list[ToolSpec]:
        """The tools the model may call now (none when tool_choice is none)."""
        if self.tool_choice == "none":
            return []
        if self.tool_choice == "function":
            return [t for t in self.tools if t.function.name == self.tool_name]
        if self.allowed:
            return [t for t in self.tools if t.function.name in self.allowed]
        return list(self.tools)

    @property
    def constrained(self) -> bool:
        return bool(self.tools) or self.response_format != "text"


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str = "{}"  # a JSON object as text (OpenAI style)


class MessageToolCall(msgspec.Struct, kw_only=True):
    """One call in an assistant message (history) or a Completion."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolCallDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A piece of a call being streamed: the first carries id and name, later ones argument text."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


def call_id(request_id: str, index: int) -> str:
    """Deterministic: a worker that takes a request over names its calls exactly as the first did."""
    return "call_" + hashlib.sha256(f"{request_id}:{index}".encode()).hexdigest()[:24]


def schema_key(value: Any) -> str:
    """A stable hash of a JSON value (the grammar cache key)."""
    return hashlib.sha256(msgspec.json.encode(value, order="sorted")).hexdigest()
