"""Vector store search as a tool call: the gateway writes a `file_search` ToolCall to ts.tool.calls and
waits for its ToolResult on ts.tool.results, which the tool processor writes (the same tool, the
same index and the same once-per-call rules as a model's file_search call; every search is an
event on the log).

One group-less reader of every ts.tool.results partition, started on the first search, positioned
at the end before any call is written, hands each result to the search waiting for its call id.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time

from aiokafka.structs import TopicPartition

from common.unblocked import unblocked
from producers import decode_record, publish, start_consumer
from schemas import DecodeError, ToolCall, ToolResult
from schemas.ids import new_request_id
from topics.registry import TOOL_CALLS, TOOL_RESULTS

log = logging.getLogger(__name__)


class SearchTimeout(Exception):
    pass


class ToolSearches:
    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        self.waiting: dict[str, asyncio.Future] = {}
        self.consumer = None
        self._task: asyncio.Task | None = None
        self._starting = asyncio.Lock()

    async def _reader(self) -> None:
        async with self._starting:
            if self._task is not None and not self._task.done():
                return
            if self.consumer is not None:
                with contextlib.suppress(Exception):
                    await self.consumer.stop()
            consumer = await start_consumer(group=None, bootstrap=self.bootstrap)
            partitions = consumer.partitions_for_topic(TOOL_RESULTS.name)
            if not partitions:
                await consumer._client.force_metadata_update()
                partitions = consumer.partitions_for_topic(TOOL_RESULTS.name) or set()
            tps = [TopicPartition(TOOL_RESULTS.name, p) for p in sorted(partitions)]
            if not tps:
                await consumer.stop()
                raise RuntimeError(
                    f"topic {TOOL_RESULTS.name} does not exist (run `tokenstream topics apply`)"
                )
            consumer.assign(tps)
            await consumer.seek_to_end(*tps)
            for tp in tps:
                await consumer.position(tp)  # resolved now: nothing written after this is missed
            self.consumer = consumer
            self._task = asyncio.create_task(self._read(consumer), name="gateway-tool-results")

    async def _read(self, consumer) -> None:
        try:
            while True:
                batches = await consumer.getmany(timeout_ms=500)
                for records in batches.values():
                    for record in records:
                        try:
                            result = await unblocked(decode_record, record, TOOL_RESULTS)
                        except DecodeError:
                            continue  # the tool processor dead-letters what it cannot read; not ours
                        future = self.waiting.get(result.call_id)
                        if future is not None and not future.done():
                            future.set_result(result)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the next search starts a new reader
            log.warning("the tool results reader stopped: %s", exc)
            for future in self.waiting.values():
                if not future.done():
                    future.set_exception(SearchTimeout("the tool results could not be read"))

    async def search(
        self, producer, tenant: str, store_ids: list[str], query: str, k: int, timeout_s: float
    ) -> ToolResult:
        await self._reader()
        call = ToolCall(
            request_id=new_request_id(0, time.time()),
            call_id=f"search-{secrets.token_hex(12)}",
            tenant=tenant,
            conversation_id="",
            name="file_search",
            arguments=json.dumps({"query": query, "vector_store_ids": store_ids, "max_num_results": k}),
        )
        future = asyncio.get_running_loop().create_future()
        self.waiting[call.call_id] = future
        try:
            await publish(producer, TOOL_CALLS, call, key=call.request_id)
            async with asyncio.timeout(timeout_s):
                return await future
        except TimeoutError:
            raise SearchTimeout(
                f"no search result within {timeout_s:g} s (is the tool processor running?)"
            ) from None
        finally:
            self.waiting.pop(call.call_id, None)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        if self.consumer is not None:
            with contextlib.suppress(Exception):
                await self.consumer.stop()
