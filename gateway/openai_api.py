"""OpenAI-compatible shapes: the chat completion request, response, stream chunk and error body."""

from __future__ import annotations

import time
from typing import Any, Literal

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content if p.type == "text")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """The fields tokenstream honours; unknown fields are accepted and ignored, like OpenAI's."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    n: int | None = Field(None, ge=1, le=1)
    # tokenstream extensions (the SDK sends them with extra_body=...):
    conversation_id: str | None = Field(None, min_length=1, max_length=200,
                                        description="continue a stored conversation: send only the new message")
    assistant: str | None = Field(None, min_length=1, description="an assistant preset: system prompt, "
                                                                  "model and sampling settings")

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        return v

    @model_validator(mode="after")
    def _options_need_stream(self) -> ChatCompletionRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# ----------------------------------------------------------------- responses (plain dicts: fast)

def completion_id(request_id: str) -> str:
    return f"chatcmpl-{request_id}"


def request_id_of(completion: str) -> str:
    return completion.removeprefix("chatcmpl-")


def chunk(cid: str, created: int, model: str, *, content: str | None = None, role: str | None = None,
          finish_reason: str | None = None, include_usage: bool = False) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    body: dict[str, Any] = {
        "id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
        "system_fingerprint": None,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }
    if include_usage:
        body["usage"] = None
    return body


def usage_dict(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def usage_chunk(cid: str, created: int, model: str, prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": None, "choices": [], "usage": usage_dict(prompt, completion, cached)}


def completion_body(cid: str, created: int, model: str, text: str, finish_reason: str,
                    prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    return {
        "id": cid, "object": "chat.completion", "created": created, "model": model,
        "system_fingerprint": None,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                     "logprobs": None, "finish_reason": finish_reason}],
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

    def __init__(self, status: int, message: str, type_: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code),
                            status_code=self.status, headers=self.headers)


def invalid_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param=param)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist or you do not have access to it.",
                    "invalid_request_error", param="model", code="model_not_found")


def overloaded(retry_after: int, wait_s: float) -> APIError:
    return APIError(429, f"The model is overloaded (estimated queue wait {wait_s:.1f}s); "
                         f"retry after {retry_after}s.", "rate_limit_error", code="rate_limit_exceeded",
                    headers={"Retry-After": str(retry_after)})


def unavailable(message: str) -> APIError:
    return APIError(503, message, "service_unavailable", code="pipeline_unavailable",
                    headers={"Retry-After": "5"})


def not_found(message: str) -> APIError:
    return APIError(404, message, "invalid_request_error", code="not_found")


async def validation_error_handler(_: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    message = f"{msg} ({param})" if param else msg
    return JSONResponse(error_body(message, "invalid_request_error", param, None), status_code=400)


async def api_error_handler(_: Request, exc: APIError) -> JSONResponse:
    return exc.response()
