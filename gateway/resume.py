"""Resumable streams: SSE event ids and replay from the log.

The request id and SSE event id formats are contracts in `schemas.ids`: a request id names
its reply partition and admission time, so any gateway instance finds the request's events
in the tokens topic, and a client that saw position n gets exactly the frames after n. The read
starts at the request's first record (its offset noted in Redis by its writer; the admission time
when the note is missing): gateway/replays.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterable

from gateway.replays import hub
from schemas import Completion, Event, SafetyVerdict
from schemas.ids import event_id, new_request_id, parse_request_id  # noqa: F401 - re-exported

NOTHING_SEEN = -2


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

    Read from the request's first record on (gateway/replays.py: one consumer per partition serves
    every resume in flight on it). Yields batches; stops after that event, or after `idle_timeout_s`
    without any event of the request. Duplicates (at-least-once writes) are left to the caller's seq
    check.
    """
    h = hub(bootstrap)
    resumer = h.register(request_id, also)
    try:
        last = time.monotonic()
        while True:
            left = idle_timeout_s - (time.monotonic() - last)
            try:
                batch = await asyncio.wait_for(resumer.queue.get(), max(0.0, left))
            except TimeoutError:
                return
            if batch is None:  # its reader stopped (a broker error): the client resumes again
                return
            last = time.monotonic()
            yield batch
            if any(ends(e) for e in batch):
                return
    finally:
        h.unregister(resumer)


async def read_so_far(bootstrap: str, request_id: str, *, also: Iterable[str] = ()) -> list[Event]:
    """Every event of `request_id` (and of `also`) the log holds now: read from its first record to the
    partition's end as it was when the read began, then stop (a background response's state, folded by
    whoever asks)."""
    h = hub(bootstrap)
    resumer = h.register(request_id, also, until_end=True)
    out: list[Event] = []
    try:
        while (batch := await resumer.queue.get()) is not None:
            out.extend(batch)
        return out
    finally:
        h.unregister(resumer)
