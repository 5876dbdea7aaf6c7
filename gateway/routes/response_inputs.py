"""The input side of the Responses API: `POST /v1/responses/input_tokens` (what the model would read,
counted with its own template) and `GET /v1/responses/{id}/input_items` (a stored response's input)."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from fastapi import APIRouter, Depends
from fastapi.exceptions import RequestValidationError
from pydantic import ConfigDict, Field, ValidationError

from common import sealing
from common.models import load_tokenizer
from gateway import openai_api as api
from gateway.auth import principal
from gateway.deps import pipeline
from gateway.file_objects import check_paging, page
from gateway.input_files import read_files
from gateway.pipeline import Gateway
from gateway.response_owners import owned_response, response_run_id
from gateway.responses_api import ResponseCreate, messages_of, output_and_run
from gateway.routes.responses import in_conversation
from schemas import keys as K
from schemas.prompt import prompt_ids

router = APIRouter(prefix="/v1")


class InputTokensRequest(api.UnicodeBody):
    """`POST /v1/responses/input_tokens`: the fields that make a response's input."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1, max_length=api.MAX_NAME_CHARS)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    truncation: Literal["auto"] | None = None
    conversation: str | dict[str, Any] | None = None  # its items counted before the input
    # refused by name: the history of a previous response is the conversation processor's, which the
    # gateway does not read; the model does not reason
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None


@router.post("/responses/input_tokens")
async def input_tokens(
    body: InputTokensRequest, gw: Gateway = Depends(pipeline), key: K.ApiKey = Depends(principal)
):
    """How many tokens the model would read for this input: instructions, the conversation's items if
    named, input items, and the tools and format as the worker writes them into the prompt
    (schemas/prompt.py)."""
    if body.model not in gw.cfg.models:
        raise api.model_not_found(body.model)
    for name in ("previous_response_id", "reasoning"):
        if getattr(body, name) is not None:
            raise api.invalid_request(
                f"`{name}` is not supported when counting input tokens: only the input "
                "sent (and a conversation's items) is counted here.",
                name,
            )
    try:
        request = ResponseCreate.model_validate(body.model_dump(exclude_none=True))
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None
    output, _ = output_and_run(request.tools or [], request, gw.cfg.responses_max_steps)
    _, earlier = await in_conversation(gw, request, key.tenant)
    await read_files(gw, key.tenant, request)
    messages = messages_of(request, key.tenant, earlier)
    try:
        count = await asyncio.to_thread(lambda: len(prompt_ids(load_tokenizer(body.model), messages, output)))
    except (OSError, ValueError):
        raise api.APIError(
            400,
            f"This gateway has no tokenizer for `{body.model}` to count with.",
            "invalid_request_error",
            param="model",
            code="tokenizer_unavailable",
        ) from None
    return {"object": "response.input_tokens", "input_tokens": count}


@router.get("/responses/{response}/input_items")
async def list_input_items(
    response: str,
    limit: int = 20,
    order: str = "desc",
    after: str | None = None,
    before: str | None = None,
    gw: Gateway = Depends(pipeline),
    key: K.ApiKey = Depends(principal),
):
    """The input items of a stored response, in OpenAI's list shape."""
    rid = response_run_id(response)
    meta = await owned_response(gw, rid, response, key.tenant)
    raw = await gw.redis.get(K.response_input(rid)) if meta.get("store") and gw.redis is not None else None
    given = await sealing.unblocked(sealing.open_json, raw)  # None: erased (`tokenstream erase`)
    if given is None:
        raise api.not_found(
            f"Response {response!r} has no stored input (created with store false, or expired)."
        )
    check_paging(order, limit)
    return page(given, limit=limit, order=order, after=after, before=before)
