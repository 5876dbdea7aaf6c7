"""Token events to the connections that wait for them, with bounded memory.

One consumer per gateway instance, manually assigned to the instance's own partitions of
the tokens topic (each request names one of them as its reply_partition), so no instance
reads another's tokens. Events are routed by request_id to a bounded per-connection
Stream. A Stream that is full merges a new chunk into its last pending one
(schemas.tokens.merge_chunks: text, token ids, log probabilities and tool-call deltas all kept), so a
slow client gets fewer, larger chunks; when even that is exhausted (the last chunk holds
`coalesce_chars` characters of the model's output), the fanout parks the rest of the fetched records
of that partition (one fetch response at most) and pauses the partition until the client has drained
its buffer; then it delivers the parked records and resumes.
A client that keeps its partition paused longer than `slow_reader_s` holds up every other
stream on it: its Stream is dropped instead (its connection ends with an error event, and the
client resumes from the log with Last-Event-ID, at its own pace), and the partition resumes.

The Fanout outlives its consumer: when reading fails (a broker error, a decode or sealing outage),
the gateway gives it a new consumer (`attach`), which continues each partition at the first record
not yet delivered, so every live stream stays attached and misses nothing, and gets nothing twice.

Besides the connections, a `watcher` (gateway/inflight.py) hears of every event of the requests
this instance admitted, with or without a connection, and gets each one's Completion decoded
(told apart by the event-type header, so other events of unwatched requests are never decoded).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Protocol

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import ConsumerRecord, TopicPartition

from common import sealing
from gateway.metrics import Metrics
from schemas import Completion, DecodeError, Event, TokenChunk, decode
from schemas.headers import EVENT_TYPE
from schemas.tokens import merge_chunks
from topics import TOKENS

COMPLETION_TYPE = Completion.__struct_config__.tag.encode()

log = logging.getLogger(__name__)


class SlowReader(Exception):
    """The stream was dropped because its reader fell too far behind; it can resume from the log."""


class Stream:
    """The pending events of one connection: at most `capacity` events, never more."""

    def __init__(
        self, request_id: str, capacity: int, coalesce_chars: int, on_drain: Callable[[Stream], None]
    ) -> None:
        self.request_id = request_id
        self.capacity = capacity
        self.coalesce_chars = coalesce_chars
        self.items: deque[Event] = deque()
        self.blocked_on: TopicPartition | None = None
        self.coalesced = 0
        self.dropped = False
        self._ready = asyncio.Event()
        self._on_drain = on_drain

    def offer(self, event: Event) -> bool:
        """Take `event` or refuse it (the caller pauses until drained). Never grows past capacity."""
        if len(self.items) < self.capacity:
            self.items.append(event)
            self._ready.set()
            return True
        tail = self.items[-1]
        if (
            isinstance(event, TokenChunk)
            and isinstance(tail, TokenChunk)
            and _size(tail) < self.coalesce_chars
        ):
            self.items[-1] = merge_chunks(tail, event)
            self.coalesced += 1
            self._ready.set()
            return True
        return False

    async def take(self, timeout: float | None = None) -> list[Event]:
        """Every pending event (at least one), or [] after `timeout` seconds without any.

        Raises SlowReader once the stream was dropped and what it still held was taken.
        """
        if not self.items:
            if self.dropped:
                raise SlowReader(self.request_id)
            self._ready.clear()
            try:
                await asyncio.wait_for(self._ready.wait(), timeout)
            except TimeoutError:
                return []
            if self.dropped and not self.items:
                raise SlowReader(self.request_id)
        batch = list(self.items)
        self.items.clear()
        self._ready.clear()
        if self.blocked_on is not None:
            self._on_drain(self)
        return batch


def _size(chunk: TokenChunk) -> int:
    """What a pending chunk holds, in characters of the model's output (its raw text, else its content
    and call arguments), or in tokens where it holds more tokens than characters."""
    if chunk.raw is not None:
        chars = len(chunk.raw)
    else:
        chars = len(chunk.text) + sum(len(d.arguments) for d in chunk.tool_calls)
    return max(chars, len(chunk.token_ids))


class Watcher(Protocol):
    def __contains__(self, request_id: str) -> bool: ...

    def heard(self, request_id: str, event: Completion | None) -> None: ...


def _is_completion(record: ConsumerRecord) -> bool:
    return any(k == EVENT_TYPE and v == COMPLETION_TYPE for k, v in record.headers or ())


class Fanout:
    def __init__(
        self,
        consumer: AIOKafkaConsumer | None,
        partitions: list[int],
        metrics: Metrics,
        capacity: int = 64,
        coalesce_chars: int = 4096,
        slow_reader_s: float = 30.0,
        watcher: Watcher | None = None,
    ) -> None:
        self.consumer = consumer
        self.watcher = watcher
        self.slow_reader_s = slow_reader_s
        self.partitions = [TopicPartition(TOKENS.name, p) for p in partitions]
        self.metrics = metrics
        self.capacity = capacity
        self.coalesce_chars = coalesce_chars
        self.streams: dict[str, Stream] = {}
        self.aliases: dict[str, Stream] = {}  # other request ids whose events go to a stream (a run's steps)
        # Records fetched but not yet delivered because a stream was full, per paused partition.
        # At most one fetch response each (max_partition_fetch_bytes): bounded.
        self.parked: dict[TopicPartition, deque[ConsumerRecord]] = {}
        self.paused_at: dict[TopicPartition, float] = {}
        self.next_offset: dict[TopicPartition, int] = {}  # per partition: the first record not delivered
        self.connected = False  # a consumer is attached and positioned
        self.last_poll = 0.0
        self._counters = {
            tp.partition: metrics.token_events.labels(str(tp.partition)) for tp in self.partitions
        }

    async def start(self) -> None:
        await self.attach(self.consumer)

    async def attach(self, consumer: AIOKafkaConsumer) -> None:
        """Read with `consumer` from now on: each partition from its first record not yet delivered
        (the log's end on the first attach). Records parked for a full stream are read again."""
        self.connected = False
        self.consumer = consumer
        self.parked.clear()
        self.paused_at.clear()
        for stream in self.streams.values():
            stream.blocked_on = None
        self.metrics.paused.set(0)
        consumer.assign(self.partitions)
        fresh = [tp for tp in self.partitions if tp not in self.next_offset]
        if fresh:
            await consumer.seek_to_end(*fresh)
        for tp in self.partitions:  # resolve positions now: a request admitted later sees all its events
            if tp in self.next_offset:
                consumer.seek(tp, self.next_offset[tp])
            self.next_offset[tp] = await consumer.position(tp)
        self.connected = True

    def subscribe(self, request_id: str, aliases: tuple[str, ...] = ()) -> Stream:
        """The stream of `request_id`'s events, and of the `aliases`' (a response run's later steps),
        in the partition's order."""
        stream = Stream(request_id, self.capacity, self.coalesce_chars, self._drained)
        self.streams[request_id] = stream
        for alias in aliases:
            self.aliases[alias] = stream
        self.metrics.active_streams.set(len(self.streams))
        return stream

    def unsubscribe(self, request_id: str) -> None:
        stream = self.streams.pop(request_id, None)
        if stream is not None:
            for alias in [k for k, s in self.aliases.items() if s is stream]:
                del self.aliases[alias]
        self.metrics.active_streams.set(len(self.streams))
        if stream is not None and stream.blocked_on is not None:
            self._drained(stream)

    def _drained(self, stream: Stream) -> None:
        """`stream` has room again: deliver the parked records of its partition, then resume it."""
        tp, stream.blocked_on = stream.blocked_on, None
        records = self.parked.get(tp)
        if records is None:
            return
        if self._deliver(tp, records):
            del self.parked[tp]
            self.paused_at.pop(tp, None)
            self.consumer.resume(tp)
            self.metrics.paused.set(len(self.parked))

    def _drop_slow_readers(self, now: float) -> None:
        """Drop the stream that has kept a partition paused for longer than `slow_reader_s`."""
        for tp, since in list(self.paused_at.items()):
            if now - since < self.slow_reader_s:
                continue
            blocking = next((s for s in self.streams.values() if s.blocked_on == tp), None)
            if blocking is None:
                continue
            log.warning(
                "dropping stream %s: its reader kept partition %d paused for %.0fs",
                blocking.request_id,
                tp.partition,
                now - since,
            )
            self.metrics.slow_readers.inc()
            blocking.dropped = True
            blocking._ready.set()
            self.unsubscribe(blocking.request_id)  # delivers the parked records, resumes
            if tp in self.paused_at:  # blocked again at once, by another stream: its own clock starts now
                self.paused_at[tp] = now

    def _deliver(self, tp: TopicPartition, records: deque[ConsumerRecord]) -> bool:
        """Route records in order; on a full stream, park the rest and pause. True when all went."""
        while records:
            record = records[0]
            key = record.key.decode() if record.key else ""
            stream = self.streams.get(key) or self.aliases.get(
                key
            )  # a response run's later steps: its stream
            watched = self.watcher is not None and key in self.watcher
            event = None
            if stream is not None or (watched and _is_completion(record)):
                try:
                    event = decode(record.value or b"", *TOKENS.events)
                except DecodeError as exc:
                    log.warning("undecodable token event %s@%d: %s", tp, record.offset, exc)
            if (
                stream is not None and event is not None
            ):  # else nobody holds it here (gone, or a replay serves it)
                before = stream.coalesced
                if not stream.offer(event):
                    stream.blocked_on = tp
                    return False
                if stream.coalesced != before:
                    self.metrics.coalesced.inc()
            if watched:
                self.watcher.heard(key, event if isinstance(event, Completion) else None)
            records.popleft()
            self.next_offset[tp] = record.offset + 1
        return True

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batches = await self.consumer.getmany(timeout_ms=200, max_records=2000)
            self.last_poll = loop.time()
            if self.paused_at:
                self._drop_slow_readers(self.last_poll)
            for tp, records in batches.items():
                self._counters[tp.partition].inc(len(records))
                pending = deque(records)
                if tp in self.parked:  # cannot happen while paused; keep order if it ever does
                    self.parked[tp].extend(pending)
                    continue
                await sealing.hold_keys(pending, self.streams, self.aliases)  # no key fetch in _deliver
                if not self._deliver(tp, pending):
                    self.parked[tp] = pending
                    self.paused_at[tp] = self.last_poll
                    self.consumer.pause(tp)
                    self.metrics.pauses.inc()
                    self.metrics.paused.set(len(self.parked))
