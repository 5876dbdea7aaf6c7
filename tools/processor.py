"""The tool processor: ToolCall events on ts.tool.calls -> ToolResult events on ts.tool.results.

One consumer group (`ts-tools`); add processes to scale (the calls' partitions are shared among
them). Calls of one partition run in order, partitions run side by side (at most `concurrency` calls
at once). A call's offset is committed only after its result is acknowledged by the broker, so a
processor that dies mid-call leaves it to the next one; the ledger (tools/ledger.py) makes sure a
call runs to completion once and its result is replayed, never recomputed, and never published twice
(tools/published_check.py). Calls naming a tool this processor does not serve (function tools,
answered by the client) are passed over.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

from aiokafka.structs import ConsumerRecord, TopicPartition

from common import tracing
from common.config import settings
from common.unblocked import unblocked
from producers import (
    commit_past,
    dead_letter,
    decode_record,
    publish,
    start_consumer,
    start_producer,
    stop_clients,
)
from producers.membership import GroupWatch, member_client_id
from schemas import DecodeError, ToolCall, ToolResult, TraceContext
from tools.base import Outcome, Tool, ToolError, ToolUnavailable, builtin_tools
from tools.config import ToolSettings, tool_settings
from tools.ledger import CallLedger
from tools.published_check import in_log
from topics.registry import TOOL_CALLS, TOOL_RESULTS, processor_group

GROUP = processor_group("tools")
log = logging.getLogger("tools.processor")


async def run_tool(tool: Tool, call: ToolCall, timeout_s: float) -> ToolResult:
    """Run one call and describe its outcome; a tool's failure is a result, never an exception."""
    started = time.monotonic()
    try:
        args = json.loads(call.arguments or "{}")
        if not isinstance(args, dict):
            raise ToolError("arguments must be a JSON object")
        try:
            async with asyncio.timeout(timeout_s):
                outcome = await tool.run(call, args)
        except TimeoutError:
            raise ToolError(f"{call.name} took longer than {timeout_s:g} s and was stopped") from None
    except json.JSONDecodeError as exc:
        outcome = Outcome("", ok=False, error=f"arguments are not valid JSON: {exc}")
    except ToolUnavailable as exc:
        outcome = Outcome("", ok=False, error=str(exc), meta={"unavailable": exc.dependency})
    except ToolError as exc:
        outcome = Outcome("", ok=False, error=str(exc))
    except Exception as exc:
        log.exception("tool %s failed on call %s", call.name, call.call_id)
        outcome = Outcome("", ok=False, error=f"internal error in tool {call.name}: {type(exc).__name__}")
    return ToolResult(
        request_id=call.request_id,
        conversation_id=call.conversation_id,
        tenant=call.tenant,
        call_id=call.call_id,
        name=call.name,
        ok=outcome.ok,
        output=outcome.output,
        error=outcome.error,
        duration_s=time.monotonic() - started,
        meta=outcome.meta,
    )


class ToolProcessor:
    def __init__(self, cfg: ToolSettings | None = None, tools: dict[str, Tool] | None = None) -> None:
        self.cfg = cfg or tool_settings()
        self.tools = tools if tools is not None else builtin_tools()
        self.owner = f"tools-{uuid.uuid4().hex[:12]}"
        self.ledger = CallLedger(self.owner, self.cfg.claim_lease_s)
        self.slots = asyncio.Semaphore(self.cfg.concurrency)
        self.producer = self.consumer = None
        self.watch: GroupWatch | None = None  # the consumer's standing in its group, for /health/ready

    async def handle(
        self, call: ToolCall, key: str, trace: TraceContext | None = None, since_ms: int = 0
    ) -> str:
        """Bring `call` (written at `since_ms`) to a published result; returns what happened (for the log).

        Running a call and replaying its stored result both need the claim, so while another live
        processor runs or publishes it this one waits, then finds it published."""
        while True:
            if await self.ledger.published(call.call_id):
                return "already published"
            if await self.ledger.claim(call.call_id):
                break
            await asyncio.sleep(min(1.0, self.cfg.claim_lease_s / 4))  # another live processor holds it
        try:
            stored = await self.ledger.result(call.call_id)
            if stored is not None:  # its processor died after the run: publish the result it stored
                if await in_log(call.call_id, key, since_ms):  # ...unless the broker has it already
                    await self.ledger.mark_published(call.call_id)
                    return "found published in the log"
                await self._publish(stored, key, trace)
                return "replayed"
            async with self.slots, self.ledger.holding(call.call_id):
                result = await run_tool(self.tools[call.name], call, self.cfg.call_timeout_s)
            result = await self.ledger.complete(result)
            await self._publish(result, key, trace)
        except BaseException:
            await asyncio.shield(self.ledger.release(call.call_id))
            raise
        return "ran" if result.ok else f"ran, failed: {result.error}"

    async def _publish(self, result: ToolResult, key: str, trace: TraceContext | None = None) -> None:
        await publish(self.producer, TOOL_RESULTS, result, key=key, trace=trace)
        await self.ledger.mark_published(result.call_id)

    async def _partition(self, tp: TopicPartition, records: list[ConsumerRecord]) -> None:
        for record in records:
            try:
                call = await unblocked(decode_record, record, TOOL_CALLS)
            except DecodeError as exc:
                await dead_letter(self.producer, record, exc, group=GROUP)
                call = None
            if call is not None and call.name in self.tools:
                key = record.key.decode() if record.key else call.request_id
                with tracing.hop(
                    f"execute_tool {call.name}",
                    tracing.parent_of(record.headers),
                    role="tools",
                    attributes={
                        **tracing.tool_attributes(call),
                        **tracing.record_attributes(tp.topic, tp.partition, record.offset, GROUP),
                    },
                ) as span:
                    what = await self.handle(call, key, span.trace, since_ms=record.timestamp)
                    span.set({"tokenstream.tool.outcome": what})
                log.info("call %s (%s) of %s: %s", call.call_id, call.name, call.request_id, what)
            if not await commit_past(self.consumer, tp, record.offset, log):
                return

    async def run(self, ready: asyncio.Event | None = None) -> None:
        for tool in self.tools.values():
            if hasattr(tool, "warm_up"):
                await asyncio.to_thread(tool.warm_up)
        tracing.setup("tools")
        self.producer = await start_producer()
        # few records per poll, and a poll interval that outlasts them all run back to back, so a
        # batch of slow calls never makes the group think this process is dead
        batch = 2 * self.cfg.concurrency
        slowest_s = self.cfg.call_timeout_s + 5
        client_id = member_client_id("tools")
        self.consumer = await start_consumer(
            TOOL_CALLS,
            group=GROUP,
            from_beginning=True,
            max_poll_records=batch,
            max_poll_interval_ms=int(max(300.0, batch * slowest_s + 60) * 1000),
            client_id=client_id,
        )
        self.watch = GroupWatch(
            settings().kafka_bootstrap,
            GROUP,
            client_id,
            topic_partitions=lambda: len(self.consumer.partitions_for_topic(TOOL_CALLS.name) or ()),
        )
        watching = asyncio.create_task(self.watch.run())
        log.info("tool processor %s serving %s (group %s)", self.owner, ", ".join(sorted(self.tools)), GROUP)
        if ready is not None:
            ready.set()
        try:
            while True:
                batches = await self.consumer.getmany(timeout_ms=500)
                await asyncio.gather(*(self._partition(tp, records) for tp, records in batches.items()))
        finally:
            watching.cancel()
            await asyncio.gather(watching, return_exceptions=True)
            await self.close()

    async def close(self) -> None:
        await stop_clients(self.consumer, self.producer)
        await self.ledger.close()
