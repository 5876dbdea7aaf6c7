"""A time-ordered merge of many topic-partitions, each read between a start and a stop offset.

Each partition is in log order; across partitions records come out by timestamp (ties by the
order the request meets the topics, then offset), so a request's events from every topic
interleave as they happened. What the fetcher has ready is taken without waiting every few
thousand records, so fetches of every partition stay in flight while the merge runs; a
partition holding BUFFERED_MOST records is paused until the merge has used them, so memory is
bounded per partition and a year-long range costs what a minute costs.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import ConsumerRecord, TopicPartition

FETCH_RECORDS = 5000
BUFFERED_MOST = 500  # records held per partition before its fetching is paused
ABSORB_EVERY = 2000  # records merged between two non-blocking takes of what the fetcher has ready


@dataclass
class Span:
    tp: TopicPartition
    start: int
    stop: int  # exclusive

    @property
    def size(self) -> int:
        return max(0, self.stop - self.start)


async def spans_between(consumer: AIOKafkaConsumer, tps: list[TopicPartition], since_ms: int | None,
                        until_ms: int | None) -> list[Span]:
    """Offsets of the first record at or after `since_ms` and `until_ms` (None: beginning / end)."""
    if not tps:
        return []
    begins = await consumer.beginning_offsets(tps)
    ends = await consumer.end_offsets(tps)
    starts = dict(begins)
    stops = dict(ends)
    if since_ms is not None:
        found = await consumer.offsets_for_times({tp: max(0, since_ms) for tp in tps})
        starts = {tp: (found[tp].offset if found[tp] is not None else ends[tp]) for tp in tps}
    if until_ms is not None:
        found = await consumer.offsets_for_times({tp: max(0, until_ms) for tp in tps})
        stops = {tp: (found[tp].offset if found[tp] is not None else ends[tp]) for tp in tps}
    return [Span(tp, starts[tp], stops[tp]) for tp in tps if stops[tp] > starts[tp]]


async def merged(consumer: AIOKafkaConsumer, spans: list[Span], order: dict[str, int],
                 progress: Callable[[int], None] = lambda n: None) -> AsyncIterator[ConsumerRecord]:
    """Every record of `spans`, merged by (timestamp, topic order, partition, offset).

    `progress(n)` is told how many records were read since its last call.
    """
    spans = [s for s in spans if s.size]
    if not spans:
        return
    stop = {s.tp: s.stop for s in spans}
    consumer.assign(list(stop))
    for s in spans:
        consumer.seek(s.tp, s.start)
    buffers: dict[TopicPartition, deque[ConsumerRecord]] = {tp: deque() for tp in stop}
    exhausted: set[TopicPartition] = set()
    waiting = set(stop)  # partitions whose next record is not in the heap yet
    heap: list[tuple[int, int, int, int, TopicPartition]] = []
    idle_rounds = 0

    def push(tp: TopicPartition) -> bool:
        buf = buffers[tp]
        if not buf:
            return False
        r = buf[0]
        heapq.heappush(heap, (r.timestamp, order.get(tp.topic, 99), tp.partition, r.offset, tp))
        return True

    paused: set[TopicPartition] = set()
    since_absorb = 0

    def take(batch: dict) -> int:
        got = 0
        for tp, records in batch.items():
            buf = buffers[tp]
            for r in records:
                if r.offset < stop[tp]:
                    buf.append(r)
                    got += 1
                else:
                    exhausted.add(tp)
                    break
        full = {tp for tp, buf in buffers.items() if len(buf) >= BUFFERED_MOST} - exhausted
        if full - paused:
            consumer.pause(*(full - paused))
        drained = {tp for tp in paused if len(buffers[tp]) < BUFFERED_MOST // 2}
        if drained:
            consumer.resume(*drained)
        paused.difference_update(drained)
        paused.update(full)
        progress(got)
        return got

    while waiting or heap:
        if since_absorb >= ABSORB_EVERY:  # keep every partition's next fetch in flight
            since_absorb = 0
            take(await consumer.getmany(timeout_ms=0, max_records=FETCH_RECORDS))
        if waiting:
            for tp in list(waiting):
                if push(tp):
                    waiting.discard(tp)
        if waiting:
            if paused & waiting:
                consumer.resume(*(paused & waiting))
                paused.difference_update(waiting)
            got = take(await consumer.getmany(*waiting, timeout_ms=500, max_records=FETCH_RECORDS))
            for tp in list(waiting):
                if not buffers[tp] and (tp in exhausted or await consumer.position(tp) >= stop[tp]):
                    waiting.discard(tp)  # nothing more before its stop offset
            idle_rounds = 0 if got else idle_rounds + 1
            if idle_rounds > 120:  # a minute without a record from a partition that is not done
                raise TimeoutError(f"no records from {sorted(map(str, waiting))} for a minute")
            continue
        _, rank, partition, _, tp = heapq.heappop(heap)
        buf, end = buffers[tp], stop[tp]
        while True:  # this partition's records, as long as they come before every other head
            record = buf.popleft()
            since_absorb += 1
            if record.offset + 1 >= end:
                exhausted.add(tp)
            yield record
            if not buf or (heap and (buf[0].timestamp, rank, partition) > heap[0][:3]):
                break
        if not push(tp) and tp not in exhausted:
            waiting.add(tp)
