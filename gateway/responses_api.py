"""The Responses API request (`POST /v1/responses`): its shape, its checks, and what it becomes.

What is implemented is honoured; every other field of OpenAI's request is a 400 naming it (never
accepted and ignored). Function tools share their checks with chat completions
(gateway/tool_params.py); the built-in tools become function specs the model calls through the
same grammar, and the RunSpec lists them as server tools, so the conversation processor runs the
loop (schemas/runs.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway import openai_api as api
from gateway import tool_params as tp
from gateway.compaction import summary_message, superseded, unseal
from schemas import ChatMessage, FunctionCall, MessageToolCall, OutputSpec, RunSpec

MAX_INPUT_ITEMS = 1024
MAX_TEXT = 1_000_000
#: Fields of OpenAI's request this server does not implement: sent with a value, they are a 400.
UNSUPPORTED = ("prompt", "reasoning", "prompt_cache_retention")
#: `include` values whose content every response carries anyway; `reasoning.encrypted_content` (in the
#: specification's include values) has nothing to include: the model writes no reasoning items.
INCLUDED = ("code_interpreter_call.outputs", "file_search_call.results", "reasoning.encrypted_content")

CODE_TOOL = tp.FunctionDef(
    name="code_interpreter",
    description="Run Python code in a sandbox and get its output. Files written in the working folder "
    "stay there for later calls of this conversation. Print what you want to see.",
    # The grammar holds a forced call to code that starts as Python does (a name, a number, a bracket, a
    # comment, a decorator, a string): not `{"code": ""}`, and not a string opened on `}}` that runs on
    # with prose (what SmolLM2 wrote when only one character was required, until its token limit). No
    # example in a description: the model copies it instead of the user's code.
    parameters={
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Za-z_(\\[0-9#@'-][\\s\\S]*$"}},
        "required": ["code"],
        "additionalProperties": False,
    },
)
WEB_TOOL = tp.FunctionDef(
    name="web_fetch",
    description="Fetch a web page (from the hosts the operator allows) and read its text.",
    parameters={
        "type": "object",
        "properties": {"url": {"type": "string", "minLength": 8}},
        "required": ["url"],
        "additionalProperties": False,
    },
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InputText(_Strict):
    type: Literal["input_text", "output_text"]
    text: str = Field(max_length=MAX_TEXT)
    annotations: list[Any] | None = None  # on output_text sent back: carried, not interpreted
    logprobs: list[Any] | None = None


class MediaPart(BaseModel):
    """An image or audio part: named in a 400 (the model reads text only), never dropped."""

    model_config = ConfigDict(extra="allow")
    type: Literal["input_image", "input_audio"]


class InputFile(_Strict):
    """A file the model reads as its text (gateway/input_files.py): an uploaded file's id, or the file
    itself (base64 or a data: URL) with its name. `text` is what was read of it, kept with a stored
    input so that a conversation's later turns read it too."""

    type: Literal["input_file"]
    file_id: str | None = Field(None, max_length=64)
    filename: str | None = Field(None, min_length=1, max_length=256)
    file_data: str | None = Field(None, max_length=MAX_TEXT)
    file_url: str | None = Field(None, max_length=2048)
    text: str | None = Field(None, max_length=MAX_TEXT)


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[Annotated[InputText | InputFile | MediaPart, Field(discriminator="type")]]
    id: str | None = None
    status: str | None = None
    # an assistant message's phase, as our responses label theirs: "commentary" is what the model wrote
    # before the function calls that follow it, read back as one turn with them (joins_calls)
    phase: Literal["commentary", "final_answer"] | None = None

    @model_validator(mode="after")
    def _phase(self) -> MessageItem:
        if self.phase is not None and self.role != "assistant":
            raise ValueError("phase labels assistant messages only")
        return self


def joins_calls(message: ChatMessage, commentary: bool) -> bool:
    """Whether a function call that follows `message` belongs to its turn: a turn of calls alone, or an
    assistant's commentary (the text the model wrote before those calls, in the same answer)."""
    return message.role == "assistant" and (bool(message.tool_calls) and not message.content or commentary)


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=200)
    name: str = Field(pattern=tp.NAME)
    arguments: str = Field(max_length=tp.MAX_SCHEMA_BYTES)
    id: str | None = None
    status: str | None = None


class FunctionOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=200)
    output: str = Field(max_length=MAX_TEXT)
    id: str | None = None
    status: str | None = None


class CompactionItem(_Strict):
    """What POST /v1/responses/compact made of earlier turns (gateway/compaction.py)."""

    type: Literal["compaction"]
    encrypted_content: str = Field(min_length=1, max_length=MAX_TEXT)
    id: str | None = None
    created_by: str | None = None


InputItem = MessageItem | FunctionCallItem | FunctionOutputItem | CompactionItem


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(pattern=tp.NAME)
    description: str | None = Field(None, max_length=4096)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class CodeInterpreterTool(_Strict):
    type: Literal["code_interpreter"]
    container: str | dict[str, Any] = "auto"

    @model_validator(mode="after")
    def _auto(self) -> CodeInterpreterTool:
        if self.container not in ("auto", {"type": "auto"}):
            raise ValueError('only container "auto" is supported (one working folder per conversation)')
        return self


class FileSearchTool(_Strict):
    type: Literal["file_search"]
    vector_store_ids: list[str] = Field(min_length=1, max_length=16)
    max_num_results: int = Field(5, ge=1, le=20)


class WebFetchTool(_Strict):
    """tokenstream's web tool: fetch one page from the operator's allowlist (no search engine)."""

    type: Literal["web_fetch"]


ResponseTool = Annotated[
    FunctionTool | CodeInterpreterTool | FileSearchTool | WebFetchTool, Field(discriminator="type")
]
BUILTIN_TYPES = ("code_interpreter", "file_search", "web_fetch")


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str = Field(min_length=1)


class HostedTool(_Strict):
    type: Literal["code_interpreter", "file_search", "web_fetch"]


class AllowedTools(_Strict):
    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[NamedFunction | HostedTool] = Field(min_length=1)


ResponseToolChoice = Literal["none", "auto", "required"] | NamedFunction | HostedTool | AllowedTools


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=tp.NAME)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None


class StreamOptions(_Strict):
    include_obfuscation: Literal[False] | None = Field(None, description="padding is never added here")


class ContextManagement(_Strict):
    """Compact the history before the run when the prompt would pass `compact_threshold` tokens
    (default: three quarters of the model's context)."""

    type: Literal["compaction"]
    compact_threshold: int | None = Field(None, ge=1)


#: names a client may give `moderation.model`: each is this deployment's safety classifier, which answers
MODERATION_MODELS = ("tokenstream-safety", "omni-moderation-latest", "text-moderation-latest")


class ModerationMode(_Strict):
    mode: Literal["score", "block"]


class ModerationPolicy(_Strict):
    input: ModerationMode | None = None
    output: ModerationMode | None = None


class Moderation(_Strict):
    """Moderation results of the response's input and output, from the safety processor
    (gateway/responses_framing.py); `block` is what this deployment does with flagged content anyway."""

    model: str = Field(max_length=api.MAX_NAME_CHARS)
    policy: ModerationPolicy | None = None

    def refused(self) -> tuple[str, str] | None:
        """(message, param) of what this server cannot honour, or None."""
        if self.model not in MODERATION_MODELS:
            return (
                (
                    f"moderation.model {self.model!r} is not served here; use one of "
                    f"{', '.join(MODERATION_MODELS)} (each is this deployment's safety classifier)."
                ),
                "moderation.model",
            )
        for side in ("input", "output"):
            mode = getattr(self.policy, side, None) if self.policy else None
            if mode is not None and mode.mode == "score":
                return (
                    (
                        f"moderation.policy.{side}.mode 'score' (report, never block) is not offered: this "
                        "deployment's safety policy blocks flagged content. Send 'block', or no policy: the "
                        "results are reported either way."
                    ),
                    f"moderation.policy.{side}.mode",
                )
        return None


class ResponseCreate(api.UnicodeBody):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, max_length=api.MAX_NAME_CHARS)
    input: str | list[InputItem]
    instructions: str | None = Field(None, max_length=MAX_TEXT)
    tools: list[ResponseTool] | None = Field(None, max_length=tp.MAX_TOOLS)
    tool_choice: ResponseToolChoice | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = Field(None, max_length=200)
    conversation: api.ConversationParam = None
    context_management: list[ContextManagement] | None = Field(None, max_length=1)
    store: bool = True
    stream: bool = False
    background: bool = False  # run on without the client (gateway/background.py); needs store
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_output_tokens: int | None = Field(None, ge=1, le=api.MAX_TOKENS)
    max_tool_calls: int | None = Field(None, ge=1, le=64)  # server tool calls over the whole run
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = Field(None, max_length=api.MAX_NAME_CHARS)
    safety_identifier: str | None = Field(None, max_length=64)  # recorded as the request's user
    prompt_cache_key: str | None = Field(None, max_length=api.MAX_CACHE_KEY_CHARS)  # ChatRequest.cache_key
    service_tier: Literal["auto", "default", "flex"] | None = None  # the key's tier; flex: below every tier
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    include: (
        list[
            Literal[
                "code_interpreter_call.outputs",
                "file_search_call.results",
                "message.output_text.logprobs",
                "reasoning.encrypted_content",
            ]
        ]
        | None
    ) = None
    top_logprobs: int | None = Field(None, ge=0, le=api.MAX_TOP_LOGPROBS)
    truncation: Literal["auto", "disabled"] | None = None  # OpenAI's default: disabled
    text: TextConfig | None = None
    # only its neutral value: no obfuscation padding is added to the stream's events (any other: a 400)
    stream_options: StreamOptions | None = None
    moderation: Moderation | None = None
    # tokenstream extensions (extra_body): an assistant preset; no response cache applies here
    assistant: str | None = Field(None, min_length=1, max_length=api.MAX_NAME_CHARS)
    # the stream interval of the answer's text (gpu_workers/streaming.py), as on chat completions
    stream_interval: int | None = Field(None, ge=1, le=api.MAX_STREAM_INTERVAL)
    stream_interval_ms: int | None = Field(None, ge=0, le=api.MAX_STREAM_INTERVAL_MS)

    def logprobs_asked(self) -> int | None:
        """How many alternatives each output token's log probability comes with (None: not asked)."""
        if self.top_logprobs or "message.output_text.logprobs" in (self.include or []):
            return self.top_logprobs or 0
        return None

    @property
    def conversation_id(self) -> str | None:
        return api.conversation_of(self.conversation)

    def unsupported(self) -> str | None:
        """The first field sent that this server does not implement."""
        extra = {k: v for k, v in (self.model_extra or {}).items() if v is not None}
        for name in UNSUPPORTED:
            if name in extra:
                return name
        return next(iter(extra), None)


def _text(content: str | list[InputText | InputFile | MediaPart], where: str) -> str:
    if isinstance(content, str):
        return content
    for j, part in enumerate(content):
        if isinstance(part, MediaPart):
            raise api.invalid_request(
                f"{where}.content[{j}]: `{part.type}` parts are not supported: the model reads text only",
                f"{where}.content[{j}].type",
            )
        if isinstance(part, InputFile) and part.text is None:
            raise api.invalid_request(f"{where}.content[{j}]: the file was not read", f"{where}.content[{j}]")
    return "".join(p.text for p in content)


def messages_of(
    body: ResponseCreate, tenant: str, earlier: list[ChatMessage] | None = None
) -> list[ChatMessage]:
    """`instructions`, then the `earlier` history (a conversation's items), then `input`, as chat
    messages (function calls joined into assistant turns, a compaction item as its summary)."""
    out: list[ChatMessage] = []
    if body.instructions:
        out.append(ChatMessage(role="system", content=body.instructions))
    out += earlier or []
    items = [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    if not 0 < len(items) <= MAX_INPUT_ITEMS:
        raise api.invalid_request(f"input must hold 1 to {MAX_INPUT_ITEMS} items", "input")
    commentary = False  # the last message is an assistant's commentary (and the calls after it)
    for i, item in enumerate(items):
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            out.append(ChatMessage(role=role, content=_text(item.content, f"input[{i}]")))
        elif isinstance(item, FunctionCallItem):
            call = MessageToolCall(
                id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments)
            )
            if out and joins_calls(out[-1], commentary):
                out[-1].tool_calls.append(call)
            else:
                out.append(ChatMessage(role="assistant", content="", tool_calls=[call]))
        elif isinstance(item, CompactionItem):
            out = superseded(out) + [summary_message(unseal(tenant, item.encrypted_content, f"input[{i}]"))]
        else:
            out.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=item.output))
        if not isinstance(item, FunctionCallItem):  # the calls after a commentary all join its turn
            commentary = isinstance(item, MessageItem) and item.phase == "commentary"
    if body.previous_response_id is None:
        made = {c.id for m in out for c in m.tool_calls}
        for i, m in enumerate(out):
            if m.role == "tool" and m.tool_call_id not in made:
                raise api.invalid_request(
                    f"function_call_output answers {m.tool_call_id!r}, a call that no "
                    "function_call item of this input (or previous_response_id) made",
                    f"input[{i}].call_id",
                )
    return out


#: the most of the user's input a forced file_search searches with (the grammar writes it token by token)
FORCED_QUERY_CHARS = 500


def user_query(body: ResponseCreate) -> str | None:
    """What a forced file_search searches with: the user's last message (its text parts), or None."""
    items = [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    for item in reversed(items):
        if isinstance(item, MessageItem) and item.role == "user":
            parts = [item.content] if isinstance(item.content, str) else item.content
            text = " ".join(
                p if isinstance(p, str) else p.text for p in parts if isinstance(p, str | InputText)
            )
            text = " ".join(text.split())[:FORCED_QUERY_CHARS]
            return text or None
    return None


def _forced(choice: ResponseToolChoice | None, name: str) -> bool:
    return isinstance(choice, HostedTool | NamedFunction) and _name(choice) == name


def _as_function(tool: ResponseTool, query: str | None = None) -> tp.Tool:
    """The tool as a function spec; `query`: the text a forced file_search searches with."""
    if isinstance(tool, FunctionTool):
        return tp.Tool(
            type="function",
            function=tp.FunctionDef(
                name=tool.name, description=tool.description, parameters=tool.parameters, strict=tool.strict
            ),
        )
    if isinstance(tool, CodeInterpreterTool):
        return tp.Tool(type="function", function=CODE_TOOL)
    if isinstance(tool, WebFetchTool):
        return tp.Tool(type="function", function=WEB_TOOL)
    # the stores and the result count are fixed by the request: the grammar writes them as given. A
    # forced call searches with the user's input, written by the grammar too: a small model forced to
    # call writes an empty query (which finds nothing), and a search query is never empty.
    return tp.Tool(
        type="function",
        function=tp.FunctionDef(
            name="file_search",
            description="Search the uploaded files for passages that answer a query.",
            parameters={
                "type": "object",
                "properties": {
                    "query": {"type": "string"} if query is None else {"type": "string", "enum": [query]},
                    "vector_store_ids": {
                        "type": "array",
                        "items": {"type": "string", "enum": tool.vector_store_ids},
                        "minItems": len(tool.vector_store_ids),
                        "maxItems": len(tool.vector_store_ids),
                    },
                    "max_num_results": {"type": "integer", "enum": [tool.max_num_results]},
                },
                "required": ["query", "vector_store_ids", "max_num_results"],
                "additionalProperties": False,
            },
        ),
    )


def _name(tool: ResponseTool | NamedFunction | HostedTool) -> str:
    return tool.name if isinstance(tool, FunctionTool | NamedFunction) else tool.type


def _choice(choice: ResponseToolChoice | None) -> tp.ToolChoice | None:
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, NamedFunction | HostedTool):
        return tp.NamedToolChoice(type="function", function=tp.FunctionName(name=_name(choice)))
    return tp.AllowedToolsChoice(
        type="allowed_tools",
        allowed_tools=tp.AllowedTools(
            mode=choice.mode,
            tools=[
                tp.NamedToolChoice(type="function", function=tp.FunctionName(name=_name(t)))
                for t in choice.tools
            ],
        ),
    )


def _format(text: TextConfig | None) -> tp.ResponseFormat | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type != "json_schema":
        return None if fmt is None else tp.ResponseFormat(type=fmt.type)
    if fmt.name is None or fmt.schema_ is None:
        raise tp.BadField("text.format json_schema needs name and schema", "text.format")
    return tp.ResponseFormat(
        type="json_schema",
        json_schema=tp.JSONSchemaFormat(
            name=fmt.name, description=fmt.description, schema=fmt.schema_, strict=fmt.strict
        ),
    )


def output_and_run(
    tools: list[ResponseTool], body: ResponseCreate, max_steps: int
) -> tuple[OutputSpec, RunSpec]:
    """The OutputSpec (function specs for every tool, built-ins included) and the run's RunSpec."""
    try:
        # with max_tool_calls a step makes one call at most, so the run's count is its step number
        parallel = False if body.max_tool_calls is not None else body.parallel_tool_calls
        query = user_query(body) if _forced(body.tool_choice, "file_search") else None
        spec = tp.output_spec(
            [_as_function(t, query) for t in tools], _choice(body.tool_choice), parallel, _format(body.text)
        )
    except tp.BadField as exc:
        raise api.invalid_request(str(exc), exc.param) from None
    server = [t.type for t in tools if t.type in BUILTIN_TYPES]
    return spec, RunSpec(
        server_tools=server,
        max_steps=max_steps,
        max_output_tokens=body.max_output_tokens,
        truncation=body.truncation or "disabled",
        max_tool_calls=body.max_tool_calls,
    )


def item_dict(item: InputItem, default_id: str) -> dict[str, Any]:
    """An input item as OpenAI lists it back: a message's text as parts, an id (the client's, or
    `default_id`), a status."""
    shown = item.model_dump(exclude_none=True)
    if isinstance(item, MessageItem) and isinstance(item.content, str):
        kind = "output_text" if item.role == "assistant" else "input_text"
        shown["content"] = [{"type": kind, "text": item.content}]
    shown.setdefault("id", default_id)
    shown.setdefault("status", "completed")
    return shown


def input_items(body: ResponseCreate, run_id: str) -> list[dict[str, Any]]:
    """The request's input as OpenAI lists it back (`GET /v1/responses/{id}/input_items`), each item's
    id derived from the response and its position unless the client gave one."""
    items = [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    return [item_dict(item, f"{item_prefix(item)}_{run_id}_{i}") for i, item in enumerate(items)]


def item_prefix(item: InputItem) -> str:
    return "msg" if isinstance(item, MessageItem) else "cmp" if isinstance(item, CompactionItem) else "item"
