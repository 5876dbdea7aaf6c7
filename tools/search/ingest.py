"""An uploaded file into the index: extract, chunk, embed, index (replacing that file's earlier chunks)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from tools.search.extract import chunks, extract
from tools.search.index import ChunkIndex

MAX_FILE_BYTES = 32 << 20


@dataclass
class Ingested:
    file_id: str
    pages: int
    chunks: int
    seconds: float


def ingest(
    index: ChunkIndex, tenant: str, store_id: str, file_id: str, filename: str, data: bytes
) -> Ingested:
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"{filename!r} is larger than {MAX_FILE_BYTES >> 20} MiB")
    started = time.monotonic()
    document = extract(filename, data)
    pieces = chunks(document.text)
    count = index.add(tenant, store_id, file_id, filename, pieces) if pieces else 0
    return Ingested(file_id, document.pages, count, time.monotonic() - started)
