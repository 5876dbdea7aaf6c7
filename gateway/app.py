"""The gateway's FastAPI app: OpenAI chat completions over the Kafka pipeline.

    POST /v1/chat/completions                      a ChatRequest event; the answer from token events
    GET  /v1/chat/completions/{id}/stream          resume a stream (Last-Event-ID), on any instance
    POST /v1/chat/completions/{id}/cancel          stop generating now (the chat page's stop button)
    GET  /v1/models, /health/live, /health/ready, /metrics, / (the chat page)
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from sse_starlette import EventSourceResponse, ServerSentEvent

from gateway import openai_api as api
from gateway.admission import Admission
from gateway.cancel import Canceller
from gateway.config import GatewaySettings
from gateway.fanout import Fanout
from gateway.metrics import Metrics
from gateway.resume import (
    NOTHING_SEEN,
    event_id,
    new_request_id,
    parse_last_event_id,
    parse_request_id,
    replay,
)
from producers import publish, start_consumer, start_producer
from schemas import ChatMessage, ChatRequest, Completion, Event, SafetyVerdict, SamplingParams, TokenChunk
from topics import CHAT_REQUESTS, TOKENS

log = logging.getLogger(__name__)
STATIC = Path(__file__).parent / "static"
DEFAULT_MAX_TOKENS = 256
META_TTL_S = 24 * 3600


class Gateway:
    """Connections to the broker and the per-instance machinery; connects in the background."""

    def __init__(self, cfg: GatewaySettings, bootstrap: str, redis_url: str | None) -> None:
        self.cfg = cfg
        self.bootstrap = bootstrap
        self.metrics = Metrics()
        self.admission = Admission(bootstrap, cfg.models, self.metrics, budget_s=cfg.admission_budget_s,
                                   poll_s=cfg.admission_poll_s, window_s=cfg.admission_window_s,
                                   min_rate=cfg.admission_min_rate, stale_s=cfg.broker_stale_s)
        self.canceller = Canceller(redis_url, cfg.cancel_grace_s, self.metrics)
        self.redis = self.canceller._redis  # noqa: SLF001 - one connection pool for both uses
        self.producer = None
        self.fanout: Fanout | None = None
        self.partitions: list[int] = []
        self._next = itertools.count()
        self._tasks: list[asyncio.Task] = []

    @property
    def ready(self) -> bool:
        return self.fanout is not None and self.admission.healthy()

    async def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._connect(), name="gateway-connect"))
        self._tasks.append(asyncio.create_task(self.admission.run(), name="gateway-admission"))

    async def _connect(self) -> None:
        while True:
            consumer = None
            try:
                self.producer = self.producer or await start_producer(self.bootstrap, linger_ms=1,
                                                                      request_timeout_ms=10_000)
                self.canceller.producer = self.producer
                consumer = await start_consumer(group=None, bootstrap=self.bootstrap, fetch_max_wait_ms=100)
                total = consumer.partitions_for_topic(TOKENS.name)
                if not total:
                    await consumer._client.force_metadata_update()  # noqa: SLF001
                    total = consumer.partitions_for_topic(TOKENS.name)
                if not total:
                    raise RuntimeError(f"topic {TOKENS.name} does not exist (run `tokenstream topics apply`)")
                self.partitions = self.cfg.owned_partitions(len(total))
                if not self.partitions:
                    raise RuntimeError("this instance owns no tokens partition")
                fanout = Fanout(consumer, self.partitions, self.metrics, self.cfg.buffer_events,
                                self.cfg.coalesce_chars)
                await fanout.start()
                self.fanout = fanout
                log.info("gateway %s owns tokens partitions %s", self.cfg.instance_id, self.partitions)
                await fanout.run()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001
                log.warning("gateway not connected to the pipeline: %s", exc)
                self.fanout = None
                if consumer is not None:
                    with contextlib.suppress(Exception):
                        await consumer.stop()
                await asyncio.sleep(1.0)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        await self.admission.close()
        await self.canceller.close()
        if self.fanout is not None:
            with contextlib.suppress(Exception):
                await self.fanout.consumer.stop()
        if self.producer is not None:
            with contextlib.suppress(Exception):
                await self.producer.stop()

    def reply_partition(self) -> int:
        return self.partitions[next(self._next) % len(self.partitions)]

    async def remember(self, request_id: str, meta: dict) -> None:
        """What a resume elsewhere needs to rebuild chunks (model, usage option)."""
        if self.redis is not None:
            with contextlib.suppress(Exception):
                await self.redis.set(f"ts:gateway:req:{request_id}", json.dumps(meta), ex=META_TTL_S)

    async def recall(self, request_id: str) -> dict | None:
        """The notes of an admitted request; {} when Redis cannot say, None when it never was admitted."""
        if self.redis is not None:
            try:
                raw = await self.redis.get(f"ts:gateway:req:{request_id}")
            except Exception:  # noqa: BLE001 - without Redis, the log alone serves the resume
                return {}
            return json.loads(raw) if raw else None
        return {}


# ---------------------------------------------------------------------- answer building

def content_filtered(verdict: SafetyVerdict, seq: int) -> Completion:
    """A blocking output verdict ends the answer like a completion with finish_reason content_filter.

    `seq` is one past the highest chunk seq before the verdict in the log, so the finish frame
    gets the same SSE id live and on a resume.
    """
    return Completion(request_id=verdict.request_id, conversation_id=verdict.conversation_id,
                      tenant=verdict.tenant, seq=seq, finish_reason="content_filter",
                      error="output flagged: " + ", ".join(verdict.categories))


class Framer:
    """Turns a request's token events into OpenAI chunk frames with resumable SSE ids."""

    def __init__(self, request_id: str, model: str, created: int, include_usage: bool, last_seen: int) -> None:
        self.rid = request_id
        self.cid = api.completion_id(request_id)
        self.model, self.created, self.include_usage = model, created, include_usage
        self.last = last_seen  # highest position the client has
        self.next_seq = max(0, last_seen + 1) if last_seen >= 0 else 0
        self.done = False
        self.first_token_at: float | None = None
        self.max_chunk_seq = -1  # highest chunk seq met in log order, delivered or not

    def _data(self, body: dict) -> str:
        return json.dumps(body, separators=(",", ":"))

    def start(self) -> list[ServerSentEvent]:
        if self.last >= -1:
            return []
        self.last = -1
        return [ServerSentEvent(self._data(api.chunk(self.cid, self.created, self.model, role="assistant",
                                                     content="", include_usage=self.include_usage)),
                                id=event_id(self.rid, -1))]

    def frames(self, events: list[Event]) -> list[ServerSentEvent]:
        out: list[ServerSentEvent] = []
        text: list[str] = []
        upto = None
        for ev in events:
            if self.done:
                break
            if isinstance(ev, SafetyVerdict):
                if not ev.blocked:
                    continue
                ev = content_filtered(ev, self.max_chunk_seq + 1)
            if isinstance(ev, TokenChunk):
                self.max_chunk_seq = max(self.max_chunk_seq, ev.seq)
                if ev.seq < self.next_seq:
                    continue  # duplicate
                self.next_seq = ev.seq + 1
                if ev.seq <= self.last:
                    continue
                text.append(ev.text)
                upto = ev.seq
            elif isinstance(ev, Completion):
                if upto is not None:  # text before the completion: one coalesced frame
                    out.append(self._text_frame("".join(text), upto))
                    text, upto = [], None
                out += self._completion_frames(ev)
                self.done = True
        if upto is not None:
            out.append(self._text_frame("".join(text), upto))
        return out

    def _text_frame(self, text: str, seq: int) -> ServerSentEvent:
        self.last = seq
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        body = api.chunk(self.cid, self.created, self.model, content=text, include_usage=self.include_usage)
        return ServerSentEvent(self._data(body), id=event_id(self.rid, seq))

    def _completion_frames(self, c: Completion) -> list[ServerSentEvent]:
        frames: list[tuple[int, str]] = []
        if c.finish_reason == "error":
            err = api.error_body(c.error or "generation failed", "server_error", None, "generation_error")
            frames.append((c.seq, self._data(err)))
        else:
            frames.append((c.seq, self._data(api.chunk(
                self.cid, self.created, self.model, finish_reason=api.finish_reason_for_client(c.finish_reason),
                include_usage=self.include_usage))))
            if self.include_usage:
                frames.append((c.seq + 1, self._data(api.usage_chunk(
                    self.cid, self.created, self.model, c.usage.prompt_tokens, c.usage.completion_tokens,
                    c.usage.cached_tokens))))
        frames.append((c.seq + 2, "[DONE]"))
        out = [ServerSentEvent(data, id=event_id(self.rid, pos)) for pos, data in frames if pos > self.last]
        self.last = max(self.last, c.seq + 2)
        return out


# ---------------------------------------------------------------------------- the app

def create_app(cfg: GatewaySettings, bootstrap: str, redis_url: str | None = None) -> FastAPI:
    gw = Gateway(cfg, bootstrap, redis_url)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await gw.start()
        try:
            yield
        finally:
            await gw.stop()

    app = FastAPI(title="tokenstream gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.gateway = gw
    app.add_exception_handler(RequestValidationError, api.validation_error_handler)
    app.add_exception_handler(api.APIError, api.api_error_handler)
    m = gw.metrics

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    @app.get("/health/live")
    async def live() -> dict:
        return {"status": "ok", "instance": cfg.instance_id}

    @app.get("/health/ready")
    async def ready() -> JSONResponse:
        body = {"ready": gw.ready, "instance": cfg.instance_id, "partitions": gw.partitions,
                "broker": gw.admission.healthy(), "fanout": gw.fanout is not None}
        return JSONResponse(body, status_code=200 if gw.ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(m.render(), media_type="text/plain; version=0.0.4")

    def model_entry(name: str) -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "tokenstream"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_entry(name) for name in cfg.models]}

    @app.get("/v1/models/{name}")
    async def model(name: str) -> dict:
        if name not in cfg.models:
            raise api.model_not_found(name)
        return model_entry(name)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: api.ChatCompletionRequest, request: Request):
        stream_label = "true" if body.stream else "false"
        try:
            return await _chat(body, request)
        except api.APIError as exc:
            m.requests.labels(body.model, stream_label, str(exc.status)).inc()
            raise

    async def _chat(body: api.ChatCompletionRequest, request: Request):
        if body.model not in cfg.models:
            raise api.model_not_found(body.model)
        try:
            sampling = SamplingParams(
                max_tokens=body.max_completion_tokens or body.max_tokens or DEFAULT_MAX_TOKENS,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                stop=body.stop_list(), seed=body.seed)
        except ValueError as exc:
            raise api.invalid_request(str(exc)) from None
        messages = [ChatMessage(role="system" if msg.role == "developer" else msg.role, content=msg.text(),
                                name=msg.name, tool_call_id=msg.tool_call_id) for msg in body.messages]
        if gw.fanout is None or gw.producer is None:
            raise api.unavailable("The gateway is not connected to the inference pipeline yet.")
        if len(gw.fanout.streams) >= cfg.max_active_streams:
            m.rejections.labels(body.model).inc()
            raise api.APIError(429, f"This gateway instance holds {cfg.max_active_streams} open streams; "
                                    "retry after 1s.", "rate_limit_error", code="rate_limit_exceeded",
                               headers={"Retry-After": "1"})
        gw.admission.admit(body.model)  # 429 / 503 before anything is written

        partition = gw.reply_partition()
        started = time.monotonic()
        created_at = time.time()
        rid = new_request_id(partition, created_at)
        event = ChatRequest(request_id=rid, conversation_id=body.conversation_id or rid, created_at=created_at,
                            tenant=request.headers.get("x-tenant", "default"), model=body.model,
                            messages=messages, sampling=sampling, stream=body.stream, user=body.user,
                            assistant=body.assistant,
                            reply_partition=partition, gateway_id=cfg.instance_id)
        fanout = gw.fanout
        stream = fanout.subscribe(rid)
        created = int(created_at)
        include_usage = body.include_usage()
        # the write to the pipeline and the two Redis notes go out together
        written, _, generation = await asyncio.gather(
            asyncio.wait_for(publish(gw.producer, CHAT_REQUESTS, event, key=event.conversation_id), timeout=10),
            gw.remember(rid, {"model": body.model, "created": created, "include_usage": include_usage}),
            gw.canceller.attach(rid), return_exceptions=True)
        if isinstance(written, BaseException) or isinstance(generation, BaseException):
            fanout.unsubscribe(rid)
            exc = written if isinstance(written, BaseException) else generation
            raise api.unavailable(f"Could not hand the request to the pipeline: {exc or type(exc).__name__}")
        m.requests.labels(body.model, "true" if body.stream else "false", "200").inc()

        async def live() -> AsyncIterator[list[Event]]:
            while True:
                batch = await stream.take(cfg.request_timeout_s)
                if not batch:
                    return
                yield batch

        if body.stream:
            framer = Framer(rid, body.model, created, include_usage, NOTHING_SEEN)
            return sse_response(framer, live(), generation, started,
                                cleanup=lambda: fanout.unsubscribe(rid))
        return await collect(rid, body.model, created, live(), generation, request,
                             cleanup=lambda: fanout.unsubscribe(rid))

    def sse_response(framer: Framer, source: AsyncIterator[list[Event]], generation: int,
                     started: float, cleanup) -> EventSourceResponse:
        async def frames():
            observed = False
            try:
                for frame in framer.start():
                    yield frame
                async for batch in source:
                    out = framer.frames(batch)
                    if framer.first_token_at is not None and started and not observed:
                        m.ttft.observe(framer.first_token_at - started)
                        observed = True
                    for frame in out:
                        yield frame
                    if framer.done:
                        return
                if not framer.done:  # timed out waiting for the pipeline
                    yield ServerSentEvent(json.dumps(api.error_body(
                        "timed out waiting for the model", "server_error", None, "timeout")))
                    framer.done = True
            finally:
                cleanup()
                with contextlib.suppress(Exception):
                    await source.aclose()  # type: ignore[attr-defined]
                if framer.done:
                    gw.canceller.release(framer.rid)
                else:
                    gw.canceller.detached(framer.rid, generation)

        return EventSourceResponse(frames(), ping=cfg.ping_s, headers={"Cache-Control": "no-cache",
                                                                       "X-Accel-Buffering": "no"})

    async def collect(rid: str, model_name: str, created: int, source: AsyncIterator[list[Event]],
                      generation: int, request: Request, cleanup) -> JSONResponse:
        text: list[str] = []
        next_seq = 0

        async def gather() -> Completion | None:
            nonlocal next_seq
            async for batch in source:
                for ev in batch:
                    if isinstance(ev, TokenChunk):
                        if ev.seq >= next_seq:
                            text.append(ev.text)
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
            gw.canceller.detached(rid, generation, grace_s=0)
            raise api.APIError(504, "timed out waiting for the model", "server_error", code="timeout")
        gw.canceller.release(rid)
        if done.finish_reason == "error":
            raise api.APIError(500, done.error or "generation failed", "server_error", code="generation_error")
        return JSONResponse(api.completion_body(
            api.completion_id(rid), created, model_name, "".join(text),
            api.finish_reason_for_client(done.finish_reason), done.usage.prompt_tokens,
            done.usage.completion_tokens, done.usage.cached_tokens))

    def _rid(completion: str) -> str:
        rid = api.request_id_of(completion)
        try:
            parse_request_id(rid)
        except ValueError:
            raise api.not_found(f"No completion with id {completion!r}.") from None
        return rid

    @app.get("/v1/chat/completions/{completion}/stream")
    async def resume(completion: str, last_event_id: str | None = Header(None),
                     last_event_id_query: str | None = None, include_usage: bool | None = None):
        rid = _rid(completion)
        try:
            last = parse_last_event_id(last_event_id or last_event_id_query, rid)
        except ValueError as exc:
            raise api.invalid_request(str(exc), param="Last-Event-ID") from None
        if gw.producer is None:
            raise api.unavailable("The gateway is not connected to the inference pipeline yet.")
        meta = await gw.recall(rid)
        if meta is None:
            raise api.not_found(f"No completion with id {completion!r} (or it has expired).")
        usage = meta.get("include_usage", False) if include_usage is None else include_usage
        framer = Framer(rid, meta.get("model", "unknown"), meta.get("created", parse_request_id(rid)[1] // 1000),
                        usage, last)
        generation = await gw.canceller.attach(rid)
        m.resumes.inc()
        source = replay(gw.bootstrap, rid, idle_timeout_s=cfg.request_timeout_s)
        return sse_response(framer, source, generation, 0.0, cleanup=lambda: None)

    @app.post("/v1/chat/completions/{completion}/cancel")
    async def cancel(completion: str) -> dict:
        rid = _rid(completion)
        if gw.producer is None:
            raise api.unavailable("The gateway is not connected to the inference pipeline yet.")
        await gw.canceller.cancel(rid, "client_cancelled")
        return {"id": completion, "object": "chat.completion.cancel", "cancelled": True}

    return app
