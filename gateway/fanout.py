"""Token events to the connections that wait for them, with bounded memory.

One consumer per gateway instance, manually assigned to the instance's own partitions of
the tokens topic (each request names one of them as its reply_partition), so no instance
reads another's tokens. Events are routed by request_id to a bounded per-connection
Stream. A Stream that is full merges a new chunk into its last pending one
(schemas.tokens.merge_chunks: text, token ids, log probabilities and tool-call deltas all kept), so a
slow client gets fewer, larger chunks. When even that is exhausted (the last chunk holds
`coalesce_chars` characters of the model's output), the stream is dropped at once: its connection
gets what it holds, then an error event, and the client resumes from the log with Last-Event-ID at
its own pace. A slow reader never pauses its partition, so no other stream waits on it.

The Fanout outlives its consumer: when reading fails (a broker error, a decode or sealing outage),
the gateway gives it a new consumer (`attach`), which continues each partition at the first record
not yet delivered, so every live stream stays attached and misses nothing, and gets nothing twice
(a step record, read as its chunks (schemas/steps.py), stays the first not delivered until its last
chunk went; the chunks met again there are dropped by seq where the stream is framed).

Per event the fan-out does a dict lookup, one decode (only for a stream or watcher that reads it)
and one wake-up of the stream's connection, whose task then takes every pending event at once; no
task, timer or lock per event. A key the keyring does not hold is fetched in a thread
(common/unblocked.py) while the loop serves the other streams; the partition's records wait behind
it, in order.

Besides the connections, a `watcher` (gateway/inflight.py) hears of every event of the requests
this instance admitted, with or without a connection, and gets each one's Completion decoded
(told apart by the event-type header, so other events of unwatched requests are never decoded).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Protocol

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import ConsumerRecord, TopicPartition

from common.unblocked import held_only, unblocked
from gateway.metrics import Metrics
from schemas import Completion, DecodeError, Event, TokenChunk, decode
from schemas.headers import EVENT_TYPE
from schemas.sealing import KeyNotHeld
from schemas.steps import resume_offset, unpack_all
from schemas.tokens import merge_chunks
from topics import TOKENS

COMPLETION_TYPE = Completion.__struct_config__.tag.encode()

log = logging.getLogger(__name__)


class SlowReader(Exception):
    """The stream was dropped because its reader fell too far behind; it can resume from the log."""


class Stream:
    """The pending events of one connection: at most `capacity` events, never more."""

    __slots__ = ("_waiter", "capacity", "coalesce_chars", "coalesced", "dropped", "items", "request_id")

    def __init__(self, request_id: str, capacity: int, coalesce_chars: int) -> None:
        self.request_id = request_id
        self.capacity = capacity
        self.coalesce_chars = coalesce_chars
        self.items: deque[Event] = deque()
        self.coalesced = 0
        self.dropped = False
        self._waiter: asyncio.Future | None = None  # the connection's take, while it waits

    def offer(self, event: Event) -> bool:
        """Take `event`: appended while fewer than `capacity` are pending, else merged into the last
        pending chunk. An event that cannot merge there (an end, a verdict, a run's next step after
        its step's end) is appended up to twice `capacity`. False when none of these holds (the
        caller drops the stream): the pending events are bounded in number and size."""
        items = self.items
        if len(items) < self.capacity:
            items.append(event)
            self._wake()
            return True
        tail = items[-1]
        if isinstance(event, TokenChunk) and isinstance(tail, TokenChunk):
            if _size(tail) >= self.coalesce_chars:
                return False
            items[-1] = merge_chunks(tail, event)
            self.coalesced += 1
        elif len(items) < 2 * self.capacity:
            items.append(event)
        else:
            return False
        self._wake()
        return True

    def drop(self) -> None:
        """End the stream for falling too far behind: its reader takes what it holds, then SlowReader."""
        self.dropped = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self, timeout: float | None = None) -> list[Event]:
        """Every pending event (at least one), or [] after `timeout` seconds without any.

        Raises SlowReader once the stream was dropped and what it still held was taken.
        """
        if not self.items:
            if self.dropped:
                raise SlowReader(self.request_id)
            loop = asyncio.get_running_loop()
            self._waiter = waiter = loop.create_future()
            timer = loop.call_later(timeout, _expire, waiter) if timeout is not None else None
            try:
                await waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()
            if not self.items:
                if self.dropped:
                    raise SlowReader(self.request_id)
                return []  # timed out
        batch = list(self.items)
        self.items.clear()
        return batch


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


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
        watcher: Watcher | None = None,
    ) -> None:
        self.consumer = consumer
        self.watcher = watcher
        self.partitions = [TopicPartition(TOKENS.name, p) for p in partitions]
        self.metrics = metrics
        self.capacity = capacity
        self.coalesce_chars = coalesce_chars
        self.streams: dict[str, Stream] = {}
        self.aliases: dict[str, Stream] = {}  # other request ids whose events go to a stream (a run's steps)
        self._aliases_of: dict[str, tuple[str, ...]] = {}  # a stream's request id -> its aliases
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
        (the log's end on the first attach)."""
        self.connected = False
        self.consumer = consumer
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
        stream = Stream(request_id, self.capacity, self.coalesce_chars)
        self.streams[request_id] = stream
        if aliases:
            self._aliases_of[request_id] = aliases
            for alias in aliases:
                self.aliases[alias] = stream
        self.metrics.active_streams.set(len(self.streams))
        return stream

    def unsubscribe(self, request_id: str) -> None:
        stream = self.streams.pop(request_id, None)
        for alias in self._aliases_of.pop(request_id, ()):
            if self.aliases.get(alias) is stream:
                del self.aliases[alias]
        self.metrics.active_streams.set(len(self.streams))

    def _drop(self, stream: Stream, tp: TopicPartition) -> None:
        log.warning(
            "dropping stream %s: its reader fell %d events behind on partition %d",
            stream.request_id,
            len(stream.items),
            tp.partition,
        )
        self.metrics.slow_readers.inc()
        stream.drop()
        self.unsubscribe(stream.request_id)

    def _deliver(
        self, tp: TopicPartition, records: deque[ConsumerRecord], first: Event | None = None
    ) -> KeyNotHeld | None:
        """Route records in order (`first`: the first one's event, already decoded). Stops at a record
        sealed with a key not held (returned, the record left first in `records`); None when all went."""
        streams, aliases, watcher = self.streams, self.aliases, self.watcher
        while records:
            record = records[0]
            key = record.key.decode() if record.key else ""
            stream = streams.get(key) or aliases.get(key)  # a response run's later steps: its stream
            watched = watcher is not None and key in watcher
            event, first = first, None
            if event is None and (stream is not None or (watched and _is_completion(record))):
                try:
                    event = held_only(decode, record.value or b"", *TOKENS.events)
                except KeyNotHeld as missing:
                    return missing
                except DecodeError as exc:
                    log.warning("undecodable token event %s@%d: %s", tp, record.offset, exc)
            if stream is not None and event is not None:  # else nobody holds it here (gone, or replayed)
                before = stream.coalesced
                if not stream.offer(event):
                    self._drop(stream, tp)
                elif stream.coalesced != before:
                    self.metrics.coalesced.inc()
            if watched:
                watcher.heard(key, event if isinstance(event, Completion) else None)
            records.popleft()
            self.next_offset[tp] = resume_offset(record)
        return None

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batches = await self.consumer.getmany(timeout_ms=200, max_records=2000)
            self.last_poll = loop.time()
            for tp, records in batches.items():
                pending = deque(unpack_all(records))  # a step record: its chunks, in order
                self._counters[tp.partition].inc(len(pending))
                missing = self._deliver(tp, pending)
                while missing is not None:  # a key not held: fetched in a thread while the loop goes on
                    missing = self._deliver(tp, pending, await self._fetching(tp, pending))

    async def _fetching(self, tp: TopicPartition, pending: deque[ConsumerRecord]) -> Event | None:
        """The first pending record's event, its key fetched off the loop; an undecodable one is passed."""
        record = pending[0]
        try:
            return await unblocked(decode, record.value or b"", *TOKENS.events)
        except DecodeError as exc:
            log.warning("undecodable token event %s@%d: %s", tp, record.offset, exc)
            pending.popleft()
            self.next_offset[tp] = resume_offset(record)
            return None
