"""/v1/containers: the code interpreter's files, as OpenAI's containers API shows them.

A conversation's code interpreter runs in its container (`cntr_<conversation>`); the files its runs
write are kept by the tool processor in the durable store (tools/containers.py) and listed,
described and downloaded here, by the container's tenant alone (404 for anyone else, as for a
container that never existed). Containers are made by the code interpreter, not by a client, so
creating or deleting one is refused by name.
"""

from __future__ import annotations

import json
import posixpath
from urllib.parse import quote

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from common import sealing
from gateway import openai_api as api
from gateway.auth import principal
from gateway.deps import pipeline
from gateway.file_objects import check_paging, page
from gateway.pipeline import Gateway
from schemas import keys as K
from schemas.keys import ApiKey

router = APIRouter(prefix="/v1/containers", dependencies=[Depends(principal)])
#: what a download is served as: images for the chat page's <img>, text as text; anything else a download
MEDIA = {
    ".png": "image/png",
    ".jpg": "image/jpeg",
    ".jpeg": "image/jpeg",
    ".gif": "image/gif",
    ".csv": "text/csv; charset=utf-8",
    ".txt": "text/plain; charset=utf-8",
    ".json": "application/json",
}


async def _records(gw: Gateway, key: ApiKey, container_id: str) -> dict[str, dict]:
    """The container's file records by id; 404 unless the caller's tenant owns it."""
    if gw.files_redis is None:
        raise api.unavailable("Container files cannot be read: the gateway has no Redis.")
    raw = await gw.files_redis.hgetall(K.container(container_id)) if container_id.startswith("cntr_") else {}
    fields = {k.decode(): v for k, v in raw.items()}
    if fields.get("tenant", b"").decode() != key.tenant:
        raise api.not_found(f"No container with id {container_id!r}.")
    return {
        name.removeprefix("file:"): json.loads(value)
        for name, value in fields.items()
        if name.startswith("file:")
    }


def _file_object(container_id: str, record: dict) -> dict:
    return {
        "id": record["id"],
        "object": "container.file",
        "container_id": container_id,
        "path": record["path"],
        "bytes": record["bytes"],
        "created_at": record["created_at"],
        "source": "assistant",
    }


@router.get("/{container_id}")
async def get_container(container_id: str, gw: Gateway = Depends(pipeline), key: ApiKey = Depends(principal)):
    records = await _records(gw, key, container_id)
    created = min((r["created_at"] for r in records.values()), default=0)
    return {
        "id": container_id,
        "object": "container",
        "name": container_id,
        "status": "running",
        "created_at": created,
        "expires_after": {"anchor": "last_active_at", "minutes": K.CONTAINER_TTL_S // 60},
    }


@router.get("/{container_id}/files")
async def list_files(
    container_id: str,
    limit: int = 20,
    order: str = "desc",
    after: str | None = None,
    gw: Gateway = Depends(pipeline),
    key: ApiKey = Depends(principal),
):
    check_paging(order, limit)
    records = await _records(gw, key, container_id)
    objects = sorted(
        (_file_object(container_id, r) for r in records.values()), key=lambda o: (o["created_at"], o["path"])
    )
    return page(objects, limit=limit, order=order, after=after, before=None)


async def _record(gw: Gateway, key: ApiKey, container_id: str, file_id: str) -> dict:
    record = (await _records(gw, key, container_id)).get(file_id)
    if record is None:
        raise api.not_found(f"No file {file_id!r} in container {container_id!r}.")
    return record


@router.get("/{container_id}/files/{file_id}")
async def get_file(
    container_id: str, file_id: str, gw: Gateway = Depends(pipeline), key: ApiKey = Depends(principal)
):
    return _file_object(container_id, await _record(gw, key, container_id, file_id))


@router.get("/{container_id}/files/{file_id}/content")
async def file_content(
    container_id: str, file_id: str, gw: Gateway = Depends(pipeline), key: ApiKey = Depends(principal)
) -> Response:
    record = await _record(gw, key, container_id, file_id)
    raw = await gw.files_redis.get(K.container_file(file_id))
    data = await sealing.unblocked(sealing.open_stored, raw)  # None: expired or erased
    if data is None:
        raise api.not_found(f"The file {file_id!r} has expired.")
    name = posixpath.basename(record["path"])
    media = MEDIA.get(posixpath.splitext(name)[1].lower(), "application/octet-stream")
    # never rendered as a page in the gateway's origin: images and text as themselves, the rest a download
    disposition = "inline" if media.startswith(("image/", "text/")) else "attachment"
    return Response(
        data,
        media_type=media,
        headers={
            "Content-Disposition": f"{disposition}; filename*=UTF-8''{quote(name)}",
            "X-Content-Type-Options": "nosniff",
            "Content-Security-Policy": "sandbox",
        },
    )


@router.post("")
@router.delete("/{container_id}")
async def refused() -> None:
    raise api.APIError(
        400,
        "Containers are made by the code interpreter, one per conversation, and expire on "
        "their own; they cannot be created or deleted by a client.",
        "invalid_request_error",
        code="unsupported_operation",
    )
