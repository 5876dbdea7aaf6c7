"""Taking a request over: what did the previous worker already emit for it?

The tokens topic is the record of truth. For a request re-delivered after a rebalance the
worker reads partition `reply_partition` of the tokens topic from shortly before the request
was created (offsets_for_times; the topic uses LogAppendTime) up to its current end, keeps
the events keyed by the request id, and returns the longest gap-free run of chunks from seq 0
and the completion, if one was written.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

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
        self._consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, group_id=None,
                                          enable_auto_commit=False, isolation_level="read_committed")
        await self._consumer.start()

    async def stop(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()

    async def emitted(self, request_id: str, partition: int, since: float) -> Emitted:
        async with self._lock:
            return await self._scan(request_id, partition, since)

    async def _scan(self, request_id: str, partition: int, since: float) -> Emitted:
        consumer = self._consumer
        assert consumer is not None
        tp = TopicPartition(TOKENS.name, partition)
        consumer.assign([tp])
        end = (await consumer.end_offsets([tp]))[tp]
        found = (await consumer.offsets_for_times({tp: max(0, int(since * 1000))}))[tp]
        if found is None:
            return Emitted()
        consumer.seek(tp, found.offset)
        key = request_id.encode()
        by_seq: dict[int, TokenChunk] = {}
        result = Emitted()
        position = found.offset
        while position < end:
            batch = await consumer.getmany(tp, timeout_ms=500)
            records = batch.get(tp, [])
            if not records:
                position = await consumer.position(tp)
                continue
            for rec in records:
                position = rec.offset + 1
                if rec.key != key or rec.offset >= end:
                    continue
                try:
                    event = decode_record(rec, TOKENS)
                except DecodeError:
                    continue
                if isinstance(event, Completion):
                    result.completion = event
                elif isinstance(event, TokenChunk):
                    by_seq.setdefault(event.seq, event)
        n = 0
        while n in by_seq:
            result.chunks.append(by_seq[n])
            n += 1
        log.info("takeover %s: %d chunks already emitted%s", request_id, n,
                 ", completion found" if result.completion else "")
        return result
