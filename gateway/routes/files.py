"""/v1/files: upload (multipart), list, get, content, delete; every file belongs to the key's tenant.

A file of another tenant is answered 404, exactly like one that never existed. Uploads are
limited in size (per file and per tenant) and kind (txt, md, pdf, html: what file search reads).
"""

from __future__ import annotations

import posixpath
from urllib.parse import quote

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from starlette.datastructures import UploadFile

from gateway import openai_api as api
from gateway.auth import principal
from gateway.deps import pipeline
from gateway.file_objects import announce, check_paging, file_object, multipart_form, page, uploads_of
from gateway.pipeline import Gateway
from gateway.uploads import QuotaExceeded
from schemas.files import FILE_KINDS, PURPOSES, file_kind
from schemas.ids import is_file_id
from schemas.keys import ApiKey

router = APIRouter(prefix="/v1/files", dependencies=[Depends(principal)])
MAX_FILENAME = 255


def not_found(file_id: str) -> api.APIError:
    return api.not_found(f"No such File object: {file_id}")


async def owned(gw: Gateway, key: ApiKey, file_id: str) -> dict[str, str]:
    record = await uploads_of(gw).file(key.tenant, file_id) if is_file_id(file_id) else None
    if record is None:
        raise not_found(file_id)
    return record


def _checked(filename: str, data: bytes, max_bytes: int) -> str:
    """The file's kind, or a 4xx saying why it cannot be kept."""
    kind = file_kind(filename)
    if kind is None:
        raise api.APIError(
            400,
            f"Files of type {posixpath.splitext(filename)[1] or '(none)'!r} are not supported: "
            f"upload {', '.join('.' + k for k in FILE_KINDS)}.",
            "invalid_request_error",
            param="file",
            code="unsupported_file",
        )
    if not data:
        raise api.APIError(
            400, "The file is empty.", "invalid_request_error", param="file", code="empty_file"
        )
    if len(data) > max_bytes:
        raise api.APIError(
            413,
            f"The file has {len(data):,} bytes; the limit is {max_bytes:,}.",
            "invalid_request_error",
            param="file",
            code="file_too_large",
        )
    if kind == "pdf":
        if not data.startswith(b"%PDF-"):
            raise api.APIError(
                400,
                "The file is named .pdf but is not a PDF.",
                "invalid_request_error",
                param="file",
                code="invalid_file",
            )
    else:
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            raise api.APIError(
                400,
                f"A .{kind} file must be UTF-8 text.",
                "invalid_request_error",
                param="file",
                code="invalid_file",
            ) from None
    return kind


@router.post("")
async def upload(request: Request, gw: Gateway = Depends(pipeline), key: ApiKey = Depends(principal)) -> dict:
    uploads = uploads_of(gw)
    form = await multipart_form(request, "a file with the fields `file` and `purpose`", 4, 1024)
    try:
        unknown = sorted(set(form.keys()) - {"file", "purpose"})
        if unknown:
            raise api.invalid_request(
                f"Unsupported field {unknown[0]!r}: send only `file` and `purpose`.", param=unknown[0]
            )
        purpose, upload_ = form.get("purpose"), form.get("file")
        if not isinstance(purpose, str) or not purpose:
            raise api.invalid_request("`purpose` is required.", param="purpose")
        if purpose not in PURPOSES:
            raise api.invalid_request(
                f"Purpose {purpose!r} is not supported here: use one of "
                f"{', '.join(PURPOSES)} (files for file search).",
                param="purpose",
            )
        if not isinstance(upload_, UploadFile):
            raise api.invalid_request("`file` is required: a file part of the multipart body.", param="file")
        filename = posixpath.basename((upload_.filename or "").replace("\\", "/")).strip()
        if not filename or len(filename) > MAX_FILENAME:
            raise api.invalid_request(
                f"The file needs a name of 1 to {MAX_FILENAME} characters.", param="file"
            )
        data = await upload_.read(gw.cfg.file_max_bytes + 1)
    finally:
        await form.close()
    _checked(filename, data, gw.cfg.file_max_bytes)
    try:
        record = await uploads.create_file(key.tenant, filename, purpose, data)
    except QuotaExceeded as exc:
        raise api.APIError(
            400, str(exc), "invalid_request_error", param="file", code="storage_quota_exceeded"
        ) from None
    return file_object(record)


@router.get("")
async def list_files(
    purpose: str | None = None,
    limit: int = 10_000,
    order: str = "desc",
    after: str | None = None,
    gw: Gateway = Depends(pipeline),
    key: ApiKey = Depends(principal),
) -> dict:
    check_paging(order, limit, most=10_000)
    records = await uploads_of(gw).files(key.tenant)
    objects = [file_object(r) for r in records if purpose is None or r["purpose"] == purpose]
    return page(objects, limit=limit, order=order, after=after, before=None)


@router.get("/{file_id}")
async def get_file(file_id: str, gw: Gateway = Depends(pipeline), key: ApiKey = Depends(principal)) -> dict:
    return file_object(await owned(gw, key, file_id))


@router.get("/{file_id}/content")
async def file_content(
    file_id: str, gw: Gateway = Depends(pipeline), key: ApiKey = Depends(principal)
) -> Response:
    record = await owned(gw, key, file_id)
    data = await uploads_of(gw).content(file_id)
    if data is None:
        raise not_found(file_id)
    # never rendered in the gateway's origin (an uploaded page's scripts would run beside the chat
    # page's key): text as text/plain, HTML and PDF as a download
    text = file_kind(record["filename"]) in ("txt", "md")
    return Response(
        data,
        media_type="text/plain; charset=utf-8" if text else "application/octet-stream",
        headers={
            "Content-Disposition": f"attachment; filename*=UTF-8''{quote(record['filename'])}",
            "X-Content-Type-Options": "nosniff",
            "Content-Security-Policy": "sandbox",
        },
    )


@router.delete("/{file_id}")
async def delete_file(
    file_id: str, gw: Gateway = Depends(pipeline), key: ApiKey = Depends(principal)
) -> dict:
    """Deleting a file also takes it out of every vector store it was in (its chunks are removed)."""
    record = await owned(gw, key, file_id)
    uploads = uploads_of(gw)
    for vs_id in await uploads.stores_of(file_id):  # the remove events first: no chunk outlives the file
        await announce(gw, key.tenant, vs_id, file_id, "remove")
    await uploads.delete_file(key.tenant, record)
    return {"id": file_id, "object": "file", "deleted": True}
