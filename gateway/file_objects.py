"""OpenAI's shapes of files, vector stores and their files; list pages; the ingestion events the routes
write."""

from __future__ import annotations

import json

from gateway import openai_api as api
from gateway.pipeline import Gateway
from gateway.uploads import file_counts
from producers import publish
from schemas import FileIngest
from schemas.files import COMPLETED, IN_PROGRESS, ingest_key
from topics.registry import FILE_INGEST

# The chunking the ingestion applies (tools/search/extract.py: ~90 words, one sentence of overlap),
# described in OpenAI's terms (a word is about 1.3 tokens).
CHUNKING = {"type": "static", "static": {"max_chunk_size_tokens": 120, "chunk_overlap_tokens": 20}}


def file_object(record: dict[str, str]) -> dict:
    return {
        "id": record["id"],
        "object": "file",
        "bytes": int(record["bytes"]),
        "created_at": int(record["created_at"]),
        "filename": record["filename"],
        "purpose": record["purpose"],
        "status": "processed",
        "status_details": None,
        "expires_at": None,
    }


def store_object(record: dict[str, str], entries: list[dict[str, str]]) -> dict:
    counts = file_counts(entries)
    last = max([int(record["created_at"])] + [int(float(e.get("updated_at") or 0)) for e in entries])
    return {
        "id": record["id"],
        "object": "vector_store",
        "created_at": int(record["created_at"]),
        "name": record.get("name") or None,
        "description": record.get("description") or None,
        "usage_bytes": sum(int(e.get("bytes") or 0) for e in entries if e.get("status") == COMPLETED),
        "file_counts": counts,
        "status": IN_PROGRESS if counts[IN_PROGRESS] else COMPLETED,
        "expires_after": None,
        "expires_at": None,
        "last_active_at": last,
        "metadata": json.loads(record.get("metadata") or "{}"),
    }


def store_file_object(vs_id: str, entry: dict[str, str]) -> dict:
    error = (
        {"code": entry["error_code"], "message": entry.get("error", "")} if entry.get("error_code") else None
    )
    return {
        "id": entry["file_id"],
        "object": "vector_store.file",
        "vector_store_id": vs_id,
        "created_at": int(entry["created_at"]),
        "status": entry["status"],
        "last_error": error,
        "usage_bytes": int(entry.get("bytes") or 0) if entry["status"] == COMPLETED else 0,
        "chunking_strategy": CHUNKING,
        "attributes": {},
    }


def page(items: list[dict], *, limit: int, order: str, after: str | None, before: str | None) -> dict:
    """A cursor page of `items` (oldest first on entry) in OpenAI's list shape."""
    items = items if order == "asc" else items[::-1]
    ids = [i["id"] for i in items]
    if after is not None:
        items = items[ids.index(after) + 1 :] if after in ids else []
    if before is not None:
        ids = [i["id"] for i in items]
        items = items[: ids.index(before)] if before in ids else []
    shown = items[:limit]
    return {
        "object": "list",
        "data": shown,
        "first_id": shown[0]["id"] if shown else None,
        "last_id": shown[-1]["id"] if shown else None,
        "has_more": len(items) > limit,
    }


async def multipart_form(request, what: str, max_fields: int, max_part_size: int):
    """The request's multipart form (one file at most), or a 400: not multipart (`what` says what to send),
    malformed, or over a limit. The caller closes it."""
    if not request.headers.get("content-type", "").lower().startswith("multipart/form-data"):
        raise api.APIError(
            400,
            f"Send {what} as multipart/form-data.",
            "invalid_request_error",
            code="unsupported_content_type",
        )
    try:
        return await request.form(max_files=1, max_fields=max_fields, max_part_size=max_part_size)
    except Exception as exc:  # noqa: BLE001 - starlette's parser: malformed body or a limit
        raise api.invalid_request(f"The multipart body could not be read: {exc}") from None


def check_paging(order: str, limit: int, most: int = 100) -> None:
    """A list route's `order` and `limit` (1 to `most`), or a 400 naming the one that is wrong."""
    if order not in ("asc", "desc"):
        raise api.invalid_request('order must be "asc" or "desc".', param="order")
    if not 1 <= limit <= most:
        raise api.invalid_request(f"limit must be from 1 to {most}.", param="limit")


def uploads_of(gw: Gateway):
    if gw.uploads is None:
        raise api.unavailable("Files cannot be stored: the gateway has no Redis.")
    return gw.uploads


async def announce(
    gw: Gateway, tenant: str, vs_id: str, file_id: str, action: str, filename: str = "", generation: str = ""
) -> None:
    """Write the ingestion event of one file in one store (503 when the pipeline cannot take it)."""
    if gw.producer is None:
        raise api.unavailable("The gateway is not connected to the pipeline yet; try again.")
    event = FileIngest(
        request_id=ingest_key(vs_id, file_id),
        tenant=tenant,
        vector_store_id=vs_id,
        file_id=file_id,
        action=action,
        filename=filename,
        generation=generation,
    )
    try:
        await publish(gw.producer, FILE_INGEST, event, key=ingest_key(vs_id, file_id))
    except Exception:  # noqa: BLE001 - the broker did not acknowledge it
        raise api.unavailable(
            "The file could not be queued for indexing (broker unavailable); try again."
        ) from None
