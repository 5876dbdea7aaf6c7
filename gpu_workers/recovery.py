"""Taking a request over: what did the previous worker already emit for it?

The tokens topic is the record of truth. For requests re-delivered after a rebalance the worker reads
their `reply_partition`s of the tokens topic up to the current end, keeps the events keyed by their
request ids, and returns for each the longest gap-free run of chunks from seq 0 and the completion, if
one was written. All requests fetched together are looked up in one such read.

Where each partition's read starts: the lowest first-record offset among its requests
(common/first_records.py: the writer of a request's first record noted it in the durable Redis on its
ack; one MGET for the batch). A request without one (not started yet, its writer died before the ack,
or Redis cannot say) starts the read shortly before it was created instead (offsets_for_times; the
topic uses LogAppendTime), as every read did before; the first record the read then finds of such a
request is noted for later readers.

A step record (schemas/steps.py) is read as its entries, each a chunk at the step record's offset: the
first record found of a request is then the step record holding its chunk, and `records_read` counts
Kafka records (a step record once).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from common import kafka_auth
from common.config import settings
from common.first_records import FirstRecords, first_offsets, record_found
from common.unblocked import unblocked
from producers import decode_record
from schemas import Completion, DecodeError, TokenChunk
from schemas.steps import unpack_all
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

    def __init__(self, bootstrap: str, redis_url: str | None = None) -> None:
        self.bootstrap = bootstrap
        self._consumer: AIOKafkaConsumer | None = None
        self._lock = asyncio.Lock()
        # the worker's notes of first records (gpu_workers/publisher.py writes, this reads)
        self.first = FirstRecords(redis_url or settings().redis_url)
        self.records_read = 0  # records of the tokens topic read by takeovers (logs, tests)

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
        await self.first.close()

    async def emitted(self, wanted: list[tuple[str, int, float]]) -> dict[str, Emitted]:
        """What was emitted for each (request id, reply partition, created_at less a margin).

        One read for all of them: every reply partition concerned is read once, from the lowest
        start among its requests (its first record's offset, else `since`: the module docstring)
        to its end, so taking over a whole batch of requests costs one read, not one per request.
        """
        async with self._lock:
            return await self._scan(wanted)

    async def _scan(self, wanted: list[tuple[str, int, float]]) -> dict[str, Emitted]:
        consumer = self._consumer
        assert consumer is not None
        partitions = {rid: partition for rid, partition, _ in wanted}
        known = await first_offsets(self.first.redis, partitions, verdicts=False)  # chunks only here
        since: dict[TopicPartition, float] = {}  # the earliest admission among requests without a key
        exact: dict[TopicPartition, int] = {}  # the lowest first-record offset among those with one
        parts = set()
        for rid, partition, at in wanted:
            tp = TopicPartition(TOKENS.name, partition)
            parts.add(tp)
            if rid in known:
                exact[tp] = min(known[rid], exact.get(tp, known[rid]))
            else:
                since[tp] = min(at, since.get(tp, at))
        keys = {rid.encode() for rid, _, _ in wanted}
        unknown = {rid.encode() for rid, _, _ in wanted if rid not in known}
        consumer.assign(list(parts))
        ends = await consumer.end_offsets(list(parts))
        found = (
            await consumer.offsets_for_times({tp: max(0, int(at * 1000)) for tp, at in since.items()})
            if since
            else {}
        )
        starts: dict[TopicPartition, int] = {}
        for tp in parts:
            candidates = [exact[tp]] if tp in exact else []
            if found.get(tp) is not None:
                candidates.append(found[tp].offset)
            if candidates and min(candidates) < ends[tp]:
                starts[tp] = min(candidates)
        todo = {tp: ends[tp] for tp in starts}
        for tp, start in starts.items():
            consumer.seek(tp, start)
        first_seen: dict[str, tuple[int, int]] = {}  # requests without a key: their first record found
        read = 0
        by_seq: dict[bytes, dict[int, TokenChunk]] = {k: {} for k in keys}
        completions: dict[bytes, Completion] = {}
        while todo:
            batches = await consumer.getmany(*todo, timeout_ms=500)
            for tp, records in batches.items():
                end = todo.get(tp, -1)
                records = [rec for rec in records if rec.offset < end]
                read += len(records)
                for rec in unpack_all(records):  # a step record: its chunks, each at the step's offset
                    if rec.key not in keys:
                        continue
                    if rec.key in unknown and tp in since:
                        first_seen.setdefault(rec.key.decode(), (tp.partition, rec.offset))
                    try:  # a key not held is fetched off the loop
                        event = await unblocked(decode_record, rec, TOKENS)
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
        await record_found(self.first.redis, first_seen)
        self.records_read += read
        resumed = sum(1 for e in result.values() if e.chunks)
        log.info(
            "takeover of %d requests: one read of %d tokens partitions (%d records; %d requests from their"
            " first record's offset), %d had chunks, %d completions found",
            len(result),
            len(parts),
            read,
            len(known),
            resumed,
            len(completions),
        )
        return result
