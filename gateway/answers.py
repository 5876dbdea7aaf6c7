"""Delivering an answer to its client: an SSE stream of chunks, or one collected JSON body.

Both read batches of token events (live from the fan-out, or replayed from the log) and end
the request's attachment: released when the answer was delivered in full, detached (cancelled
after the grace period unless resumed) when the client left early.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse

from gateway import openai_api as api
from gateway.fanout import SlowReader, Stream
from gateway.framing import Framer, call_delta, content_filtered
from gateway.pipeline import Gateway
from gateway.screening import held_until_screened
from gateway.sse import SSEResponse, frame
from schemas import Completion, Event, SafetyVerdict, TokenChunk

Settle = Callable[[Completion, list[str]], Awaitable[None]]  # the completion, the texts delivered
BeforeEnd = Callable[[Completion], Awaitable[None]]  # done with the completion before the client sees the end


def live_events(
    gw: Gateway, stream: Stream, observe: Callable[[list[Event]], None] | None = None
) -> AsyncIterator[list[Event]]:
    """Batches of a subscribed stream until none comes within the progress timeout; held back until
    the input verdict when this instance screens in parallel. `observe` sees each batch as it
    arrives (the request's trace span)."""

    async def live() -> AsyncIterator[list[Event]]:
        while True:
            batch = await stream.take(gw.cfg.progress_timeout_s)
            if not batch:
                return
            if observe is not None:
                observe(batch)
            yield batch

    return held_until_screened(live()) if gw.cfg.screening == "parallel" else live()


def sse_response(
    gw: Gateway,
    framer: Framer,
    source: AsyncIterator[list[Event]],
    generation: int,
    started: float,
    cleanup: Callable[[], None],
    *,
    settle: Settle | None = None,
    before_end: BeforeEnd | None = None,
    headers: dict[str, str] | None = None,
) -> SSEResponse:
    """Stream `source` as OpenAI chunks; `started` (monotonic) is the admission time for TTFT, or 0.

    `settle` runs (in the background) with the completion and the texts sent once the answer has ended;
    `before_end` is awaited with the completion before the answer's last frames go out (what a client
    may read as soon as it has the end, such as its conversation's new items); `headers` go on the
    response (rate limit headers).
    """

    async def frames():
        observed = timed_out = False
        try:
            yield framer.start()
            try:
                async for batch in source:
                    ending = before_end is not None and any(isinstance(e, Completion) for e in batch)
                    if ending:  # the tokens before the end go out now; the end waits on before_end
                        cut = next(i for i, e in enumerate(batch) if isinstance(e, Completion))
                        yield framer.frames(batch[:cut])
                        batch = batch[cut:]
                    out = framer.frames(batch)
                    if framer.first_token_at is not None and started and not observed:
                        gw.metrics.ttft.observe(framer.first_token_at - started)
                        observed = True
                    if ending and framer.done and framer.completion is not None:
                        await before_end(framer.completion)
                    yield out
                    if framer.done:
                        return
            except SlowReader:  # dropped for holding up others: the client resumes at its own pace
                yield [
                    _error_frame(
                        "This stream fell too far behind and was ended; resume it with GET "
                        f"/v1/chat/completions/{framer.cid}/stream and the Last-Event-ID header.",
                        "slow_reader",
                    )
                ]
                return
            if not framer.done:  # no progress within the deadline: the client hears why, the work stops
                timed_out = True
                yield [
                    _error_frame(
                        f"The model made no progress for {gw.cfg.progress_timeout_s:.0f}s; "
                        "the request was cancelled. Please retry.",
                        "timeout",
                    )
                ]
        finally:
            cleanup()
            with contextlib.suppress(Exception):
                await source.aclose()  # type: ignore[attr-defined]
            if framer.completion is not None and settle is not None:
                gw.background(settle(framer.completion, framer.sent))
            if timed_out:
                gw.canceller.no_progress(framer.rid, generation)
            elif framer.done:
                gw.canceller.release(framer.rid)
            else:
                gw.canceller.detached(framer.rid, generation)

    return gw.sse.response(frames(), headers)


def _error_frame(message: str, code: str) -> bytes:
    return frame(json.dumps(api.error_body(message, "server_error", None, code)))


async def collect(
    gw: Gateway,
    rid: str,
    model_name: str,
    created: int,
    source: AsyncIterator[list[Event]],
    generation: int,
    request: Request,
    cleanup: Callable[[], None],
    *,
    settle: Settle | None = None,
    before_end: BeforeEnd | None = None,
    headers: dict[str, str] | None = None,
    logprobs: bool = False,
) -> JSONResponse:
    """Wait for the whole answer and return it as one `chat.completion` body (with each token's log
    probability when `logprobs`); `settle` and `before_end` as in `sse_response`."""
    text: list[str] = []
    reported: list = []  # schemas.TokenLogprob of every chunk, in order
    calls: list[dict] = []  # OpenAI's message.tool_calls, assembled from the deltas
    next_seq = 0

    async def gather() -> Completion | None:
        nonlocal next_seq
        async for batch in source:
            for ev in batch:
                if isinstance(ev, TokenChunk):
                    if ev.seq >= next_seq:
                        text.append(ev.text)
                        reported.extend(ev.logprobs)
                        for d in ev.tool_calls:
                            if d.id:
                                calls.append({k: v for k, v in call_delta(d).items() if k != "index"})
                            else:
                                calls[d.index]["function"]["arguments"] += d.arguments
                        next_seq = ev.seq + 1
                elif isinstance(ev, Completion):
                    return ev
                elif isinstance(ev, SafetyVerdict) and ev.blocked:
                    return content_filtered(ev, next_seq)
        return None

    async def watch_disconnect() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(0.5)

    gather_task = asyncio.ensure_future(gather())
    watch_task = asyncio.ensure_future(watch_disconnect())
    try:
        await asyncio.wait({gather_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        if not gather_task.done():  # the client left: nobody can resume a non-streamed answer
            gather_task.cancel()
            gw.canceller.detached(rid, generation, grace_s=0)
            return JSONResponse({}, status_code=499)
        done = gather_task.result()
    finally:
        watch_task.cancel()
        cleanup()
    if done is None:
        gw.canceller.no_progress(rid, generation)
        raise api.APIError(
            504,
            f"The model made no progress for {gw.cfg.progress_timeout_s:.0f}s; the request "
            "was cancelled. Please retry.",
            "server_error",
            code="timeout",
        )
    gw.canceller.release(rid)
    if before_end is not None:
        await before_end(done)
    if settle is not None:
        gw.background(settle(done, text))
    if done.finish_reason == "error":
        raise api.refusal(done)
    return JSONResponse(
        api.completion_body(
            api.completion_id(rid),
            created,
            model_name,
            "".join(text),
            api.finish_reason_for_client(done.finish_reason),
            done.usage.prompt_tokens,
            done.usage.completion_tokens,
            done.usage.cached_tokens,
            tool_calls=calls,
            logprobs=reported if logprobs else None,
        ),
        headers=headers,
    )
