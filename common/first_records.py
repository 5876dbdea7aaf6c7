"""Where a request's first record on the tokens topic lies, kept in the durable Redis.

A reader of a request's events (a gateway resume, a worker taking the request over) seeks to that
offset instead of scanning the reply partition from shortly before the request's admission.

Writer (the worker, and the benchmark's synthetic worker, through `FirstRecords`): the writer of a
request's first record passes the send's acknowledgement future to `note`; once the broker acknowledges
it, "<partition>:<offset>" is set under `schemas.keys.first_record(request_id)` with SET NX (the first
writer's offset stays) and a TTL of GATEWAY_META_TTL_S. Writes never block the writer's loop: the
acknowledgements resolved together (a produce batch, so an engine step) go to Redis in one pipeline, in a
task of their own; a failure is logged and the readers fall back to the scan.

The worker notes its chunk 0 (or a Completion at seq 0): the request's first record of its own. Where
the safety processor writes the request's input verdict in band (parallel screening, moderated output:
`verdict_in_band`), that verdict may come first: the worker's note then ends in ":v", and the verdict's
writer notes the verdict under `schemas.keys.first_verdict(request_id)` (`note_verdict`). A reader that
needs the verdict (a gateway resume) starts at the lower of the two, and scans as before while the
verdict's note is missing; one that reads chunks and Completions only (a takeover) starts at the
worker's. Where a note is absent (Redis down, the writer died before its ack, nothing written yet) the
reader scans as before.

A reader that had to scan from before a request's admission (a takeover) knows where the request's
first record lies: it sets the key (NX) with `record_found`, so later readers seek there.

Reader: `first_offsets` answers with the offsets found, one MGET for a batch; {} when Redis cannot say.
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial

from common.redis_pool import bounded
from schemas import keys as K

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 4  # one pipeline per produce batch: a writer needs few


def client(url: str):
    """A small bounded client of the durable Redis for these keys (one per process and loop)."""
    return bounded(url, socket_timeout=2, socket_connect_timeout=1, max_connections=MAX_CONNECTIONS)


class FirstRecords:
    """The writer's side: `note(request_id, ack)` for a request's first record."""

    def __init__(self, url: str | None, ttl_s: int = K.GATEWAY_META_TTL_S) -> None:
        self.redis = client(url) if url else None
        self.ttl_s = ttl_s
        self._pending: dict[str, str] = {}  # Redis key -> value
        self._flushing: asyncio.Task | None = None
        self._failing = False
        self.written = 0  # keys written (tests and logs)

    def note(self, request_id: str, ack: asyncio.Future, *, verdict_first: bool = False) -> None:
        """Record where `request_id`'s first record lies once `ack` (the send's future of its
        RecordMetadata) resolves; nothing when it fails (the record was not written). `verdict_first`:
        the request's input verdict is written in band by another role and may lie before it."""
        if self.redis is not None:
            key = K.first_record(request_id)
            ack.add_done_callback(partial(self._acked, key, ":v" if verdict_first else ""))

    def note_verdict(self, request_id: str, ack: asyncio.Future) -> None:
        """The same for the request's input verdict written in band (the safety processor's hook)."""
        if self.redis is not None:
            ack.add_done_callback(partial(self._acked, K.first_verdict(request_id), ""))

    def _acked(self, key: str, suffix: str, ack: asyncio.Future) -> None:
        if ack.cancelled() or ack.exception() is not None:
            return
        meta = ack.result()
        self._pending.setdefault(key, f"{meta.partition}:{meta.offset}{suffix}")
        if self._flushing is None or self._flushing.done():
            self._flushing = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, {}
            try:
                await _set_new(self.redis, batch, self.ttl_s)
                self.written += len(batch)
                if self._failing:
                    self._failing = False
                    log.info("first-record offsets written to Redis again")
            except Exception as exc:  # noqa: BLE001 - readers fall back to the scan
                if not self._failing:
                    log.warning("first-record offsets of %d requests not written: %s", len(batch), exc)
                self._failing = True

    async def close(self) -> None:
        """Write what is pending, then close the client."""
        if self._flushing is not None:
            await asyncio.gather(self._flushing, return_exceptions=True)
        if self.redis is not None:
            await self.redis.aclose()


def starts_stream(seq: int | None) -> bool:
    """Whether a worker's record at chunk/completion `seq` is its request's first of its own."""
    return seq == 0


def verdict_in_band(screening: str, moderated: bool) -> bool:
    """Whether the safety processor writes the request's input verdict in band, maybe before the
    worker's first record (processors/safety/agent.py)."""
    return screening == "parallel" or moderated


def _offset(value, partition: int) -> tuple[int, bool] | None:
    """(offset, verdict may precede) of a note on `partition`; None for another partition or garbage."""
    if value is None:
        return None
    try:
        parts = (value.decode() if isinstance(value, bytes) else value).split(":")
        if int(parts[0]) != partition:
            return None
        return int(parts[1]), parts[2:] == ["v"]
    except (ValueError, IndexError):
        return None


async def first_offsets(redis, partitions: dict[str, int], *, verdicts: bool = True) -> dict[str, int]:
    """Where to start reading each request id of `partitions` (request id -> its reply partition), for
    those whose notes say so; {} when Redis cannot answer. `verdicts`: the reader needs the request's
    in-band input verdict too (a resume); False: chunks and Completions only (a takeover)."""
    if redis is None or not partitions:
        return {}
    rids = list(partitions)
    keys = [K.first_record(r) for r in rids] + ([K.first_verdict(r) for r in rids] if verdicts else [])
    try:
        values = await redis.mget(keys)
    except Exception as exc:  # noqa: BLE001 - the caller scans instead
        log.warning("first-record offsets unavailable (%s): scanning instead", exc)
        return {}
    found: dict[str, int] = {}
    for i, rid in enumerate(rids):
        own = _offset(values[i], partitions[rid])
        if own is None:
            continue
        offset, verdict_first = own
        if verdicts and verdict_first:
            verdict = _offset(values[len(rids) + i], partitions[rid])
            if verdict is None:
                continue  # the verdict may lie before, unnoted: scan
            offset = min(offset, verdict[0])
        found[rid] = offset
    return found


async def record_found(redis, found: dict[str, tuple[int, int]], ttl_s: int = K.GATEWAY_META_TTL_S) -> None:
    """Set (NX) the keys of requests a reader found the first records of by a scan from before their
    admission ({request id: (partition, offset)}); a failure is logged only."""
    if redis is None or not found:
        return
    try:
        notes = {K.first_record(rid): f"{partition}:{offset}" for rid, (partition, offset) in found.items()}
        await _set_new(redis, notes, ttl_s)
    except Exception as exc:  # noqa: BLE001
        log.warning("first-record offsets of %d requests not written: %s", len(found), exc)


async def _set_new(redis, values: dict[str, str], ttl_s: int) -> None:
    """SET NX each key to its value, with `ttl_s`, in one pipeline: the first note of a key stays."""
    async with redis.pipeline(transaction=False) as pipe:
        for key, value in values.items():
            pipe.set(key, value, ex=ttl_s, nx=True)
        await pipe.execute()
