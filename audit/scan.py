"""A time-ordered merge of many topic-partitions, each read between a start and a stop offset.

Each partition is in log order; across partitions records come out by timestamp (ties by the
order the request meets the topics, then partition, then offset), so a request's events from
every topic interleave as they happened. A partition's timestamps are made non-decreasing (each
record counts at the latest time seen so far in its partition), so its log order is never changed.

The merge works in rounds, on whole batches: it takes up to TAKE records of what the fetcher has
ready for each partition holding fewer than LOW_WATER records, then hands on, sorted in one C-level
sort, every buffered record older than the watermark (the oldest "latest time seen" among the
partitions not yet done: nothing older can come from any of them). It waits on the fetcher only for
the partitions that hold the watermark back. aiokafka keeps at most one fetched response per
partition (`max_partition_fetch_bytes`, parsed only as records are taken) and fetches the next
only once it is used up, so memory is bounded per partition and a year-long range costs what a
minute costs.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import ConsumerRecord, TopicPartition

from schemas.steps import unpack_all

LOW_WATER = 1000  # records buffered per partition below which more is taken from what was fetched
TAKE = 1000  # records taken from a partition's fetched response at a time (parsed lazily by aiokafka)
WAIT_MS = 500  # longest wait for a partition that holds the watermark back
IDLE_ROUNDS = 120  # waits in a row without a record before the scan gives up (a minute)
_RANK_BITS, _PARTITION_BITS = 8, 16  # the sort key: timestamp, topic rank, partition packed in one int


@dataclass
class Span:
    tp: TopicPartition
    start: int
    stop: int  # exclusive

    @property
    def size(self) -> int:
        return max(0, self.stop - self.start)


async def spans_between(
    consumer: AIOKafkaConsumer, tps: list[TopicPartition], since_ms: int | None, until_ms: int | None
) -> list[Span]:
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


async def merged(
    consumer: AIOKafkaConsumer,
    spans: list[Span],
    order: dict[str, int],
    progress: Callable[[int], None] = lambda n: None,
    *,
    unpack: bool = True,
) -> AsyncIterator[list[ConsumerRecord]]:
    """Every record of `spans` in batches, merged by (timestamp, topic order, partition, offset).

    A step record (schemas/steps.py) comes out as its entries, each at the step record's offset and
    timestamp; with `unpack=False` as the record it is (a reader of the records' bytes: the ledger's).
    `progress(n)` is told how many records of the log were read since its last call (a step record one).
    """
    spans = [s for s in spans if s.size]
    if not spans:
        return
    stop = {s.tp: s.stop for s in spans}
    consumer.assign(list(stop))
    for s in spans:
        consumer.seek(s.tp, s.start)
    records: dict[TopicPartition, list[ConsumerRecord]] = {tp: [] for tp in stop}
    times: dict[TopicPartition, list[int]] = {tp: [] for tp in stop}  # non-decreasing, one per record
    latest: dict[TopicPartition, int] = {tp: -1 for tp in stop}  # the latest time seen (-1: none yet)
    tag = {tp: (min(order.get(tp.topic, 99), 255) << _PARTITION_BITS) | tp.partition for tp in stop}
    active = set(stop)  # partitions with records still to come

    def done(tp: TopicPartition) -> None:
        active.discard(tp)
        consumer.pause(tp)  # nothing past its stop offset is fetched

    def take(batch: dict) -> int:
        got = 0
        for tp, fetched in batch.items():
            if not fetched:
                continue
            end = stop[tp]
            if fetched[-1].offset >= end:
                fetched = [r for r in fetched if r.offset < end]
                done(tp)
            got += len(fetched)
            if unpack:
                fetched = list(unpack_all(fetched))  # a step record: its chunks, each at the step's offset
            most = latest[tp]
            stamps = times[tp]
            for r in fetched:
                most = max(most, r.timestamp)
                stamps.append(most)
            latest[tp] = most
            records[tp] += fetched
            if fetched and fetched[-1].offset + 1 >= end:
                done(tp)
        progress(got)
        return got

    idle = 0
    while active or any(records.values()):
        for tp in [tp for tp in active if len(records[tp]) < LOW_WATER]:
            take(await consumer.getmany(tp, timeout_ms=0, max_records=TAKE))
        watermark = min((latest[tp] for tp in active), default=None)
        if watermark is not None and watermark < 0:
            watermark = -1  # a partition not yet heard from holds everything back
        out_records: list[ConsumerRecord] = []
        keys: list[int] = []
        for tp, buffered in records.items():
            if not buffered:
                continue
            cut = len(buffered) if watermark is None else bisect_left(times[tp], watermark)
            if not cut:
                continue
            shift = tag[tp]
            keys += [(t << (_RANK_BITS + _PARTITION_BITS)) | shift for t in times[tp][:cut]]
            out_records += buffered[:cut]
            del buffered[:cut], times[tp][:cut]
        if out_records:
            idle = 0
            if len(keys) > 1:
                ranked = sorted(
                    range(len(keys)), key=keys.__getitem__
                )  # stable: log order within a partition
                out_records = [out_records[i] for i in ranked]
            yield out_records
            continue
        # nothing can go out yet: wait for the partitions that hold the watermark back
        behind = [
            tp for tp in active if latest[tp] <= watermark
        ]  # (all at the watermark: taken however many)
        if not behind:
            continue
        got = take(await consumer.getmany(*behind, timeout_ms=WAIT_MS, max_records=TAKE))
        for tp in behind:
            if tp in active and not records[tp] and await consumer.position(tp) >= stop[tp]:
                done(tp)  # nothing more before its stop offset (a gap, or transaction markers)
        idle = 0 if got else idle + 1
        if idle > IDLE_ROUNDS:
            raise TimeoutError(f"no records from {sorted(map(str, behind))} for a minute")
