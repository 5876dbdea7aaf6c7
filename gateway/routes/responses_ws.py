"""WebSocket mode of the Responses API: `wss://.../v1/responses`.

The client sends `response.create` events (the fields of `POST /v1/responses`; `stream` is implicit,
and either value of it is taken; `background` is refused) and receives each response's stream events
as JSON messages, the same events, in the same order and with the same `sequence_number`s as the SSE
mode, because they are the same fold of the log (gateway/routes/responses.py `create_response`, run
here once per event). Responses with the same `stream_id` (a lane) run one after another in the order
sent, and their events echo the lane; different lanes run side by side. A response continues another
with `previous_response_id` or `conversation`, as over HTTP.

A dropped connection leaves its responses as a dropped SSE stream does: each is cancelled unless a
client resumes it within the cancel grace, from any gateway, with `GET /v1/responses/{id}?stream=true
&starting_after=N` (the SSE mode's resume, from the log). Limits: one message at most the gateway's
body limit, at most MAX_LANES lanes and MAX_QUEUED responses waiting per lane.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from gateway import openai_api as api
from gateway.auth import key_of
from gateway.responses_api import ResponseCreate
from gateway.routes.responses import create_response
from gateway.sse import data_of
from schemas import keys as K

log = logging.getLogger(__name__)
router = APIRouter()
MAX_LANES = 16
MAX_QUEUED = 16
POLICY_VIOLATION, TOO_BIG = 1008, 1009  # RFC 6455 close codes


def _error(
    status: int,
    message: str,
    type_: str,
    param: str | None = None,
    code: str | None = None,
    lane: str | None = None,
) -> dict[str, Any]:
    event: dict[str, Any] = {
        "type": "error",
        "status": status,
        # the specification's WebSocket error always has a code: one with none more specific, its type
        "error": {"type": type_, "code": code or type_, "message": message, "param": param},
    }
    if lane is not None:
        event["stream_id"] = lane
    return event


def _invalid(message: str, param: str | None, lane: str | None) -> dict[str, Any]:
    return _error(400, message, "invalid_request_error", param, None, lane)


class Socket:
    """One connection: its key, its lanes (a queue and a runner each), one writer at a time."""

    def __init__(self, ws: WebSocket, key: K.ApiKey) -> None:
        self.ws, self.key = ws, key
        self.gw = ws.app.state.gateway
        self.lanes: dict[str | None, asyncio.Queue] = {}
        self.runners: set[asyncio.Task] = set()
        self.writing = asyncio.Lock()
        # store-false responses made on this connection: only this connection may continue them (a
        # reconnected client's previous_response_id naming one is previous_response_not_found)
        self.unstored: set[str] = set()

    async def send(self, event: dict[str, Any]) -> None:
        async with self.writing:
            await self.ws.send_text(json.dumps(event, separators=(",", ":")))

    async def serve(self) -> None:
        most = self.gw.cfg.max_body_bytes
        while True:
            text = await self.ws.receive_text()
            if len(text.encode()) > most:
                await self.send(
                    _error(
                        413,
                        f"A message may hold at most {most} bytes.",
                        "invalid_request_error",
                        code="message_too_large",
                    )
                )
                await self.ws.close(TOO_BIG)
                return
            await self.take(text)

    async def take(self, text: str) -> None:
        try:
            event = json.loads(text)
        except json.JSONDecodeError as exc:
            await self.send(_invalid(f"The message is not JSON: {exc}.", None, None))
            return
        if not isinstance(event, dict) or event.get("type") != "response.create":
            kind = event.get("type") if isinstance(event, dict) else None
            await self.send(
                _invalid(f"Unsupported client event type {kind!r}: send `response.create`.", "type", None)
            )
            return
        lane = event.pop("stream_id", None)
        if lane is not None and (not isinstance(lane, str) or not 0 < len(lane) <= 64):
            await self.send(_invalid("stream_id must be a string of 1 to 64 characters.", "stream_id", None))
            return
        queue = self.lanes.get(lane)
        if queue is None:
            if len(self.lanes) >= MAX_LANES:
                await self.send(
                    _invalid(
                        f"A connection may use at most {MAX_LANES} lanes (stream_id).", "stream_id", lane
                    )
                )
                return
            queue = self.lanes[lane] = asyncio.Queue(MAX_QUEUED)
            runner = asyncio.create_task(self.run_lane(lane, queue))
            self.runners.add(runner)
        if queue.full():
            await self.send(
                _error(
                    429,
                    f"At most {MAX_QUEUED} responses may wait in one lane.",
                    "rate_limit_error",
                    "stream_id",
                    "lane_full",
                    lane,
                )
            )
            return
        queue.put_nowait(event)

    async def run_lane(self, lane: str | None, queue: asyncio.Queue) -> None:
        while True:
            event = await queue.get()
            try:
                await self.respond(lane, event)
            except (WebSocketDisconnect, RuntimeError):
                return  # the connection is gone: serve() ends it
            except Exception as exc:
                log.exception("websocket response failed")
                await self.send(
                    _error(500, f"internal error: {type(exc).__name__}", "server_error", lane=lane)
                )

    async def respond(self, lane: str | None, event: dict[str, Any]) -> None:
        """One response.create: its events as they are made, each tagged with the lane."""
        event.pop("type")
        # the connection streams every response's events: `stream`, true or false (what a client that sends
        # its HTTP bodies as they are writes), changes nothing here; refusing `stream: false` left such a
        # client waiting for a terminal response event that never came
        if not isinstance(event.pop("stream", None), bool | None):
            await self.send(
                _invalid("stream must be a boolean (the connection streams either way).", "stream", lane)
            )
            return
        if event.get("background") not in (False, None):
            why = "background is not supported over WebSocket; use POST /v1/responses for it."
            await self.send(_invalid(f"background: {why}", "background", lane))
            return
        try:
            body = ResponseCreate.model_validate({**event, "stream": True})
        except ValidationError as exc:
            first = exc.errors()[0]
            param = ".".join(str(p) for p in first.get("loc", ())) or None
            await self.send(_invalid(f"{first.get('msg', 'invalid request')} ({param})", param, lane))
            return
        try:
            answer = await create_response(body, self.gw, self.key, frozenset(self.unstored))
        except api.APIError as exc:
            await self.send(_error(exc.status, exc.message, exc.type, exc.param, exc.code, lane))
            return
        frames = answer.body_iterator  # batches of SSE frames (gateway/sse.py)
        try:
            async for batch in frames:
                for frame in batch:
                    await self.send(self._shown(json.loads(data_of(frame)), body, lane))
        finally:
            await frames.aclose()  # a connection that went away: the response is detached, as an SSE one

    def _shown(self, shown: dict, body: ResponseCreate, lane) -> dict:
        """An SSE event of the response as this connection sends it."""
        if shown.get("type") == "error" and "error" not in shown:  # the stream's own end (a timeout)
            shown = {
                **_error(504, shown["message"], "server_error", shown.get("param"), shown.get("code")),
                "sequence_number": shown.get("sequence_number"),
            }
        if shown.get("type") == "response.created" and not body.store:
            self.unstored.add(shown["response"]["id"])
        if lane is not None:
            shown["stream_id"] = lane
        return shown

    async def close(self) -> None:
        for runner in self.runners:
            runner.cancel()
        await asyncio.gather(*self.runners, return_exceptions=True)


@router.websocket("/v1/responses")
async def responses_socket(ws: WebSocket) -> None:
    await ws.accept()
    try:
        key = await key_of(ws.headers.get("authorization", ""), ws.app.state.gateway)
    except api.APIError as exc:
        await ws.send_text(json.dumps(_error(exc.status, exc.message, exc.type, exc.param, exc.code)))
        await ws.close(POLICY_VIOLATION)
        return
    socket = Socket(ws, key)
    try:
        await socket.serve()
    except WebSocketDisconnect:
        pass
    finally:
        await socket.close()
        with contextlib.suppress(RuntimeError):
            await ws.close()
