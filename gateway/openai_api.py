"""OpenAI-compatible shapes: the chat completion request, response, stream chunk and error body."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from starlette.exceptions import HTTPException

from gateway.tool_params import CallInHistory, ResponseFormat, Tool, ToolChoice
from schemas.requests import MAX_LOGIT_BIAS, MAX_STREAM_INTERVAL, MAX_STREAM_INTERVAL_MS, MAX_TOP_LOGPROBS

# Limits on one request (the body itself is bounded by GatewaySettings.max_body_bytes).
MAX_MESSAGES = 1024
MAX_STOP = 4
MAX_STOP_CHARS = 256
MAX_NAME_CHARS = 256
MAX_CACHE_KEY_CHARS = 256  # prompt_cache_key
MAX_TOKENS = 2**31 - 1  # the model's context refuses far less (routes/chat.py); this keeps events encodable
INT64 = 2**63 - 1


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, max_length=MAX_NAME_CHARS)
    tool_call_id: str | None = Field(None, max_length=MAX_NAME_CHARS)
    tool_calls: list[CallInHistory] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content if p.type == "text")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class UnicodeBody(BaseModel):
    """A request body whose strings must all be valid Unicode: a lone UTF-16 surrogate (JSON's
    \\ud800 escape) could not be written to the pipeline or Redis, so it is a 400 here."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = lone_surrogate(data)
        if where is not None:
            raise ValueError(f"{where or 'the body'} holds a lone UTF-16 surrogate (not valid Unicode text)")
        return data


class ConversationRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1, max_length=64)


#: `conversation` on chat completions and Responses: an id, or {"id": ...}
ConversationParam = Annotated[str, Field(min_length=1, max_length=64)] | ConversationRef | None


def conversation_of(value: ConversationParam) -> str | None:
    """The id a request's `conversation` names (a string, or {"id": ...})."""
    return value.id if isinstance(value, ConversationRef) else value


class ChatCompletionRequest(UnicodeBody):
    """The fields tokenstream honours. Anything else is kept in `model_extra` only to be refused by
    gateway/chat_fields.py with a 400 naming it (a neutral value, such as null, passes)."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-INT64 - 1, le=INT64)
    user: str | None = Field(None, max_length=MAX_NAME_CHARS)
    safety_identifier: str | None = Field(None, max_length=64, description="recorded as the request's user")
    n: int | None = Field(None, ge=1, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    store: bool | None = None  # kept for GET /v1/chat/completions (gateway/stored_chats.py)
    metadata: dict[str, str] | None = None  # kept with a stored completion; listed by it
    # a tenant's requests sharing it go to one worker, whose prefix cache holds their common prompt once
    prompt_cache_key: str | None = Field(None, max_length=MAX_CACHE_KEY_CHARS)
    # function calling and structured output (checked in gateway/tool_params.py)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # a Conversation (/v1/conversations): its items before the messages; the messages and the answer
    # appended to it once the answer has ended (gateway/routes/chat.py)
    conversation: ConversationParam = None
    # tokenstream extensions (the SDK sends them with extra_body=...):
    conversation_id: str | None = Field(
        None,
        min_length=1,
        max_length=200,
        description="continue a stored conversation: send only the new message",
    )
    assistant: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_NAME_CHARS,
        description="an assistant preset: system prompt, model and sampling settings",
    )
    cache: bool = Field(True, description="false: never answer this request from the response cache")
    stream_interval: int | None = Field(
        None,
        ge=1,
        le=MAX_STREAM_INTERVAL,
        description="the worker writes the answer's pending text as one chunk once this many tokens are "
        "pending (1: every token); default: the worker deployment's",
    )
    stream_interval_ms: int | None = Field(
        None,
        ge=0,
        le=MAX_STREAM_INTERVAL_MS,
        description="... or once this many milliseconds have passed since its last chunk (0: tokens only)",
    )

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(not 0 < len(x) <= MAX_STOP_CHARS for x in stops):
            raise ValueError(f"each stop sequence must have 1 to {MAX_STOP_CHARS} characters")
        return v

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        return check_metadata(v)

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (v or {}).items():
            if not token.isdigit() or len(token) > 9:
                raise ValueError(f"logit_bias keys are token ids (integers as strings); got {token[:40]!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100]; got {bias} for token {token}")
        return v

    @model_validator(mode="after")
    def _options_need_stream(self) -> ChatCompletionRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def logprobs_asked(self) -> int | None:
        """How many alternatives each token's report lists (0 and up), or None when no report is asked."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def check_metadata(v: dict[str, str] | None) -> dict[str, str] | None:
    """OpenAI's metadata limits (a field validator of every object that keeps metadata)."""
    if v is not None and (len(v) > 16 or any(len(k) > 64 or len(x) > 512 for k, x in v.items())):
        raise ValueError(
            "metadata holds at most 16 pairs, keys of at most 64 and values of at most 512 characters"
        )
    return v


def lone_surrogate(data: Any) -> str | None:
    """The path of the first string in `data` that cannot be UTF-8 (a lone surrogate), else None.

    JSON's \\ud800 escapes decode to such strings; they could not be written to the pipeline.
    Iterative, so a deeply nested body cannot exhaust the stack.
    """
    todo: list[tuple[str, Any]] = [("", data)]
    while todo:
        path, item = todo.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return path
        elif isinstance(item, dict):
            todo += [(f"{path}.{k}" if path else str(k), v) for k, v in item.items()]
            todo += [(path, k) for k in item]
        elif isinstance(item, list):
            todo += [(f"{path}.{i}" if path else str(i), v) for i, v in enumerate(item)]
    return None


# ----------------------------------------------------------------- responses (plain dicts: fast)


def completion_id(request_id: str) -> str:
    return f"chatcmpl-{request_id}"


def request_id_of(completion: str) -> str:
    return completion.removeprefix("chatcmpl-")


def logprobs_body(entries: list) -> dict[str, Any]:
    """schemas.TokenLogprob entries -> OpenAI's choice `logprobs` object."""
    return {
        "content": [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": e.bytes,
                "top_logprobs": [
                    {"token": t.token, "logprob": t.logprob, "bytes": t.bytes} for t in e.top_logprobs
                ],
            }
            for e in entries
        ],
        "refusal": None,
    }


def chunk(
    cid: str,
    created: int,
    model: str,
    *,
    content: str | None = None,
    role: str | None = None,
    finish_reason: str | None = None,
    include_usage: bool = False,
    tool_calls: list[dict[str, Any]] | None = None,
    logprobs: list | None = None,
) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    if tool_calls:
        delta["tool_calls"] = tool_calls
    body: dict[str, Any] = {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [
            {
                "index": 0,
                "delta": delta,
                "logprobs": logprobs_body(logprobs) if logprobs else None,
                "finish_reason": finish_reason,
            }
        ],
    }
    if include_usage:
        body["usage"] = None
    return body


def usage_dict(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def usage_chunk(
    cid: str, created: int, model: str, prompt: int, completion: int, cached: int = 0
) -> dict[str, Any]:
    return {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [],
        "usage": usage_dict(prompt, completion, cached),
    }


def completion_body(
    cid: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str,
    prompt: int,
    completion: int,
    cached: int = 0,
    tool_calls: list[dict[str, Any]] | None = None,
    logprobs: list | None = None,
) -> dict[str, Any]:
    """The whole answer; `logprobs` is None unless the request asked for them (then a list, maybe empty)."""
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    if tool_calls:  # OpenAI: content is null beside calls unless the model also wrote text
        message["content"] = text or None
        message["tool_calls"] = tool_calls
    return {
        "id": cid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": finish_reason,
                "logprobs": None if logprobs is None else logprobs_body(logprobs),
            }
        ],
        "usage": usage_dict(prompt, completion, cached),
    }


def finish_reason_for_client(reason: str) -> str:
    """OpenAI has no `cancelled`; a cancelled answer simply stops."""
    return "stop" if reason == "cancelled" else reason


def now_s() -> int:
    return int(time.time())


# ----------------------------------------------------------------------------------- errors


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class APIError(Exception):
    """Raised inside a route; rendered as the OpenAI error body with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse(
            error_body(self.message, self.type, self.param, self.code),
            status_code=self.status,
            headers=self.headers,
        )


def invalid_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param=param)


def model_not_found(model: str) -> APIError:
    return APIError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        "invalid_request_error",
        param="model",
        code="model_not_found",
    )


def overloaded(retry_after: int, wait_s: float) -> APIError:
    return APIError(
        429,
        f"The model is overloaded (estimated queue wait {wait_s:.1f}s); retry after {retry_after}s.",
        "rate_limit_error",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(retry_after)},
    )


def unavailable(message: str) -> APIError:
    return APIError(
        503, message, "service_unavailable", code="pipeline_unavailable", headers={"Retry-After": "5"}
    )


# Completion.error_code -> (status, param) of a request the pipeline refused for the client's fault
CLIENT_ERRORS = {
    "context_length_exceeded": (400, "messages"),
    "preset_not_found": (404, "assistant"),
    # the conversation's previous turn was never answered: this one can be sent again
    "previous_turn_unanswered": (409, "messages"),
}


def refusal(done) -> APIError:
    """The error a Completion with finish_reason "error" stands for: 4xx when the client's fault."""
    if done.error_code in CLIENT_ERRORS:
        status, param = CLIENT_ERRORS[done.error_code]
        return APIError(
            status, done.error or done.error_code, "invalid_request_error", param=param, code=done.error_code
        )
    return APIError(500, done.error or "generation failed", "server_error", code="generation_error")


def not_found(message: str) -> APIError:
    return APIError(404, message, "invalid_request_error", code="not_found")


async def validation_error_handler(_: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        where = first.get("loc", ("body", "?"))[-1]
        why = (first.get("ctx") or {}).get("error", "invalid JSON")
        return JSONResponse(
            error_body(
                f"We could not parse the JSON body of your request: {why} (at byte {where}).",
                "invalid_request_error",
                None,
                "invalid_json",
            ),
            status_code=400,
        )
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    message = f"{msg} ({param})" if param else msg
    return JSONResponse(error_body(message, "invalid_request_error", param, None), status_code=400)


async def api_error_handler(_: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def http_error_handler(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own errors (unknown path, wrong method, unparsable body) in OpenAI's shape."""
    method, path = request.method, request.url.path
    if exc.status_code == 404:
        message, code = f"Invalid URL ({method} {path}).", "not_found"
    elif exc.status_code == 405:
        message, code = f"Method {method} is not allowed on {path}.", "method_not_allowed"
    elif exc.status_code == 400:
        message, code = (
            (
                "We could not parse the JSON body of your request: it must be valid UTF-8 JSON "
                "(nested at most a few hundred levels deep)."
            ),
            "invalid_json",
        )
    else:
        message, code = str(exc.detail), None
    type_ = "server_error" if exc.status_code >= 500 else "invalid_request_error"
    return JSONResponse(
        error_body(message, type_, None, code),
        status_code=exc.status_code,
        headers=getattr(exc, "headers", None),
    )


async def unexpected_error_handler(_: Request, exc: Exception) -> JSONResponse:
    """A bug: still OpenAI's shape, so clients can show it. An unreachable keyring (the durable store is
    away; common/sealing.py) is an outage, not a bug: 503, to be retried."""
    from schemas.sealing import SealingUnavailable

    if isinstance(exc, SealingUnavailable):
        return JSONResponse(
            error_body(
                "the key store is unavailable; retry shortly", "server_error", None, "service_unavailable"
            ),
            status_code=503,
            headers={"Retry-After": "1"},
        )
    return JSONResponse(
        error_body(f"internal error: {type(exc).__name__}", "server_error", None, "internal_error"),
        status_code=500,
    )
