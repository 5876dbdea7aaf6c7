"""The function-calling and structured-output fields of a chat request: their shapes, their checks,
and the OutputSpec the pipeline carries.

Shapes follow OpenAI's API; anything unknown inside them is a 400 (extra="forbid"). Schemas are
checked against the JSON Schema meta-schema (jsonschema) here; whether a valid schema also
compiles to a grammar within the worker's limits is the worker's answer (an error completion).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas import FunctionSpec, OutputSpec, ToolSpec

MAX_TOOLS = 128
MAX_SCHEMA_BYTES = 64 * 1024
NAME = r"^[A-Za-z0-9_-]{1,64}$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionDef(_Strict):
    name: str = Field(pattern=NAME)
    description: str | None = Field(None, max_length=4096)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str = Field(min_length=1)


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class AllowedTools(_Strict):
    mode: Literal["auto", "required"]
    tools: list[NamedToolChoice] = Field(min_length=1)


class AllowedToolsChoice(_Strict):
    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice | AllowedToolsChoice


class JSONSchemaFormat(_Strict):
    name: str = Field(pattern=NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class CalledFunction(_Strict):
    name: str = Field(pattern=NAME)
    arguments: str = Field(max_length=MAX_SCHEMA_BYTES)


class CallInHistory(_Strict):
    index: int | None = None  # sent back by clients that assembled the call from stream deltas
    id: str = Field(min_length=1, max_length=200)
    type: Literal["function"]
    function: CalledFunction


class BadField(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_schema(schema: dict[str, Any], param: str) -> None:
    """A 400 unless `schema` is a valid JSON Schema of bounded size."""
    import jsonschema

    if len(json.dumps(schema)) > MAX_SCHEMA_BYTES:
        raise BadField(f"schema is larger than {MAX_SCHEMA_BYTES} bytes", param)
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(
            schema
        )
    except jsonschema.SchemaError as exc:
        raise BadField(f"Invalid schema: {exc.message}", param) from None


def output_spec(
    tools: list[Tool] | None,
    choice: ToolChoice | None,
    parallel: bool | None,
    response_format: ResponseFormat | None,
) -> OutputSpec:
    """The checked OutputSpec of a request, or BadField (a 400 naming the field)."""
    tools = tools or []
    if len(tools) > MAX_TOOLS:
        raise BadField(f"at most {MAX_TOOLS} tools", "tools")
    names: set[str] = set()
    specs = []
    for i, tool in enumerate(tools):
        fn = tool.function
        if fn.name in names:
            raise BadField(f"duplicate tool name {fn.name!r}", f"tools[{i}].function.name")
        names.add(fn.name)
        if fn.parameters is not None:
            check_schema(fn.parameters, f"tools[{i}].function.parameters")
            if fn.parameters.get("type", "object") != "object":
                raise BadField(
                    "function parameters must be a JSON schema of type object",
                    f"tools[{i}].function.parameters",
                )
        specs.append(
            ToolSpec(
                function=FunctionSpec(
                    name=fn.name,
                    description=fn.description or "",
                    parameters=fn.parameters,
                    strict=bool(fn.strict),
                )
            )
        )
    spec = OutputSpec(tools=specs, parallel_tool_calls=True if parallel is None else parallel)
    if choice is None:
        spec.tool_choice = "auto" if tools else "none"
    elif not tools and choice != "none":
        raise BadField("tool_choice is only allowed when tools are specified", "tool_choice")
    elif isinstance(choice, str):
        spec.tool_choice = choice
    elif isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise BadField(
                f"tool_choice names {choice.function.name!r}, which is not in tools", "tool_choice"
            )
        spec.tool_choice, spec.tool_name = "function", choice.function.name
    else:
        allowed = [t.function.name for t in choice.allowed_tools.tools]
        unknown = [n for n in allowed if n not in names]
        if unknown:
            raise BadField(f"allowed_tools names {unknown[0]!r}, which is not in tools", "tool_choice")
        spec.tool_choice, spec.allowed = choice.allowed_tools.mode, allowed
    if response_format is not None and response_format.type != "text":
        spec.response_format = response_format.type
        if response_format.type == "json_schema":
            fmt = response_format.json_schema
            if fmt is None or fmt.schema_ is None:
                raise BadField("response_format json_schema needs json_schema.schema", "response_format")
            check_schema(fmt.schema_, "response_format.json_schema.schema")
            spec.json_schema, spec.schema_name = fmt.schema_, fmt.name
        elif response_format.json_schema is not None:
            raise BadField("json_schema is only allowed with type json_schema", "response_format")
    return spec


def check_tool_messages(messages: list, continued: bool) -> None:
    """Every `tool` message answers a call an earlier assistant message made (in this request;
    with a conversation_id the calls may be in the stored history, which the conversation
    processor checks)."""
    made: set[str] = set()
    for i, msg in enumerate(messages):
        for call in msg.tool_calls or []:
            made.add(call.id)
        if msg.role == "tool":
            if not msg.tool_call_id:
                raise BadField("a tool message needs tool_call_id", f"messages[{i}].tool_call_id")
            if msg.tool_call_id not in made and not continued:
                raise BadField(
                    f"tool message answers {msg.tool_call_id!r}, a call no earlier assistant message made",
                    f"messages[{i}].tool_call_id",
                )
        elif msg.tool_calls and msg.role != "assistant":
            raise BadField("only assistant messages carry tool_calls", f"messages[{i}].tool_calls")
