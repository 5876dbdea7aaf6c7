"""Whether a stored result is in the log already: the check before a result is replayed.

The ledger (tools/ledger.py) marks a call published once the broker acknowledged its result. A
processor killed after its result reached the broker and before that mark leaves a stored result
without the mark; the next processor to read the call looks for the result in ts.tool.results before
it publishes it again, so a kill at that moment does not write the result twice.

The result is keyed like its call, so it lies in the partition the producer's default partitioner
picks for that key, written after the call itself: the scan starts at the call's timestamp (less a
margin for clocks) and stops at the partition's end as it is when the check begins.
"""

from __future__ import annotations

from aiokafka.partitioner import DefaultPartitioner
from aiokafka.structs import TopicPartition

from common.unblocked import unblocked
from producers import start_consumer
from schemas import DecodeError, ToolResult, decode
from topics.registry import TOOL_RESULTS

#: the scan starts this long before the call was written (clock differences between hosts)
CLOCK_MARGIN_MS = 5_000


async def in_log(call_id: str, key: str, since_ms: int) -> bool:
    """True when ts.tool.results holds a result of `call_id` (keyed `key`) written after `since_ms`."""
    consumer = await start_consumer(group=None, from_beginning=True)
    try:
        partitions = sorted(consumer.partitions_for_topic(TOOL_RESULTS.name) or ())
        if not partitions:
            await consumer._client.force_metadata_update()
            partitions = sorted(consumer.partitions_for_topic(TOOL_RESULTS.name) or ())
        if not partitions:
            raise RuntimeError(f"topic {TOOL_RESULTS.name} does not exist (run `tokenstream topics apply`)")
        tp = TopicPartition(TOOL_RESULTS.name, DefaultPartitioner()(key.encode(), partitions, partitions))
        consumer.assign([tp])
        end = (await consumer.end_offsets([tp]))[tp]
        found = (await consumer.offsets_for_times({tp: max(0, since_ms - CLOCK_MARGIN_MS)}))[tp]
        if found is None:
            return False  # nothing written since the call
        consumer.seek(tp, found.offset)
        while await consumer.position(tp) < end:
            for record in (await consumer.getmany(tp, timeout_ms=500, max_records=2000)).get(tp, ()):
                if record.offset >= end:
                    return False
                if record.key != key.encode():
                    continue
                try:
                    if (await unblocked(decode, record.value or b"", ToolResult)).call_id == call_id:
                        return True
                except DecodeError:
                    continue
        return False
    finally:
        await consumer.stop()
