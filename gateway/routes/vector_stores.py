"""/v1/vector_stores: create (with file_ids), list, get, update, delete; its files (add, list, get,
remove) and search. Every store belongs to the key's tenant; another tenant's is answered 404.

Adding a file records it `in_progress` and writes a FileIngest event; the tool processor indexes
it and records `completed` or `failed` (with the chunk count), which the store's `file_counts`
and `status` show. Taking a file out (or deleting it, or its store) writes a remove event first,
then forgets it, so its chunks cannot outlive it in search. Search is a file_search tool call
through the tool processor (gateway/searches.py).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from gateway import openai_api as api
from gateway.auth import principal
from gateway.deps import pipeline
from gateway.file_objects import announce, check_paging, page, store_file_object, store_object, uploads_of
from gateway.pipeline import Gateway
from gateway.routes.files import owned as owned_file
from gateway.searches import SearchTimeout
from schemas.files import STORE_FILE_STATES
from schemas.ids import is_vector_store_id
from schemas.keys import ApiKey

router = APIRouter(prefix="/v1/vector_stores", dependencies=[Depends(principal)])

MAX_QUERY_CHARS = 2000  # the file_search tool's limits
MAX_RESULTS = 20


class Body(api.UnicodeBody):
    """A request body: fields not listed are refused (400 naming them), and so is text that is not
    valid Unicode (a lone surrogate, which Redis could not store)."""

    model_config = ConfigDict(extra="forbid")


class Chunking(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["auto"] = Field(description='only the built-in chunking ("auto") is supported')


def _unsupported(v: Any, info: ValidationInfo) -> Any:
    if v is not None:
        raise ValueError(f"{info.field_name} is not supported here")
    return v


class CreateStore(Body):
    name: str | None = Field(None, max_length=256)
    description: str | None = Field(None, max_length=512)
    file_ids: list[str] = Field(default_factory=list, max_length=500)
    metadata: dict[str, str] | None = None
    chunking_strategy: Chunking | None = None
    expires_after: Any = Field(None, description="expiry is not supported: delete a store when done")
    check_metadata = field_validator("metadata")(api.check_metadata)
    check_unsupported = field_validator("expires_after")(_unsupported)


class UpdateStore(Body):
    name: str | None = Field(None, max_length=256)
    metadata: dict[str, str] | None = None
    expires_after: Any = Field(None, description="expiry is not supported")
    check_metadata = field_validator("metadata")(api.check_metadata)
    check_unsupported = field_validator("expires_after")(_unsupported)


class AddFile(Body):
    file_id: str = Field(min_length=1, max_length=64)
    chunking_strategy: Chunking | None = None
    attributes: dict[str, Any] | None = Field(None, description="file attributes are not supported")

    @field_validator("attributes")
    @classmethod
    def _no_attributes(cls, v: dict | None) -> dict | None:
        if v:
            raise ValueError("file attributes are not supported (search filters cannot use them)")
        return v


class Search(Body):
    query: str | list[str]
    max_num_results: int = Field(10, ge=1, le=MAX_RESULTS)
    rewrite_query: bool = False
    filters: Any = Field(None, description="attribute filters are not supported")
    ranking_options: Any = Field(
        None, description="ranking options are not supported (hybrid BM25 + vectors)"
    )
    check_unsupported = field_validator("filters", "ranking_options")(_unsupported)

    @field_validator("query")
    @classmethod
    def _query(cls, v: str | list[str]) -> str:
        if isinstance(v, list):
            if len(v) != 1:
                raise ValueError("send one query (a string)")
            v = v[0]
        if not v.strip() or len(v) > MAX_QUERY_CHARS:
            raise ValueError(f"the query must have 1 to {MAX_QUERY_CHARS} characters")
        return v

    @field_validator("rewrite_query")
    @classmethod
    def _no_rewrite(cls, v: bool) -> bool:
        if v:
            raise ValueError("query rewriting is not supported")
        return v


def not_found(vs_id: str) -> api.APIError:
    return api.not_found(f"No such vector store: {vs_id}")


async def owned(gw: Gateway, key: ApiKey, vs_id: str) -> dict[str, str]:
    record = await uploads_of(gw).store(key.tenant, vs_id) if is_vector_store_id(vs_id) else None
    if record is None:
        raise not_found(vs_id)
    return record


async def shown(gw: Gateway, record: dict[str, str]) -> dict:
    return store_object(record, await uploads_of(gw).store_files(record["id"]))


async def _add(gw: Gateway, key: ApiKey, vs_id: str, file_id: str) -> dict[str, str]:
    uploads = uploads_of(gw)
    file = await owned_file(gw, key, file_id)
    if (
        await uploads.store_file(vs_id, file_id) is None
        and await uploads.store_size(vs_id) >= gw.cfg.store_max_files
    ):
        raise api.invalid_request(
            f"A vector store holds at most {gw.cfg.store_max_files} files.", param="file_id"
        )
    entry = await uploads.add_to_store(vs_id, file)
    try:
        await announce(gw, key.tenant, vs_id, file_id, "add", file["filename"], entry["generation"])
    except api.APIError:
        await uploads.remove_from_store(vs_id, file_id)
        raise
    return entry


@router.post("")
async def create_store(
    body: CreateStore, gw: Gateway = Depends(pipeline), key: ApiKey = Depends(principal)
) -> dict:
    for file_id in body.file_ids:
        await owned_file(gw, key, file_id)  # every file exists and is the caller's, before anything is made
    if len(set(body.file_ids)) > gw.cfg.store_max_files:
        raise api.invalid_request(
            f"A vector store holds at most {gw.cfg.store_max_files} files.", param="file_ids"
        )
    record = await uploads_of(gw).create_store(
        key.tenant, body.name or "", body.description or "", body.metadata or {}
    )
    for file_id in dict.fromkeys(body.file_ids):
        await _add(gw, key, record["id"], file_id)
    return await shown(gw, record)


@router.get("")
async def list_stores(
    limit: int = 20,
    order: str = "desc",
    after: str | None = None,
    before: str | None = None,
    gw: Gateway = Depends(pipeline),
    key: ApiKey = Depends(principal),
) -> dict:
    check_paging(order, limit)
    stores = [await shown(gw, r) for r in await uploads_of(gw).stores(key.tenant)]
    return page(stores, limit=limit, order=order, after=after, before=before)


@router.get("/{vs_id}")
async def get_store(vs_id: str, gw: Gateway = Depends(pipeline), key: ApiKey = Depends(principal)) -> dict:
    return await shown(gw, await owned(gw, key, vs_id))


@router.post("/{vs_id}")
async def update_store(
    vs_id: str, body: UpdateStore, gw: Gateway = Depends(pipeline), key: ApiKey = Depends(principal)
) -> dict:
    record = await owned(gw, key, vs_id)
    fields = {}
    if body.name is not None:
        fields["name"] = body.name
    if body.metadata is not None:
        fields["metadata"] = json.dumps(body.metadata)
    if fields:
        await uploads_of(gw).update_store(vs_id, fields)
        record.update(fields)
    return await shown(gw, record)


@router.delete("/{vs_id}")
async def delete_store(vs_id: str, gw: Gateway = Depends(pipeline), key: ApiKey = Depends(principal)) -> dict:
    await owned(gw, key, vs_id)
    uploads = uploads_of(gw)
    for entry in await uploads.store_files(vs_id):
        await announce(gw, key.tenant, vs_id, entry["file_id"], "remove")
    await uploads.delete_store(key.tenant, vs_id)
    return {"id": vs_id, "object": "vector_store.deleted", "deleted": True}


@router.post("/{vs_id}/files")
async def add_file(
    vs_id: str, body: AddFile, gw: Gateway = Depends(pipeline), key: ApiKey = Depends(principal)
) -> dict:
    await owned(gw, key, vs_id)
    return store_file_object(vs_id, await _add(gw, key, vs_id, body.file_id))


@router.get("/{vs_id}/files")
async def list_store_files(
    vs_id: str,
    limit: int = 20,
    order: str = "desc",
    after: str | None = None,
    before: str | None = None,
    filter: str | None = None,
    gw: Gateway = Depends(pipeline),
    key: ApiKey = Depends(principal),
) -> dict:
    check_paging(order, limit)
    if filter is not None and filter not in STORE_FILE_STATES:
        raise api.invalid_request(f"filter must be one of {', '.join(STORE_FILE_STATES)}.", param="filter")
    await owned(gw, key, vs_id)
    entries = [
        store_file_object(vs_id, e)
        for e in await uploads_of(gw).store_files(vs_id)
        if filter is None or e.get("status") == filter
    ]
    return page(entries, limit=limit, order=order, after=after, before=before)


@router.get("/{vs_id}/files/{file_id}")
async def get_store_file(
    vs_id: str, file_id: str, gw: Gateway = Depends(pipeline), key: ApiKey = Depends(principal)
) -> dict:
    await owned(gw, key, vs_id)
    entry = await uploads_of(gw).store_file(vs_id, file_id)
    if entry is None:
        raise api.not_found(f"No file {file_id} in vector store {vs_id}")
    return store_file_object(vs_id, entry)


@router.delete("/{vs_id}/files/{file_id}")
async def remove_store_file(
    vs_id: str, file_id: str, gw: Gateway = Depends(pipeline), key: ApiKey = Depends(principal)
) -> dict:
    await owned(gw, key, vs_id)
    uploads = uploads_of(gw)
    if await uploads.store_file(vs_id, file_id) is None:
        raise api.not_found(f"No file {file_id} in vector store {vs_id}")
    await announce(gw, key.tenant, vs_id, file_id, "remove")
    await uploads.remove_from_store(vs_id, file_id)
    return {"id": file_id, "object": "vector_store.file.deleted", "deleted": True}


@router.post("/{vs_id}/search")
async def search(
    vs_id: str, body: Search, gw: Gateway = Depends(pipeline), key: ApiKey = Depends(principal)
) -> dict:
    await owned(gw, key, vs_id)
    if gw.producer is None:
        raise api.unavailable("The gateway is not connected to the pipeline yet; try again.")
    try:
        result = await gw.searches.search(
            gw.producer, key.tenant, [vs_id], body.query, body.max_num_results, gw.cfg.search_timeout_s
        )
    except SearchTimeout as exc:
        raise api.APIError(504, str(exc), "server_error", code="search_timeout") from None
    except Exception:  # noqa: BLE001 - the broker did not take the call
        raise api.unavailable("The search could not be sent (broker unavailable); try again.") from None
    if not result.ok and result.meta.get("unavailable"):
        raise api.APIError(
            503,
            f"The search is unavailable: {result.error}",
            "service_unavailable",
            code="index_unavailable",
            headers={"Retry-After": "2"},
        )
    if not result.ok:
        raise api.APIError(502, f"The search failed: {result.error}", "server_error", code="search_failed")
    # a removed file's chunks leave the index when the tool processor handles its "remove" (soon after);
    # the store's file list changes at once, so a search never shows a file the store no longer has
    present = {e["file_id"] for e in await uploads_of(gw).store_files(vs_id)}
    hits = [h for h in json.loads(result.output)["results"] if h["file_id"] in present]
    return {
        "object": "vector_store.search_results.page",
        "search_query": [body.query],
        "data": [
            {
                "file_id": h["file_id"],
                "filename": h["filename"],
                "score": h["score"],
                "attributes": {},
                "content": [{"type": "text", "text": h["text"]}],
            }
            for h in hits
        ],
        "has_more": False,
        "next_page": None,
    }
