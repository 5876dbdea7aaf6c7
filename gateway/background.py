"""Background responses (`"background": true`): the run goes on without a client, and its state is a
function of the log, so any gateway instance can say where it stands, for as long as the topics
keep its events, after any restart.

- `POST /v1/responses` answers at once with the response `queued`; the admitting instance follows
  the run on its own tokens partition (`follow`) and, at the end, stores the response and settles
  its usage, like a foreground run whose client read it to the end.
- `GET /v1/responses/{id}` of a background response not stored yet folds the run's events read to
  the log's current end (`snapshot`): `queued` before the first event, then `in_progress`, then its
  end. When that end is there but nobody stored it (the admitting instance died), the reader
  stores it and settles the usage (once per request, whoever does it: `RateLimiter.settle`).
- `GET ...?stream=true&starting_after=N` replays from the log like any response.
- `POST /v1/responses/{id}/cancel` writes a Cancel for the run's current step and every later one
  (the workers remember cancels of requests still to come), so the run ends `cancelled` at the
  step it is in, or at the next one if its tools are running now.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from common import sealing
from gateway.pipeline import Gateway
from gateway.responses_framing import ResponseFramer
from gateway.resume import read_so_far
from gateway.screening import held_until_screened
from schemas import Event
from schemas import keys as K
from schemas.ids import step_request_id

log = logging.getLogger(__name__)
CANCEL_WAIT_S = 10.0  # how long `cancel` waits to answer with the run ended


Finish = Callable[[ResponseFramer], Awaitable[None]]  # store the ended response, settle its usage


async def fold(
    framer: ResponseFramer, source: AsyncIterator[list[Event]], cleanup: Callable[[], None]
) -> bool:
    """Feed the run's event batches to `framer` until it ends (True) or `source` gives out (False: no
    progress within its deadline); `cleanup` then, whichever."""
    try:
        async for batch in source:
            framer.feed(batch)
            if framer.done:
                break
    finally:
        cleanup()
        with contextlib.suppress(Exception):
            await source.aclose()  # type: ignore[attr-defined]
    return framer.done


async def follow(
    gw: Gateway,
    framer: ResponseFramer,
    source: AsyncIterator[list[Event]],
    generation: int,
    cleanup: Callable[[], None],
    finish: Finish,
) -> None:
    """The admitting instance's fold of a background run, to its end (then `finish` stores it)."""
    if await fold(framer, source, cleanup):
        gw.canceller.release(framer.run_id)
        await finish(framer)
    else:  # no progress within the deadline: the run is cancelled, its state stays on the log
        gw.canceller.no_progress(framer.run_id, generation)


async def snapshot(gw: Gateway, framer: ResponseFramer, meta: dict, finish: Finish) -> dict:
    """The run's state as the log holds it now (folded into the fresh `framer`); stored, and its usage
    settled, once it has ended."""
    steps = [step_request_id(framer.run_id, k) for k in range(1, framer.spec.max_steps)]
    events = await read_so_far(gw.bootstrap, framer.run_id, also=steps)
    if meta.get("screening") == "parallel":  # text before the input verdict is never shown

        async def held() -> AsyncIterator[list[Event]]:
            yield events

        events = [e for batch in [b async for b in held_until_screened(held())] for e in batch]
    framer.feed(events)
    if not events:
        framer.response["status"] = "queued"
    if framer.done:
        await finish(framer)
    return framer.response


async def stored(gw: Gateway, run_id: str) -> dict | None:
    raw = await gw.redis.get(K.stored_response(run_id)) if gw.redis is not None else None
    return await sealing.unblocked(sealing.open_json, raw)  # None: absent or erased (`tokenstream erase`)


async def cancel(gw: Gateway, new_framer: Callable[[], ResponseFramer], meta: dict, finish: Finish) -> dict:
    """Cancel the run at the step it is in (and any later one), then answer with its state: ended, or as
    it stands after CANCEL_WAIT_S."""
    framer = new_framer()
    for rid in [framer.run_id, *(step_request_id(framer.run_id, k) for k in range(1, framer.spec.max_steps))]:
        await gw.canceller.cancel(rid, "client")
    deadline = time.monotonic() + CANCEL_WAIT_S
    while True:
        state = await snapshot(gw, framer, meta, finish)
        if framer.done or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.2)
        framer = new_framer()
