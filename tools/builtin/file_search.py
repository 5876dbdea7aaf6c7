"""file_search: hybrid search (BM25 + MiniLM vectors) over the caller's tenant's uploaded files in Weaviate.

Arguments: {"query": "...", "vector_store_ids": ["vs_..."], "max_num_results": 5}. Output: a JSON
object {"results": [{file_id, filename, vector_store_id, chunk_index, score, text}]}, best first.
The tenant is the call's own (the event's), never an argument.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict

from common import vectordb
from common.vectordb import Breaker
from schemas import ToolCall
from tools.base import Outcome, ToolError, ToolUnavailable
from tools.config import tool_settings

MAX_QUERY_CHARS = 2000
MAX_RESULTS = 20


class FileSearch:
    """While Weaviate is away a call fails within `index_timeout_s` (5 s), and at once for a pause after
    that (0.25 s doubling to 2 s, common.vectordb.Breaker), with a ToolUnavailable error that says
    so; the next call after the pause connects a new client, so search works again within seconds of
    Weaviate's return."""

    name = "file_search"

    def __init__(self) -> None:
        self._index = None
        self.breaker = Breaker()

    def warm_up(self) -> None:
        from tools.search.embed import embedder

        embedder()

    def _search(self, tenant: str, stores: list[str], query: str, k: int):
        from tools.search.index import ChunkIndex

        index = self._index
        if index is None:
            index = self._index = ChunkIndex.connect(timeout_s=tool_settings().index_timeout_s)
        return index.search(tenant, stores, query, k)

    def _forget(self) -> None:
        index, self._index = self._index, None
        if index is not None:
            index.close()

    def unavailable(self) -> ToolUnavailable:
        return ToolUnavailable(
            f"the file index (Weaviate) is unavailable ({self.breaker.last_error}); try again shortly",
            "weaviate",
        )

    async def run(self, call: ToolCall, args: dict) -> Outcome:
        query, stores = args.get("query"), args.get("vector_store_ids")
        k = args.get("max_num_results", 5)
        if not isinstance(query, str) or not query.strip() or len(query) > MAX_QUERY_CHARS:
            raise ToolError(f'file_search needs a "query" of 1 to {MAX_QUERY_CHARS} characters')
        if not isinstance(stores, list) or not stores or not all(isinstance(s, str) for s in stores):
            raise ToolError('file_search needs "vector_store_ids": a list of vector store ids')
        if not isinstance(k, int) or not 1 <= k <= MAX_RESULTS:
            raise ToolError(f"max_num_results must be an integer from 1 to {MAX_RESULTS}")
        if not self.breaker.allow():
            raise self.unavailable()
        timeout_s = tool_settings().index_timeout_s
        try:
            # the client's own timeouts end the thread's work; this bounds the call whatever it waits on
            async with asyncio.timeout(timeout_s + 1):
                hits = await asyncio.to_thread(self._search, call.tenant, stores, query, k)
        except Exception as exc:
            await asyncio.to_thread(self._forget)
            if isinstance(exc, TimeoutError) or not await vectordb.aready(1.0):
                self.breaker.failed(
                    f"no answer within {timeout_s:g} s" if isinstance(exc, TimeoutError) else exc
                )
                raise self.unavailable() from exc
            raise ToolError(f"file search failed: {type(exc).__name__}: {exc}") from exc
        self.breaker.succeeded()
        return Outcome(json.dumps({"results": [asdict(h) for h in hits]}), meta={"results": str(len(hits))})


TOOL = FileSearch()
