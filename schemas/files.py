"""Uploaded files and vector stores: the ingestion event, the kinds of file searched, and the state
of a file in a vector store (kept in Redis, keys in `schemas/keys.py`).

The gateway writes a `FileIngest` to `ts.files.ingest` when a file is added to (or taken out of)
a vector store; the tool processor's ingestion loop extracts, chunks, embeds and indexes it in
Weaviate and records the outcome in the store-file record (`StoreFile` fields below), which
`GET /v1/vector_stores/{id}` and `.../files/{file_id}` read.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from schemas.base import Event

#: File name endings searched, and the kind each is read as.
FILE_KINDS = {
    "txt": "txt",
    "text": "txt",
    "md": "md",
    "markdown": "md",
    "pdf": "pdf",
    "html": "html",
    "htm": "html",
}
MEDIA_TYPES = {"txt": "text/plain", "md": "text/markdown", "pdf": "application/pdf", "html": "text/html"}
#: Purposes an upload may name (the ones whose files this system uses: file search).
PURPOSES = ("assistants", "user_data")

#: States of a file in a vector store (OpenAI's names).
IN_PROGRESS, COMPLETED, FAILED, CANCELLED = "in_progress", "completed", "failed", "cancelled"
STORE_FILE_STATES = (IN_PROGRESS, COMPLETED, FAILED, CANCELLED)


def file_kind(filename: str) -> str | None:
    """The kind a file is read as, from its name's ending; None when it is not searched."""
    ext = filename.rsplit(".", 1)[-1].lower() if "." in filename else ""
    return FILE_KINDS.get(ext)


def ingest_key(vector_store_id: str, file_id: str) -> str:
    """The record key on ts.files.ingest: one file in one store, so its add and remove keep their order."""
    return f"{vector_store_id}:{file_id}"


class FileIngest(Event, tag="file_ingest"):
    """Index an uploaded file into a vector store ("add"), or take its chunks out ("remove").

    `generation` is the store-file record's, set when the file was added: an "add" whose
    generation no longer matches the record (the file was removed, or removed and added again)
    is passed over, so each add is indexed once and a removed file is never brought back.
    The tenant is the owner's (from the API key), the one Weaviate tenant the chunks go to.
    """

    content: ClassVar[frozenset[str]] = frozenset({"filename"})  # sealed (schemas/sealing.py)

    vector_store_id: str
    file_id: str
    action: Literal["add", "remove"] = "add"
    filename: str = ""
    generation: str = ""
