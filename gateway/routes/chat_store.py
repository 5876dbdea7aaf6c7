"""Stored chat completions (gateway/stored_chats.py): list (`model`, `metadata[key]=value`, `after`,
`limit`, `order`), retrieve, update the metadata, delete, and the messages that asked for one. Every
stored completion belongs to the key's tenant; another tenant's is answered 404."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from pydantic import ConfigDict, field_validator

from gateway import openai_api as api
from gateway.auth import principal
from gateway.deps import pipeline
from gateway.file_objects import check_paging, page
from gateway.pipeline import Gateway
from schemas.keys import ApiKey

router = APIRouter(prefix="/v1/chat/completions")


class Relabel(api.UnicodeBody):
    model_config = ConfigDict(extra="forbid")
    metadata: dict[str, str] | None
    check_metadata = field_validator("metadata")(api.check_metadata)


@router.get("")
async def list_completions(
    request: Request,
    model: str | None = None,
    after: str | None = None,
    limit: int = 20,
    order: str = "asc",
    gw: Gateway = Depends(pipeline),
    key: ApiKey = Depends(principal),
):
    check_paging(order, limit)
    wanted = {}
    for name, value in request.query_params.multi_items():
        if name.startswith("metadata[") and name.endswith("]"):
            wanted[name[9:-1]] = value
        elif name not in ("model", "after", "limit", "order"):
            raise api.invalid_request(f"Unknown query parameter {name!r}.", name)
    shown = [
        r["completion"]
        for r in await gw.stored_chats.all(key.tenant)
        if (model is None or r["completion"]["model"] == model)
        and all(r["completion"]["metadata"].get(k) == v for k, v in wanted.items())
    ]
    return page(shown, limit=limit, order=order, after=after, before=None)


@router.get("/{completion_id}")
async def retrieve(completion_id: str, gw: Gateway = Depends(pipeline), key: ApiKey = Depends(principal)):
    return (await gw.stored_chats.owned(key.tenant, completion_id))[1]["completion"]


@router.post("/{completion_id}")
async def update(
    completion_id: str, body: Relabel, gw: Gateway = Depends(pipeline), key: ApiKey = Depends(principal)
):
    rid, record = await gw.stored_chats.owned(key.tenant, completion_id)
    return await gw.stored_chats.relabel(rid, record, body.metadata or {})


@router.delete("/{completion_id}")
async def delete(completion_id: str, gw: Gateway = Depends(pipeline), key: ApiKey = Depends(principal)):
    rid, _ = await gw.stored_chats.owned(key.tenant, completion_id)
    await gw.stored_chats.forget(key.tenant, rid)
    return {"object": "chat.completion.deleted", "id": completion_id, "deleted": True}


@router.get("/{completion_id}/messages")
async def messages(
    completion_id: str,
    after: str | None = None,
    limit: int = 20,
    order: str = "asc",
    gw: Gateway = Depends(pipeline),
    key: ApiKey = Depends(principal),
):
    check_paging(order, limit)
    _, record = await gw.stored_chats.owned(key.tenant, completion_id)
    return page(record["messages"], limit=limit, order=order, after=after, before=None)
