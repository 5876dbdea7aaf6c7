"""Resumes read the log through one consumer per tokens partition, shared by every resume in flight on it.

A gateway that restarts with N live streams gets N resumes at once, most of them on a few partitions.
Each resume registers with its partition's `PartitionReader` (started on the first registration) with
the request ids it follows and where its records start:

- the offset of the request's first record, noted in the durable Redis by the worker that wrote it
  (common/first_records.py; one MGET for all registrations the reader takes in at once), or else
- today's fallback: the first offset at or after the request's admission less CLOCK_MARGIN_MS
  (offsets_for_times), or, when nothing was written since, the partition's end as it is then.

The reader takes registrations in between reads. It keeps the last RECENT records it read: a
registration that starts behind the reader's position but among them is served from them; one that
starts before them makes the reader seek back to the lowest such start (once for all registrations
taken in together). Every resume gets only its keys' records at offsets from its own start on, each
record once (a record read again after a seek back is not given twice). With no resume left for
LINGER_S the consumer stops.

A record's sealed content is opened with the keys held, a key not held fetched off the loop
(common/unblocked.py). `stats` counts what the readers did (records read, seeks, consumers started);
each reader logs them when it stops.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from aiokafka.structs import TopicPartition

from common.config import settings
from common.first_records import client, first_offsets
from common.unblocked import unblocked
from producers import start_consumer
from schemas import DecodeError, Event, decode
from schemas.ids import parse_request_id
from schemas.steps import resume_offset, unpack_all
from topics import TOKENS

log = logging.getLogger(__name__)

CLOCK_MARGIN_MS = 5_000  # the fallback starts this much before admission (clock differences between hosts)
LINGER_S = 5.0  # a reader with no resume left stops after this long
MAX_RECORDS = 2000
POLL_MS = 100  # an empty fetch waits this long: how soon a resume is taken in on a quiet partition
SEEKS_KEPT = 1000  # the latest seeks kept in `stats` (their count is `seeks_total`)
RECENT = 4096  # records kept per reader for resumes that start behind it (a few hundred bytes each)


@dataclass
class Stats:
    consumers_started: int = 0
    records_read: int = 0
    seeks: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=SEEKS_KEPT))  # the latest
    seeks_total: int = 0
    exact: int = 0  # registrations that started at their request's first record
    fallback: int = 0  # registrations that started from the admission time (or the end)


@dataclass(eq=False)
class Resumer:
    """One resume: its request ids, where its records start, what it has been given."""

    request_id: str
    keys: frozenset[bytes]
    admitted_ms: int
    start: int | None = None  # resolved by the reader
    next: int = 0  # the next offset it may be given
    until: int | None = None  # read_so_far: done once the reader is past this offset
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # lists of events; None once done
    gone: bool = False  # its resume ended


class PartitionReader:
    def __init__(self, hub: Hub, partition: int) -> None:
        self.hub = hub
        self.tp = TopicPartition(TOKENS.name, partition)
        self.resumers: set[Resumer] = set()
        self.by_key: dict[bytes, list[Resumer]] = {}
        self.joining: list[Resumer] = []
        # the records read lately, every one from `covered_from` to the position: a resume starting
        # among them is served from here without a seek back
        self.recent: deque = deque()
        self.covered_from = 0
        self.wake = asyncio.Event()
        self.task = asyncio.create_task(self._run())

    def join(self, r: Resumer) -> None:
        self.joining.append(r)
        self.wake.set()

    def leave(self, r: Resumer) -> None:
        r.gone = True  # one being taken in now is dropped there
        if r in self.joining:
            self.joining.remove(r)
        if r in self.resumers:
            self.resumers.discard(r)
            for k in r.keys:
                subs = self.by_key.get(k, [])
                if r in subs:
                    subs.remove(r)
                if not subs:
                    self.by_key.pop(k, None)
        self.wake.set()

    async def _run(self) -> None:
        stats = self.hub.stats
        consumer = None
        position: int | None = None
        try:
            consumer = await start_consumer(group=None, bootstrap=self.hub.bootstrap, from_beginning=True)
            stats.consumers_started += 1
            consumer.assign([self.tp])
            while True:
                if self.joining:
                    position = await self._take_in(consumer, position)
                if not self.resumers:
                    if self.joining:
                        continue
                    self.wake.clear()
                    try:
                        await asyncio.wait_for(self.wake.wait(), LINGER_S)
                    except TimeoutError:
                        if not self.joining:
                            self._detach()  # no await since the check: a later resume starts a new reader
                            return
                    continue
                batch = (await consumer.getmany(self.tp, timeout_ms=POLL_MS, max_records=MAX_RECORDS)).get(
                    self.tp, ()
                )
                stats.records_read += len(batch)
                batch = list(unpack_all(batch))  # a step record: its chunks, each at the step's offset
                self.recent.extend(batch)
                while len(self.recent) > RECENT:
                    self.covered_from = self.recent.popleft().offset + 1
                await self._deliver(batch)
                position = await consumer.position(self.tp)
                for r in [r for r in self.resumers if r.until is not None and position >= r.until]:
                    r.queue.put_nowait(None)
                    self.leave(r)
        except Exception as exc:  # noqa: BLE001 - every resume of the partition ends; clients resume again
            log.warning("replay reader of %s failed: %s", self.tp, exc)
        finally:
            log.info(
                "replay reader of %s stopped: %d records read, %d seeks, %d resumes from their first"
                " record, %d from their admission time (all readers of this process)",
                self.tp,
                stats.records_read,
                stats.seeks_total,
                stats.exact,
                stats.fallback,
            )
            self._detach()
            for r in [*self.resumers, *self.joining]:
                r.queue.put_nowait(None)
            if consumer is not None:
                await consumer.stop()

    async def _deliver(self, records) -> None:
        """Each resumer's records among `records` (its keys, from its next offset on), in order."""
        out: dict[Resumer, list[Event]] = {}
        for record in records:
            wanting = [r for r in self.by_key.get(record.key, ()) if record.offset >= r.next]
            if not wanting:
                continue
            for r in wanting:
                r.next = resume_offset(record)
            try:
                event = await unblocked(decode, record.value or b"", *TOKENS.events)
            except DecodeError:
                continue
            for r in wanting:
                out.setdefault(r, []).append(event)
        for r, events in out.items():
            r.queue.put_nowait(events)

    def _detach(self) -> None:
        if self.hub.readers.get(self.tp.partition) is self:
            del self.hub.readers[self.tp.partition]

    async def _take_in(self, consumer, position: int | None) -> int | None:
        """Resolve the starts of the registrations waiting, seek back to the lowest if it lies behind."""
        joining, self.joining = self.joining, []
        stats = self.hub.stats
        known = await first_offsets(
            self.hub.redis(), {r.request_id: self.tp.partition for r in joining}
        )  # one MGET for all
        unknown = [r for r in joining if r.request_id not in known]
        end = (await consumer.end_offsets([self.tp]))[self.tp]
        fallback = end
        if unknown:
            at = max(0, min(r.admitted_ms for r in unknown) - CLOCK_MARGIN_MS)
            found = (await consumer.offsets_for_times({self.tp: at}))[self.tp]
            fallback = end if found is None else found.offset
        joining = [r for r in joining if not r.gone]  # ended while their starts were looked up
        if not joining:
            return position
        for r in joining:
            r.start = known.get(r.request_id, fallback)
            r.next = r.start
            if r.until is not None:
                r.until = end
            if r.request_id in known:
                stats.exact += 1
            else:
                stats.fallback += 1
            self.resumers.add(r)
            for k in r.keys:
                self.by_key.setdefault(k, []).append(r)
        lowest = min(r.start for r in joining)
        seek = position is None or lowest < self.covered_from
        log.info(
            "replay reader of %s: %d resumes taken in, %d from their first record; %s",
            self.tp,
            len(joining),
            sum(1 for r in joining if r.request_id in known),
            f"seek to {lowest}" if seek else f"reading on at {position}",
        )
        if seek:
            consumer.seek(self.tp, lowest)
            stats.seeks.append((self.tp.partition, lowest))  # (partition, offset), in order
            stats.seeks_total += 1
            self.recent.clear()
            self.covered_from = lowest
            return lowest
        await self._deliver(list(self.recent))  # those behind the position: from the records kept
        return position


class Hub:
    """This process's readers (one per partition) for one bootstrap, on one event loop."""

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        self.readers: dict[int, PartitionReader] = {}
        self.stats = Stats()
        self._redis = None

    def redis(self):
        if self._redis is None:
            self._redis = client(settings().redis_url)
        return self._redis

    def register(self, request_id: str, also: Iterable[str] = (), *, until_end: bool = False) -> Resumer:
        partition, admitted_ms = parse_request_id(request_id)
        r = Resumer(request_id, frozenset({request_id.encode(), *(k.encode() for k in also)}), admitted_ms)
        if until_end:
            r.until = -1  # set to the partition's end when taken in
        reader = self.readers.get(partition)
        if reader is None:
            reader = self.readers[partition] = PartitionReader(self, partition)
        reader.join(r)
        return r

    def unregister(self, r: Resumer) -> None:
        reader = self.readers.get(parse_request_id(r.request_id)[0])
        if reader is not None:
            reader.leave(r)

    async def close(self) -> None:
        """Stop every reader now (the resumes they serve end)."""
        readers = list(self.readers.values())
        for reader in readers:
            reader.task.cancel()
        await asyncio.gather(*(r.task for r in readers), return_exceptions=True)
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None


_hubs: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, Hub]] = weakref.WeakKeyDictionary()


def totals() -> Stats:
    """What every reader of this process did, all hubs together (the gateway's /metrics)."""
    out = Stats()
    for by_bootstrap in list(_hubs.values()):
        for h in by_bootstrap.values():
            s = h.stats
            out.consumers_started += s.consumers_started
            out.records_read += s.records_read
            out.seeks_total += s.seeks_total
            out.exact += s.exact
            out.fallback += s.fallback
    return out


def hub(bootstrap: str) -> Hub:
    """The hub of the running loop for `bootstrap`."""
    by_bootstrap = _hubs.setdefault(asyncio.get_running_loop(), {})
    if bootstrap not in by_bootstrap:
        by_bootstrap[bootstrap] = Hub(bootstrap)
    return by_bootstrap[bootstrap]
