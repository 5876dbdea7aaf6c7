"""/v1/conversations: create (with up to 20 items), retrieve, update its metadata, delete; its items
(add up to 20 at a time, list, retrieve, delete). Every conversation belongs to the key's tenant;
another tenant's is answered 404. A response created with `conversation` reads and extends it
(gateway/conversations.py).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Depends, Query
from pydantic import ConfigDict, Field, field_validator

from gateway import openai_api as api
from gateway.auth import principal
from gateway.conversations import conversation_object
from gateway.deps import pipeline
from gateway.file_objects import check_paging, page
from gateway.pipeline import Gateway
from gateway.responses_api import INCLUDED, InputItem, item_dict, item_prefix
from schemas.ids import new_item_id
from schemas.keys import ApiKey

router = APIRouter(prefix="/v1/conversations")

MAX_ITEMS_AT_ONCE = 20


class Body(api.UnicodeBody):
    model_config = ConfigDict(extra="forbid")


class CreateConversation(Body):
    items: list[InputItem] | None = Field(None, max_length=MAX_ITEMS_AT_ONCE)
    metadata: dict[str, str] | None = None
    check_metadata = field_validator("metadata")(api.check_metadata)


class UpdateConversation(Body):
    metadata: dict[str, str]
    check_metadata = field_validator("metadata")(api.check_metadata)


class AddItems(Body):
    items: list[InputItem] = Field(min_length=1, max_length=MAX_ITEMS_AT_ONCE)


def _included(include: list[str] | None) -> None:
    """`include` names outputs every item carries anyway; anything else is a 400."""
    for value in include or []:
        if value not in INCLUDED:
            raise api.invalid_request(
                f"include: {value!r} is not supported here (supported: {', '.join(INCLUDED)}).", "include"
            )


def _stored(items: list[InputItem]) -> list[dict[str, Any]]:
    return [item_dict(item, new_item_id(item_prefix(item))) for item in items]


async def _add(gw: Gateway, conv_id: str, tenant: str, items: list[InputItem]) -> list[dict[str, Any]]:
    stored = _stored(items)
    before = {i["id"] for i in await gw.conversations.items(conv_id)}
    clash = next((i["id"] for i in stored if i["id"] in before), None)
    if clash is not None:
        raise api.invalid_request(f"An item with id {clash!r} is already in this conversation.", "items")
    await gw.conversations.append(conv_id, tenant, stored)
    return stored


@router.post("")
async def create(body: CreateConversation, gw: Gateway = Depends(pipeline), key: ApiKey = Depends(principal)):
    conv_id, record = await gw.conversations.create(key.tenant, body.metadata or {})
    if body.items:
        await _add(gw, conv_id, key.tenant, body.items)
    return conversation_object(conv_id, record)


@router.get("/{conv_id}")
async def retrieve(conv_id: str, gw: Gateway = Depends(pipeline), key: ApiKey = Depends(principal)):
    return conversation_object(conv_id, await gw.conversations.owned(conv_id, key.tenant))


@router.post("/{conv_id}")
async def update(
    conv_id: str, body: UpdateConversation, gw: Gateway = Depends(pipeline), key: ApiKey = Depends(principal)
):
    record = await gw.conversations.owned(conv_id, key.tenant)
    await gw.conversations.set_metadata(conv_id, body.metadata)
    return conversation_object(conv_id, {**record, "metadata": json.dumps(body.metadata)})


@router.delete("/{conv_id}")
async def delete(conv_id: str, gw: Gateway = Depends(pipeline), key: ApiKey = Depends(principal)):
    """Forget the conversation and its items (the events of its responses stay on the log for their
    retention, as every event does)."""
    await gw.conversations.owned(conv_id, key.tenant)
    await gw.conversations.delete(conv_id)
    return {"id": conv_id, "object": "conversation.deleted", "deleted": True}


@router.post("/{conv_id}/items")
async def add_items(
    conv_id: str,
    body: AddItems,
    include: list[str] | None = Query(None),
    gw: Gateway = Depends(pipeline),
    key: ApiKey = Depends(principal),
):
    _included(include)
    await gw.conversations.owned(conv_id, key.tenant)
    stored = await _add(gw, conv_id, key.tenant, body.items)
    return {
        "object": "list",
        "data": stored,
        "first_id": stored[0]["id"],
        "last_id": stored[-1]["id"],
        "has_more": False,
    }


@router.get("/{conv_id}/items")
async def list_items(
    conv_id: str,
    limit: int = 20,
    order: str = "desc",
    after: str | None = None,
    include: list[str] | None = Query(None),
    gw: Gateway = Depends(pipeline),
    key: ApiKey = Depends(principal),
):
    _included(include)
    check_paging(order, limit)
    await gw.conversations.owned(conv_id, key.tenant)
    return page(await gw.conversations.items(conv_id), limit=limit, order=order, after=after, before=None)


@router.get("/{conv_id}/items/{item_id}")
async def retrieve_item(
    conv_id: str,
    item_id: str,
    include: list[str] | None = Query(None),
    gw: Gateway = Depends(pipeline),
    key: ApiKey = Depends(principal),
):
    _included(include)
    await gw.conversations.owned(conv_id, key.tenant)
    item = await gw.conversations.item(conv_id, item_id)
    if item is None:
        raise api.not_found(f"Item with id {item_id!r} not found in conversation {conv_id!r}.")
    return item


@router.delete("/{conv_id}/items/{item_id}")
async def delete_item(
    conv_id: str, item_id: str, gw: Gateway = Depends(pipeline), key: ApiKey = Depends(principal)
):
    """Take an item out: later responses in the conversation no longer read it. Answers the conversation."""
    record = await gw.conversations.owned(conv_id, key.tenant)
    if not await gw.conversations.remove(conv_id, item_id):
        raise api.not_found(f"Item with id {item_id!r} not found in conversation {conv_id!r}.")
    return conversation_object(conv_id, record)
