"""Server-sent events, lean enough for ten thousand streams on one event loop.

A stream's source yields batches of frames; each batch goes to the socket as one ASGI body message
(one write), and nothing else runs per event: no task, timer or cancel scope per frame. Per stream
there is one extra task, waiting for the client to leave (it cancels the stream at once, so the
request's attachment ends as it would for any early exit). Keep-alive pings and the bound on a stuck
send are kept by one `Streams` task per gateway that looks at every open stream once a second:

- a stream that wrote nothing for `ping_s` gets a ping (a comment line, `: ping`, which ends no
  event: the OpenAI SDK keeps the last event id and would parse a blank-line-ended ping as an empty
  event);
- a stream whose write has waited on its client for `stuck_s` (the client reads nothing and the
  socket's buffers are full) is cancelled, and so ends as if the client had left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable

from starlette.responses import StreamingResponse

log = logging.getLogger(__name__)

PING = b": ping\r\n"


def frame(data: str, *, id: str | None = None, event: str | None = None) -> bytes:
    """One SSE event: `id`, `event`, then `data` (a `data:` line per line of it), ended by a blank line."""
    out = []
    if id is not None:
        out.append(f"id: {_one_line(id)}\r\n")
    if event is not None:
        out.append(f"event: {_one_line(event)}\r\n")
    if "\n" in data or "\r" in data:
        out += [f"data: {line}\r\n" for line in data.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    else:
        out.append(f"data: {data}\r\n")
    out.append("\r\n")
    return "".join(out).encode()


def data_of(frame: bytes) -> str:
    """The data of one frame written by `frame` (its `data:` lines joined as the SSE spec joins them)."""
    return "\n".join(line[6:] for line in frame.decode().split("\r\n") if line.startswith("data: "))


def _one_line(value: str) -> str:
    return value.replace("\r", "").replace("\n", "")


class _Open:
    """One open stream, as the `Streams` task sees it."""

    __slots__ = ("ended", "send", "sending_since", "task", "wrote")

    def __init__(self, send, task: asyncio.Task, now: float) -> None:
        self.send = send
        self.task = task
        self.ended: str | None = None  # why it was cancelled here: "left" or "stuck"
        self.wrote = now  # loop time of its last write
        self.sending_since: float | None = None  # loop time its pending write began, if one waits


class Streams:
    """The open SSE streams of one gateway: pings the idle ones, ends the stuck ones (see the module)."""

    def __init__(self, ping_s: float, stuck_s: float) -> None:
        self.ping_s = ping_s
        self.stuck_s = stuck_s
        self.open: set[_Open] = set()
        self._pings: set[asyncio.Task] = set()
        self.stuck = 0  # streams ended because their client read nothing for stuck_s

    async def run(self, every_s: float = 1.0) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(every_s)
            now = loop.time()
            for s in list(self.open):
                if s.sending_since is not None:
                    if now - s.sending_since >= self.stuck_s:
                        log.warning(
                            "ending a stream whose client read nothing for %.0fs", now - s.sending_since
                        )
                        self.stuck += 1
                        s.sending_since = None
                        s.ended = "stuck"
                        s.task.cancel()
                elif now - s.wrote >= self.ping_s:
                    s.wrote = now
                    ping = loop.create_task(_send(s, PING, loop))
                    self._pings.add(ping)
                    ping.add_done_callback(self._pings.discard)

    def response(
        self, source: AsyncIterator[Iterable[bytes]], headers: dict[str, str] | None = None
    ) -> SSEResponse:
        return SSEResponse(self, source, headers)


async def _send(s: _Open, body: bytes, loop) -> None:
    s.sending_since = loop.time()
    try:
        await s.send({"type": "http.response.body", "body": body, "more_body": True})
    finally:
        s.sending_since = None
        s.wrote = loop.time()


class SSEResponse(StreamingResponse):
    """An ASGI response streaming `source`'s batches of frames (see the module); a starlette response,
    so FastAPI passes it through as it is."""

    media_type = "text/event-stream"

    def __init__(
        self, streams: Streams, source: AsyncIterator[Iterable[bytes]], headers: dict[str, str] | None
    ) -> None:
        super().__init__(
            source, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})}
        )
        self.streams = streams
        self.source = source

    async def __call__(self, scope, receive, send) -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        mine = _Open(send, task, loop.time())
        listener = loop.create_task(_listen(receive, mine))
        self.streams.open.add(mine)
        try:
            start = {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            await send(start)
            async for frames in self.source:
                body = b"".join(frames)
                if body:
                    await _send(mine, body, loop)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if mine.ended is None:
                raise  # cancelled from outside (shutdown): not ours to swallow
            task.uncancel()
        except OSError:  # the client went away mid-write
            pass
        finally:
            listener.cancel()
            self.streams.open.discard(mine)
            with contextlib.suppress(Exception):
                await self.source.aclose()  # type: ignore[attr-defined]


async def _listen(receive, stream: _Open) -> None:
    """Wait for the client to leave; then end its stream."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if stream.ended is None:
                stream.ended = "left"
                stream.task.cancel()
            return
