"""file_search: hybrid search (BM25 + MiniLM vectors) over the caller's tenant's uploaded files in Weaviate.

Arguments: {"query": "...", "vector_store_ids": ["vs_..."], "max_num_results": 5}. Output: a JSON
object {"results": [{file_id, filename, vector_store_id, chunk_index, score, text}]}, best first.
The tenant is the call's own (the event's), never an argument.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict

from schemas import ToolCall
from tools.base import Outcome, ToolError

MAX_QUERY_CHARS = 2000
MAX_RESULTS = 20


class FileSearch:
    name = "file_search"

    def __init__(self) -> None:
        self._index = None

    def warm_up(self) -> None:
        from tools.search.embed import embedder

        embedder()

    def _search(self, tenant: str, stores: list[str], query: str, k: int):
        from tools.search.index import ChunkIndex

        if self._index is None:
            self._index = ChunkIndex.connect()
        return self._index.search(tenant, stores, query, k)

    async def run(self, call: ToolCall, args: dict) -> Outcome:
        query, stores = args.get("query"), args.get("vector_store_ids")
        k = args.get("max_num_results", 5)
        if not isinstance(query, str) or not query.strip() or len(query) > MAX_QUERY_CHARS:
            raise ToolError(f"file_search needs a \"query\" of 1 to {MAX_QUERY_CHARS} characters")
        if not isinstance(stores, list) or not stores or not all(isinstance(s, str) for s in stores):
            raise ToolError("file_search needs \"vector_store_ids\": a list of vector store ids")
        if not isinstance(k, int) or not 1 <= k <= MAX_RESULTS:
            raise ToolError(f"max_num_results must be an integer from 1 to {MAX_RESULTS}")
        hits = await asyncio.to_thread(self._search, call.tenant, stores, query, k)
        return Outcome(json.dumps({"results": [asdict(h) for h in hits]}), meta={"results": str(len(hits))})


TOOL = FileSearch()
