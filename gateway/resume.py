"""Resumable streams: SSE event ids and replay from the log.

The request id and SSE event id formats are contracts in `schemas.ids`: a request id names
its reply partition and admission time, so any gateway instance finds the request's events
in the tokens topic without shared state, and a client that saw position n gets exactly
the frames after n.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterable

from aiokafka.structs import TopicPartition

from producers import start_consumer
from schemas import Completion, DecodeError, Event, SafetyVerdict, decode
from schemas.ids import event_id, new_request_id, parse_request_id  # noqa: F401 - re-exported
from topics import TOKENS

NOTHING_SEEN = -2
#: offsets_for_times starts this much before admission (clock differences between hosts).
CLOCK_MARGIN_MS = 5_000


def parse_last_event_id(value: str | None, request_id: str) -> int:
    """The last position the client saw; NOTHING_SEEN when none. ValueError if it names another request."""
    if not value:
        return NOTHING_SEEN
    rid, sep, pos = value.strip().rpartition(":")
    if not sep or rid != request_id:
        raise ValueError("Last-Event-ID does not belong to this completion")
    try:
        return int(pos)
    except ValueError:
        raise ValueError("Last-Event-ID position is not an integer") from None


def ends_answer(event: Event) -> bool:
    """A completion ends an answer; so does a blocking output verdict (the stream is cut)."""
    return isinstance(event, Completion) or (isinstance(event, SafetyVerdict) and event.blocked)


async def replay(
    bootstrap: str,
    request_id: str,
    *,
    idle_timeout_s: float = 600.0,
    also: Iterable[str] = (),
    ends: Callable[[Event], bool] = ends_answer,
) -> AsyncIterator[list[Event]]:
    """Every event of `request_id` (and of the request ids `also`, on the same partition: a run's
    steps) from the log, in order, then live until one `ends` the answer.

    Yields batches; stops after that event, or after `idle_timeout_s` without any event
    of the request. Duplicates (at-least-once writes) are left to the caller's seq check.
    """
    partition, created_ms = parse_request_id(request_id)
    tp = TopicPartition(TOKENS.name, partition)
    consumer = await start_consumer(group=None, bootstrap=bootstrap, from_beginning=True)
    try:
        consumer.assign([tp])
        found = (await consumer.offsets_for_times({tp: max(0, created_ms - CLOCK_MARGIN_MS)}))[tp]
        if found is None:
            await consumer.seek_to_end(tp)  # nothing written since: everything is still to come
        else:
            consumer.seek(tp, found.offset)
        keys = {request_id.encode(), *(k.encode() for k in also)}
        last = time.monotonic()
        while True:
            batches = await consumer.getmany(tp, timeout_ms=200, max_records=2000)
            out: list[Event] = []
            for record in batches.get(tp, ()):
                if record.key not in keys:
                    continue
                try:
                    out.append(decode(record.value or b"", *TOKENS.events))
                except DecodeError:
                    continue
            if out:
                last = time.monotonic()
                yield out
                if any(ends(e) for e in out):
                    return
            else:
                if time.monotonic() - last >= idle_timeout_s:
                    return
    finally:
        await consumer.stop()


async def read_so_far(bootstrap: str, request_id: str, *, also: Iterable[str] = ()) -> list[Event]:
    """Every event of `request_id` (and of `also`) the log holds now: read to the partition's end as it
    was when called, then stop (a background response's state, folded by whoever asks)."""
    partition, created_ms = parse_request_id(request_id)
    tp = TopicPartition(TOKENS.name, partition)
    consumer = await start_consumer(group=None, bootstrap=bootstrap, from_beginning=True)
    try:
        consumer.assign([tp])
        end = (await consumer.end_offsets([tp]))[tp]
        found = (await consumer.offsets_for_times({tp: max(0, created_ms - CLOCK_MARGIN_MS)}))[tp]
        if found is None:
            return []
        consumer.seek(tp, found.offset)
        keys = {request_id.encode(), *(k.encode() for k in also)}
        out: list[Event] = []
        while await consumer.position(tp) < end:
            for record in (await consumer.getmany(tp, timeout_ms=200, max_records=2000)).get(tp, ()):
                if record.offset >= end:
                    break
                if record.key in keys:
                    try:
                        out.append(decode(record.value or b"", *TOKENS.events))
                    except DecodeError:
                        continue
        return out
    finally:
        await consumer.stop()
