"""Taking a request over: what did the previous worker already emit for it?

The tokens topic is the record of truth. For requests re-delivered after a rebalance the
worker reads their `reply_partition`s of the tokens topic from shortly before the earliest
of them was created (offsets_for_times; the topic uses LogAppendTime) up to the current end,
keeps the events keyed by their request ids, and returns for each the longest gap-free run of
chunks from seq 0 and the completion, if one was written. All requests fetched together are
looked up in one such read.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from common import kafka_auth
from producers import decode_record
from schemas import Completion, DecodeError, TokenChunk
from topics import TOKENS

log = logging.getLogger(__name__)


@dataclass
class Emitted:
    chunks: list[TokenChunk] = field(default_factory=list)
    completion: Completion | None = None

    @property
    def token_ids(self) -> list[int]:
        return [t for c in self.chunks for t in c.token_ids]

    @property
    def text(self) -> str:
        """The model's text so far (for a request with tools, `raw`: content and calls alike)."""
        return "".join(c.text if c.raw is None else c.raw for c in self.chunks)


class TokenLog:
    """One group-less consumer of the tokens topic, reused for every scan."""

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        self._consumer: AIOKafkaConsumer | None = None
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap,
            **kafka_auth.client_options(),
            group_id=None,
            enable_auto_commit=False,
            isolation_level="read_committed",
        )
        await self._consumer.start()

    async def stop(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()

    async def emitted(self, wanted: list[tuple[str, int, float]]) -> dict[str, Emitted]:
        """What was emitted for each (request id, reply partition, created_at less a margin).

        One read for all of them: every reply partition concerned is read once, from the
        earliest `since` among its requests to its end, so taking over a whole batch of
        requests costs one scan, not one per request.
        """
        async with self._lock:
            return await self._scan(wanted)

    async def _scan(self, wanted: list[tuple[str, int, float]]) -> dict[str, Emitted]:
        consumer = self._consumer
        assert consumer is not None
        since: dict[TopicPartition, float] = {}
        for _, partition, at in wanted:
            tp = TopicPartition(TOKENS.name, partition)
            since[tp] = min(at, since.get(tp, at))
        keys = {rid.encode() for rid, _, _ in wanted}
        consumer.assign(list(since))
        ends = await consumer.end_offsets(list(since))
        starts = await consumer.offsets_for_times({tp: max(0, int(at * 1000)) for tp, at in since.items()})
        todo = {tp: ends[tp] for tp, found in starts.items() if found is not None and found.offset < ends[tp]}
        for tp in todo:
            consumer.seek(tp, starts[tp].offset)
        by_seq: dict[bytes, dict[int, TokenChunk]] = {k: {} for k in keys}
        completions: dict[bytes, Completion] = {}
        while todo:
            batches = await consumer.getmany(*todo, timeout_ms=500)
            for tp, records in batches.items():
                for rec in records:
                    if rec.key not in keys or rec.offset >= todo.get(tp, -1):
                        continue
                    try:
                        event = decode_record(rec, TOKENS)
                    except DecodeError:
                        continue
                    if isinstance(event, Completion):
                        completions[rec.key] = event
                    elif isinstance(event, TokenChunk):
                        by_seq[rec.key].setdefault(event.seq, event)
            for tp in list(todo):
                if await consumer.position(tp) >= todo[tp]:
                    del todo[tp]
        result: dict[str, Emitted] = {}
        for key, chunks in by_seq.items():
            emitted = result[key.decode()] = Emitted(completion=completions.get(key))
            n = 0
            while n in chunks:
                emitted.chunks.append(chunks[n])
                n += 1
        resumed = sum(1 for e in result.values() if e.chunks)
        log.info(
            "takeover of %d requests: one read of %d tokens partitions, %d had chunks, %d completions found",
            len(result),
            len(since),
            resumed,
            len(completions),
        )
        return result
