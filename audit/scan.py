"""A time-ordered merge of many topic-partitions, each read between a start and a stop offset.

Each partition is in log order; across partitions records come out by timestamp (ties by the
order the request meets the topics, then offset), so a request's events from every topic
interleave as they happened. Memory holds at most one fetched batch per partition: aiokafka's
fetcher keeps one result per partition until it is consumed, so a year-long range costs what
a minute costs.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import ConsumerRecord, TopicPartition

FETCH_RECORDS = 5000


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

    while waiting or heap:
        if waiting:
            for tp in list(waiting):
                if push(tp):
                    waiting.discard(tp)
        if waiting:
            batch = await consumer.getmany(*waiting, timeout_ms=500, max_records=FETCH_RECORDS)
            got = 0
            for tp, records in batch.items():
                for r in records:
                    if r.offset < stop[tp]:
                        buffers[tp].append(r)
                        got += 1
                    else:
                        exhausted.add(tp)
                        break
            progress(got)
            for tp in list(waiting):
                if not buffers[tp] and (tp in exhausted or await consumer.position(tp) >= stop[tp]):
                    waiting.discard(tp)  # nothing more before its stop offset
            idle_rounds = 0 if got else idle_rounds + 1
            if idle_rounds > 120:  # a minute without a record from a partition that is not done
                raise TimeoutError(f"no records from {sorted(map(str, waiting))} for a minute")
            continue
        *_, tp = heapq.heappop(heap)
        record = buffers[tp].popleft()
        if record.offset + 1 >= stop[tp]:
            exhausted.add(tp)
        if not push(tp) and tp not in exhausted:
            waiting.add(tp)
        yield record
