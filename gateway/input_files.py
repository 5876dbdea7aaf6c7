"""`input_file` parts of a Responses input: read to text before the request goes on (common/documents.py:
PDF by pypdf, HTML by trafilatura, text as it is), so the model reads a file as its text.

A file is an upload of the key's tenant (`file_id`, read from the durable store) or sent inline
(`file_data`: base64 or a data: URL, with `filename`, whose ending names the kind). `file_url` is
refused: this gateway fetches nothing on a client's behalf (the web tool does, behind its allowlist).
The text read is set on the part (`text`), so the response's stored input and a conversation's items
keep what the model read. Bounds: MAX_FILES a request, the upload limit per file, MAX_FILE_CHARS of
text from each (the context trims or refuses the rest, as `truncation` says).
"""

from __future__ import annotations

import asyncio
import base64
import binascii

from common.documents import UnsupportedFile, extract
from gateway import openai_api as api
from gateway.pipeline import Gateway
from gateway.responses_api import InputFile, MessageItem, ResponseCreate

MAX_FILES = 10
MAX_FILE_CHARS = 200_000


def _inline(part: InputFile, where: str) -> bytes:
    data = part.file_data or ""
    if data.startswith("data:"):
        data = data.partition(",")[2]
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise api.invalid_request(
            f"{where}.file_data is not base64 (or a base64 data: URL).", f"{where}.file_data"
        ) from None


async def read_files(gw: Gateway, tenant: str, body: ResponseCreate) -> int:
    """Read every input_file part of `body` into its `text`; how many there were."""
    parts = [
        (f"input[{i}].content[{j}]", part)
        for i, item in enumerate(body.input if isinstance(body.input, list) else [])
        if isinstance(item, MessageItem) and isinstance(item.content, list)
        for j, part in enumerate(item.content)
        if isinstance(part, InputFile)
    ]
    if len(parts) > MAX_FILES:
        raise api.invalid_request(f"An input may hold at most {MAX_FILES} files.", "input")
    for where, part in parts:
        if part.file_url is not None:
            raise api.invalid_request(
                "file_url is not fetched by this server: upload the file (POST /v1/files) and "
                "send its file_id, or send it as file_data.",
                f"{where}.file_url",
            )
        if part.file_id is not None:
            record = await gw.uploads.file(tenant, part.file_id) if gw.uploads is not None else None
            data = await gw.uploads.content(part.file_id) if record is not None else None
            if data is None:
                raise api.APIError(
                    404,
                    f"No file with id {part.file_id!r}.",
                    "invalid_request_error",
                    param=f"{where}.file_id",
                    code="not_found",
                )
            filename = record["filename"]
        elif part.file_data is not None:
            if part.filename is None:
                raise api.invalid_request(
                    "file_data needs its filename (the ending names the kind: .pdf, .txt, .md, .html).",
                    f"{where}.filename",
                )
            data, filename = _inline(part, where), part.filename
            if len(data) > gw.cfg.file_max_bytes:
                raise api.invalid_request(
                    f"A file may hold at most {gw.cfg.file_max_bytes} bytes.", f"{where}.file_data"
                )
        else:
            raise api.invalid_request("An input_file needs file_id or file_data.", where)
        try:
            document = await asyncio.to_thread(extract, filename, data)
        except UnsupportedFile as exc:
            raise api.invalid_request(str(exc), where) from None
        text = document.text.strip()
        if not text:
            raise api.invalid_request(
                f"No text could be read from {filename!r} (a scanned PDF has none).", where
            )
        part.text = f"[{filename}]\n{text[:MAX_FILE_CHARS]}"
    return len(parts)
