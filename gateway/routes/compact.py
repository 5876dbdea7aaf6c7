"""`POST /v1/responses/compact`: an input condensed into the user's messages, kept verbatim, and one
`compaction` item holding the model's own summary of everything (gateway/compaction.py).

The summary is a response run through the pipeline like any other (stored false, greedy), so it is
screened, limited and counted as the key's usage; its usage is the compaction's. `prompt_cache_key` and
`service_tier` mean what they mean on `POST /v1/responses` (the run carries them); any other field is a
400 naming it.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

from fastapi import APIRouter, Depends
from fastapi.exceptions import RequestValidationError
from pydantic import ConfigDict, Field, ValidationError

from gateway import compaction, context
from gateway import openai_api as api
from gateway.auth import principal
from gateway.deps import pipeline
from gateway.input_files import read_files
from gateway.pipeline import Gateway
from gateway.responses_api import MAX_TEXT, InputItem, MessageItem, ResponseCreate, item_dict, messages_of
from gateway.routes.responses import summary_run
from schemas import keys as K
from schemas.ids import new_item_id

router = APIRouter(prefix="/v1")


class CompactRequest(api.UnicodeBody):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=api.MAX_NAME_CHARS)
    input: Annotated[str, Field(max_length=MAX_TEXT)] | list[InputItem]
    instructions: str | None = Field(None, max_length=MAX_TEXT)
    previous_response_id: str | None = Field(None, description="refused: send the items to compact")
    prompt_cache_key: str | None = Field(None, max_length=api.MAX_CACHE_KEY_CHARS)  # the summary run's
    service_tier: Literal["auto", "default", "flex"] | None = None  # the summary run's


@router.post("/responses/compact")
async def compact(body: CompactRequest, gw: Gateway = Depends(pipeline), key: K.ApiKey = Depends(principal)):
    if body.previous_response_id is not None:
        raise api.invalid_request(
            "previous_response_id is not supported here: the history of a response lives in "
            "the conversation processor; send its items as input (or list a conversation's "
            "items and send those).",
            "previous_response_id",
        )
    try:
        given = ResponseCreate(model=body.model, input=body.input, instructions=body.instructions)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None
    await read_files(gw, key.tenant, given)
    summary, usage = await compaction.summarise(
        summary_run(gw, key, body.model, body.prompt_cache_key, body.service_tier),
        messages_of(given, key.tenant),
        context.window(body.model),
    )
    items = [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    kept = [
        item_dict(item, new_item_id("msg"))
        for item in items
        if isinstance(item, MessageItem) and item.role == "user"
    ]
    return {
        "id": new_item_id("resp"),
        "object": "response.compaction",
        "created_at": int(time.time()),
        "output": [*kept, compaction.item(key.tenant, summary)],
        "usage": usage,
    }
