"""Resumable streams: self-describing request ids, SSE event ids, and replay from the log.

A request id names its reply partition and admission time, `<16 hex>p<partition>t<ms>`, so
any gateway instance can find the request's events in the tokens topic without shared
state: the topic stamps records with LogAppendTime, so offsets_for_times(admission time)
is at or before the request's first event. SSE ids are `<request_id>:<position>`;
positions are the event seqs (the role chunk is -1; the completion at seq c gives the
finish chunk c, the usage chunk c+1 and [DONE] c+2), so a client that saw position n
gets exactly the frames after n.
"""

from __future__ import annotations

import re
import time
import secrets
from collections.abc import AsyncIterator

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from schemas import Completion, DecodeError, Event, SafetyVerdict, decode
from topics import TOKENS

_ID = re.compile(r"^[0-9a-f]{16}p(\d+)t(\d+)$")
NOTHING_SEEN = -2
#: offsets_for_times starts this much before admission (clock differences between hosts).
CLOCK_MARGIN_MS = 5_000


def new_request_id(partition: int, created_at: float) -> str:
    return f"{secrets.token_hex(8)}p{partition}t{int(created_at * 1000)}"


def parse_request_id(request_id: str) -> tuple[int, int]:
    """(reply partition, admission time in ms), or ValueError for an id this gateway did not make."""
    m = _ID.match(request_id)
    if not m:
        raise ValueError(f"not a tokenstream request id: {request_id!r}")
    return int(m.group(1)), int(m.group(2))


def event_id(request_id: str, position: int) -> str:
    return f"{request_id}:{position}"


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


async def replay(bootstrap: str, request_id: str, *, idle_timeout_s: float = 600.0
                 ) -> AsyncIterator[list[Event]]:
    """Every event of `request_id` from the log, in order, then live until its Completion.

    Yields batches; stops after the Completion, or after `idle_timeout_s` without any event
    of the request. Duplicates (at-least-once writes) are left to the caller's seq check.
    """
    partition, created_ms = parse_request_id(request_id)
    tp = TopicPartition(TOKENS.name, partition)
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                                isolation_level="read_committed", auto_offset_reset="earliest",
                                fetch_max_wait_ms=100)
    await consumer.start()
    try:
        consumer.assign([tp])
        found = (await consumer.offsets_for_times({tp: max(0, created_ms - CLOCK_MARGIN_MS)}))[tp]
        if found is None:
            await consumer.seek_to_end(tp)  # nothing written since: everything is still to come
        else:
            consumer.seek(tp, found.offset)
        key = request_id.encode()
        last = time.monotonic()
        while True:
            batches = await consumer.getmany(tp, timeout_ms=200, max_records=2000)
            out: list[Event] = []
            for record in batches.get(tp, ()):
                if record.key != key:
                    continue
                try:
                    out.append(decode(record.value or b"", *TOKENS.events))
                except DecodeError:
                    continue
            if out:
                last = time.monotonic()
                yield out
                if any(ends_answer(e) for e in out):
                    return
            else:
                if time.monotonic() - last >= idle_timeout_s:
                    return
    finally:
        await consumer.stop()
