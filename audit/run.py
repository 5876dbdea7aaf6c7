"""The three audits: one request, one conversation, every request admitted in a time range.

Each builds spans (topic-partition, start and stop offsets found by time) from the registry,
reads them merged in time order (audit.scan), folds each request's events (audit.fold) and
hands every finished request to a sink as soon as nothing more of it can come, so memory holds
only the requests still in flight at the scan's current time.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Self, Union

import msgspec
from aiokafka.structs import ConsumerRecord, TopicPartition

from audit.fold import CHUNKS, Audit, Chunk, ErasedRecord
from audit.scan import Span, merged, spans_between
from audit.sources import (
    admitted_ms,
    audited,
    conversation_partitions,
    keyed_by_request,
    request_partitions,
)
from common import sealing
from producers import start_consumer
from schemas import DecodeError, Erased, Event, TokenChunk
from schemas.codec import SUPPORTED_VERSIONS, decoder, sealer
from schemas.sealing import unseal
from topics.admin import partition_counts
from topics.registry import FLOW, TOKENS, TopicSpec

#: offsets_for_times starts this much before a request's admission (clock skew between hosts).
CLOCK_MARGIN_MS = 5_000
SWEEP_EVERY = 5_000  # records between two looks for requests that can have nothing more
FETCH_BYTES = 512 * 1024  # fetched per partition at a time: what memory holds per partition, at most
#: allocations between two young-generation garbage collections while scanning (Python's default is
#: 2,000): every record makes several objects that live until its batch is folded, and collecting
#: every 2,000 of them cost about 45% of the fold's CPU time; cycles are still collected, less often
GC_THRESHOLD = 50_000


@dataclass
class Options:
    bootstrap: str
    tenant: str | None = None
    horizon_s: float = 600.0  # how long after admission a request may still write events
    export: Callable[[dict], None] | None = None  # one JSON-able record per event kept
    progress: Callable[[int, int], None] = lambda done, total: None  # records read, records planned


@dataclass
class Outcome:
    audits: list[Audit] = field(default_factory=list)  # kept in full (request, conversation)
    requests: int = 0
    failed: int = 0
    open: int = 0
    records: int = 0
    undecodable: int = 0


def _order(specs: list[TopicSpec]) -> dict[str, int]:
    flow = {name: i for i, name in enumerate(FLOW)}
    return {
        s.name: flow.get("ts.inference.<model>" if s.name.startswith("ts.inference.") else s.name, 50)
        for s in specs
    }


class Auditor:
    """One group-less consumer over the broker; `request`, `conversation` and `range` share it."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.timelines = True  # range scans without --timeline turn this off (only the check is kept)

    async def __aenter__(self) -> Self:
        self.consumer = await start_consumer(
            group=None, bootstrap=self.opts.bootstrap, max_partition_fetch_bytes=FETCH_BYTES
        )
        counts = await partition_counts(self.opts.bootstrap)
        self.specs = {s.name: s for s in audited(list(counts))}
        self.partitions = {n: counts[n] for n in self.specs}
        self.order = _order(list(self.specs.values()))
        self.decoders = {n: decoder(*spec.events) for n, spec in self.specs.items()}
        # the scan's own: msgspec decoders called directly, token chunks as the lean audit.fold.Chunk
        # unless every event is exported whole
        lean = self.opts.export is None
        self.scan_decoders = {n: _raw_decoder(spec, lean) for n, spec in self.specs.items()}
        return self

    async def __aexit__(self, *exc) -> None:
        await self.consumer.stop()

    # ------------------------------------------------------------------ the three audits

    async def request(self, request_id: str, since_ms: int | None = None) -> Outcome:
        at = admitted_ms(request_id) or since_ms
        if at is None:
            raise ValueError(f"{request_id!r} is not a gateway request id: give --since")
        tps = [
            TopicPartition(n, p)
            for n, spec in self.specs.items()
            for p in request_partitions(spec, request_id, self.partitions[n])
        ]
        spans = await self._spans(tps, at - CLOCK_MARGIN_MS, at + int(self.opts.horizon_s * 1000))
        return await self._fold(
            spans, wanted=lambda rid, ts: rid == request_id, keep_all=True, keys={request_id.encode()}
        )

    async def conversation(self, conversation_id: str, since_ms: int | None, until_ms: int | None) -> Outcome:
        """First the conversation's requests (its keyed topics hold them in one partition each), then
        every event of those requests."""
        since = since_ms if since_ms is not None else admitted_ms(conversation_id)
        if since is None:
            raise ValueError("give --since for a conversation whose id is not a request id")
        tps = [
            TopicPartition(n, p)
            for n, spec in self.specs.items()
            for p in conversation_partitions(spec, conversation_id, self.opts.tenant, self.partitions[n])
        ]
        found: dict[str, int] = {}
        for record, event in await self._collect(await self._spans(tps, since - CLOCK_MARGIN_MS, until_ms)):
            if event.conversation_id == conversation_id and self._tenant_ok(event):
                found.setdefault(event.request_id, record.timestamp)
        if not found:
            return Outcome()
        times = [admitted_ms(r) or t for r, t in found.items()]
        first, last = min(times), max(times)
        tps = [TopicPartition(n, p) for n in self.specs for p in range(self.partitions[n])]
        spans = await self._spans(tps, first - CLOCK_MARGIN_MS, last + int(self.opts.horizon_s * 1000))
        return await self._fold(
            spans, wanted=lambda rid, ts: rid in found, keep_all=True, keys={r.encode() for r in found}
        )

    async def range(
        self, since_ms: int, until_ms: int, keep: Callable[[Audit], None | Awaitable[None]]
    ) -> Outcome:
        """Every request admitted in [since, until): each finished audit goes to `keep` (a function or
        a coroutine function), not kept here."""
        tps = [TopicPartition(n, p) for n in self.specs for p in range(self.partitions[n])]
        spans = await self._spans(tps, since_ms - CLOCK_MARGIN_MS, until_ms + int(self.opts.horizon_s * 1000))
        seen: dict[str, bool] = {}

        def wanted(rid: str, ts: int) -> bool:
            if rid not in seen:
                at = admitted_ms(rid)
                seen[rid] = since_ms <= (at if at is not None else ts) < until_ms
            return seen[rid]

        outcome = await self._fold(spans, wanted=wanted, keep_all=False, sink=keep, forget=seen)
        return outcome

    # ------------------------------------------------------------------ the machinery

    def _tenant_ok(self, event: Event) -> bool:
        return self.opts.tenant is None or event.tenant == self.opts.tenant

    async def _spans(
        self, tps: list[TopicPartition], since_ms: int | None, until_ms: int | None
    ) -> list[Span]:
        now = int(time.time() * 1000)
        self.last_spans = await spans_between(
            self.consumer, tps, since_ms, until_ms if until_ms and until_ms < now else None
        )
        return self.last_spans

    def _decode(self, record: ConsumerRecord) -> Event | ErasedRecord | None:
        try:
            return self.decoders[record.topic](record.value or b"")
        except Erased as exc:
            return ErasedRecord.of(exc.clear)
        except DecodeError:
            return None

    async def _collect(self, spans: list[Span]) -> list[tuple[ConsumerRecord, Event]]:
        out = []
        async for batch in merged(self.consumer, spans, self.order):
            await sealing.hold_keys(batch)  # the keys it lacks fetched off the loop
            for record in batch:
                event = self._decode(record)
                if event is not None:
                    out.append((record, event))
        return out

    async def _fold(
        self,
        spans: list[Span],
        *,
        wanted: Callable[[str, int], bool],
        keep_all: bool,
        sink: Callable[[Audit], None | Awaitable[None]] | None = None,
        forget: dict | None = None,
        keys: set[bytes] | None = None,
    ) -> Outcome:
        """Fold every record of `spans` into the audits of the requests `wanted` says yes to.

        `keys`: the only Kafka keys of interest on topics keyed by request id (one request or a
        conversation's): other records there are passed over before their value is decoded.
        """
        outcome = Outcome()
        total = sum(s.size for s in spans)
        live: dict[str, Audit] = {}  # in order of first appearance: the oldest are swept first
        horizon_ms = int(self.opts.horizon_s * 1000)
        read = 0

        def progress(n: int) -> None:
            nonlocal read
            read += n
            self.opts.progress(read, total)

        async def close(audit: Audit) -> None:
            audit.finish()
            if self.opts.tenant is not None and audit.tenant != self.opts.tenant:
                return
            open_ok = not audit.completed and time.time() * 1000 - audit.last_ms < horizon_ms
            outcome.requests += 1
            outcome.open += open_ok and not audit.completed
            outcome.failed += bool(audit.problems(open_ok=open_ok))
            audit.open_ok = open_ok
            if keep_all:
                outcome.audits.append(audit)
            if sink is not None:
                result = sink(audit)
                if inspect.isawaitable(result):
                    await result

        async def sweep(now_ms: int) -> None:
            """Close the requests that wrote nothing for a horizon. `live` is in order of first
            appearance and a request's last event is never before its first, so only the front,
            admitted more than a horizon ago, needs looking at."""
            writing = []
            while live:
                audit = live[next(iter(live))]
                if now_ms - audit.first_ms <= horizon_ms:
                    break
                del live[audit.request_id]
                if now_ms - audit.last_ms > horizon_ms:
                    await close(audit)
                else:
                    writing.append(audit)
            for audit in writing:  # still writing: looked at again once the requests after them are
                live[audit.request_id] = audit
            if forget is not None and len(forget) > 100_000:
                forget.clear()

        decoders, export, timeline = self.scan_decoders, self.opts.export, keep_all or self.timelines
        filtered = (
            {n for n, spec in self.specs.items() if keyed_by_request(spec)} if keys is not None else set()
        )
        undecodable = since_sweep = 0
        tenant_ok, tokens, keys_held = self._tenant_ok, TOKENS.name, sealer()
        async with _fewer_collections():
            async for batch in merged(self.consumer, spans, self.order, progress):
                for record in batch:
                    topic = record.topic
                    if topic in filtered and record.key not in keys:
                        continue
                    try:
                        event = decoders[topic](unseal(record.value or b"", keys_held))
                    except Erased as exc:
                        event = ErasedRecord.of(exc.clear)
                    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, DecodeError):
                        undecodable += 1
                        continue
                    if not isinstance(event, ErasedRecord) and event.v not in SUPPORTED_VERSIONS:
                        undecodable += 1
                        continue
                    rid = event.request_id
                    audit = live.get(rid)
                    if audit is None:
                        if not wanted(rid, record.timestamp):
                            continue
                        audit = live[rid] = Audit(rid, timeline=timeline)
                    if topic == tokens and type(event) in CHUNKS:  # the bulk: straight to the chunk fold
                        audit.chunk(record.partition, record.offset, record.timestamp, event)
                    else:
                        audit.add(topic, record.partition, record.offset, record.timestamp, event)
                    if export is not None and tenant_ok(event) and not isinstance(event, ErasedRecord):
                        export(
                            {
                                "topic": topic,
                                "partition": record.partition,
                                "offset": record.offset,
                                "timestamp": record.timestamp,
                                "event": msgspec.to_builtins(event),
                            }
                        )
                since_sweep += len(batch)
                if not keep_all and since_sweep >= SWEEP_EVERY:  # finish requests that can have nothing more
                    since_sweep = 0
                    await sweep(batch[-1].timestamp)
        for audit in live.values():
            await close(audit)
        outcome.records = read  # records of the log (a step record once, its chunks folded each)
        outcome.undecodable = undecodable
        return outcome


@contextlib.asynccontextmanager
async def _fewer_collections():
    """Young-generation collections every GC_THRESHOLD allocations while a scan runs (see there)."""
    before = gc.get_threshold()
    gc.set_threshold(max(before[0], GC_THRESHOLD), *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)


def _raw_decoder(spec: TopicSpec, lean: bool) -> Callable[[bytes], Event]:
    """The msgspec decoder of a topic's event types (TokenChunk read as audit.fold.Chunk when `lean`)."""
    types = tuple(Chunk if lean and t is TokenChunk else t for t in spec.events)
    return msgspec.json.Decoder(types[0] if len(types) == 1 else Union[types]).decode  # noqa: UP007
