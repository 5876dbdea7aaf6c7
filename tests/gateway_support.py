"""Test helpers for the gateway tests.

`FakePipeline` is a TEST DOUBLE standing in for the conversation processor and the GPU
worker (both being built elsewhere). It plays them for real over the broker:

    ts.chat.requests --(processor double)--> ts.inference.<model> --(worker double,
    group worker.<model>, `slots` at a time, committing offsets)--> ts.tokens[reply_partition]

The worker double's answer is deterministic: the words of the last user message echoed
back, one word per TokenChunk, `token_delay` seconds apart (max_tokens and stop honoured);
a message starting `[[calls]]` is answered with tool calls instead (`call_answer`), with log
probabilities when the request asks for them.
It honours Cancel events on ts.control. Nothing here is used by the gateway itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from aiokafka.structs import OffsetAndMetadata, TopicPartition

from producers import publish, start_consumer, start_producer
from schemas import (
    ChatRequest,
    Completion,
    FunctionCall,
    InferenceRequest,
    MessageToolCall,
    TokenChunk,
    TokenLogprob,
    ToolCallDelta,
    TopLogprob,
    Usage,
    call_id,
    decode,
)
from tokenstream.chaos.clients import sse_events
from tokenstream.stack.service import free_port  # never the same port twice in a process
from topics import CHAT_REQUESTS, CONTROL, TOKENS, inference_topic
from topics.admin import apply


def _words(prompt: str) -> list[str]:
    """`[[repeat N]] a b` means the words a b, N times over (long answers from short prompts)."""
    words = prompt.split()
    if len(words) >= 2 and words[0] == "[[repeat" and words[1].endswith("]]"):
        return words[2:] * int(words[1][:-2])
    return words


def expected_answer(prompt: str, max_tokens: int | None = None, stop: list[str] | None = None) -> str:
    """What the worker double answers to a last user message `prompt`."""
    words = _words(prompt)
    out = []
    for w in words[: max_tokens or len(words)]:
        if stop and w in stop:
            break
        out.append(w)
    return " ".join(out)


CALLS = "[[calls]]"
CALLS_TEXT = "Calling."


def call_answer(request_id: str, prompt: str) -> list[tuple[str, list[ToolCallDelta], str]]:
    """What the worker double answers to `[[calls]] a b | c`: the content CALLS_TEXT, then one call per
    `|`-separated group, named f0, f1, ..., whose arguments are {"words": "<the group>"}: a chunk naming
    the call, then one chunk per argument fragment. Each entry: (text, call deltas, raw text)."""
    groups = [g.split() for g in prompt.removeprefix(CALLS).split("|")]
    out: list[tuple[str, list[ToolCallDelta], str]] = [(CALLS_TEXT, [], CALLS_TEXT)]
    for k, words in enumerate(groups):
        out.append(("", [ToolCallDelta(index=k, id=call_id(request_id, k), name=f"f{k}")], f"<call f{k}>"))
        for frag in ['{"words": "', *(w if i == 0 else " " + w for i, w in enumerate(words)), '"}']:
            out.append(("", [ToolCallDelta(index=k, arguments=frag)], frag))
    return out


def token_logprob(seq: int, token: str) -> TokenLogprob:
    """The worker double's log probability of its token at `seq`, with two alternatives."""
    return TokenLogprob(
        token=token,
        bytes=list(token.encode()),
        logprob=-(seq + 1) / 8,
        top_logprobs=[
            TopLogprob(token=token, bytes=list(token.encode()), logprob=-(seq + 1) / 8),
            TopLogprob(token="?", bytes=[63], logprob=-(seq + 1) / 8 - 1),
        ],
    )


@dataclass
class Served:
    request: InferenceRequest
    received_at: float
    first_token_at: float | None = None
    finish_reason: str | None = None


@dataclass
class FakePipeline:
    """TEST DOUBLE of processor + worker for one model; see the module docstring."""

    bootstrap: str
    model: str
    token_delay: float = 0.01
    slots: int = 8
    worker: bool = True  # False: only the processor double runs; a real worker serves the model
    requests: dict[str, ChatRequest] = field(default_factory=dict)
    served: dict[str, Served] = field(default_factory=dict)
    active: set[str] = field(default_factory=set)
    cancels: list[str] = field(default_factory=list)

    async def start(self) -> FakePipeline:
        self._topic = inference_topic(self.model)
        await apply([CHAT_REQUESTS, TOKENS, CONTROL, self._topic], self.bootstrap)
        self._producer = await start_producer(self.bootstrap, linger_ms=1)
        self._requests_in = await _tail(self.bootstrap, CHAT_REQUESTS.name)
        self._control_in = await _tail(self.bootstrap, CONTROL.name)
        self._pending_cancel: set[str] = set()
        self._cancel_flags: dict[str, asyncio.Event] = {}
        self._slots = asyncio.Semaphore(self.slots)
        if not self.worker:
            self._work_in = None
            self._tasks = [asyncio.create_task(self._process()), asyncio.create_task(self._control())]
            return self
        self._work_in = await start_consumer(
            self._topic,
            group=f"worker.{self.model}",
            bootstrap=self.bootstrap,
            from_beginning=True,
            max_poll_records=1,
        )
        deadline = time.monotonic() + 30
        while not self._work_in.assignment():
            if time.monotonic() > deadline:
                raise TimeoutError("worker double never got its partitions")
            await asyncio.sleep(0.05)
        self._pending_cancel: set[str] = set()
        self._cancel_flags: dict[str, asyncio.Event] = {}
        self._slots = asyncio.Semaphore(self.slots)
        self._tasks = [asyncio.create_task(c) for c in (self._process(), self._work(), self._control())]
        return self

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(BaseException):
                await t
        for c in (self._requests_in, self._control_in, self._work_in):
            if c is not None:
                await c.stop()
        await self._producer.stop()

    # processor double: ChatRequest -> InferenceRequest
    async def _process(self) -> None:
        while True:
            for records in (await self._requests_in.getmany(timeout_ms=100)).values():
                for record in records:
                    req = decode(record.value, ChatRequest)
                    if req.model != self.model or req.cached_from:  # like the conversation processor
                        continue
                    self.requests[req.request_id] = req
                    inf = InferenceRequest(
                        request_id=req.request_id,
                        conversation_id=req.conversation_id,
                        tenant=req.tenant,
                        tier=req.tier,
                        priority=req.priority,
                        model=req.model,
                        messages=req.messages,
                        sampling=req.sampling,
                        reply_partition=req.reply_partition,
                        admitted_at=time.time(),
                    )
                    await publish(self._producer, self._topic, inf)

    # worker double: group worker.<model>, `slots` requests at a time
    async def _work(self) -> None:
        while True:
            await self._slots.acquire()
            record = await self._work_in.getone()
            req = decode(record.value, InferenceRequest)
            tp = TopicPartition(record.topic, record.partition)
            await self._work_in.commit({tp: OffsetAndMetadata(record.offset + 1, "")})
            self.served[req.request_id] = Served(req, time.time())
            self.active.add(req.request_id)
            task = asyncio.create_task(self._generate(req))
            task.add_done_callback(lambda _: self._slots.release())

    async def _generate(self, req: InferenceRequest) -> None:
        rid, served = req.request_id, self.served[req.request_id]
        flag = self._cancel_flags.setdefault(rid, asyncio.Event())
        if rid in self._pending_cancel:
            flag.set()
        prompt = next((m.content for m in reversed(req.messages) if m.role == "user"), "")
        if prompt.startswith(CALLS):
            await self._call(req, prompt)
            return
        words = _words(prompt)
        seq, reason = 0, "stop"
        try:
            for i, word in enumerate(words):
                if word in req.sampling.stop:
                    break
                if seq >= req.sampling.max_tokens:
                    reason = "length"
                    break
                if flag.is_set():
                    reason = "cancelled"
                    break
                if word == "[[error]]":
                    reason = "error"
                    break
                text = word if i == 0 else " " + word
                await publish(
                    self._producer,
                    TOKENS,
                    TokenChunk(request_id=rid, seq=seq, text=text, token_ids=[i], worker_id="fake"),
                    partition=req.reply_partition,
                    wait=False,
                )
                if served.first_token_at is None:
                    served.first_token_at = time.time()
                seq += 1
                if self.token_delay:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(flag.wait(), self.token_delay)
            if flag.is_set():
                reason = "cancelled"
            prompt_tokens = sum(len(m.content.split()) for m in req.messages)
            done = Completion(
                request_id=rid,
                seq=seq,
                finish_reason=reason,
                worker_id="fake",
                usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=seq),
                error="the worker double was asked to fail" if reason == "error" else None,
            )
            await publish(self._producer, TOKENS, done, partition=req.reply_partition)
            served.finish_reason = reason
        finally:
            self.active.discard(rid)
            self._cancel_flags.pop(rid, None)

    async def _call(self, req: InferenceRequest, prompt: str) -> None:
        """Answer `prompt` with tool calls (`call_answer`), one token per chunk."""
        rid, parts = req.request_id, call_answer(req.request_id, prompt)
        try:
            for seq, (text, calls, raw) in enumerate(parts):
                chunk = TokenChunk(
                    request_id=rid,
                    seq=seq,
                    text=text,
                    token_ids=[seq],
                    tool_calls=calls,
                    raw=raw,
                    worker_id="fake",
                    logprobs=[token_logprob(seq, raw)] if req.sampling.logprobs is not None else [],
                )
                await publish(self._producer, TOKENS, chunk, partition=req.reply_partition, wait=False)
                if self.token_delay:
                    await asyncio.sleep(self.token_delay)
            made = [
                MessageToolCall(id=d.id, function=FunctionCall(name=d.name, arguments=""))
                for _, calls, _ in parts
                for d in calls
                if d.id
            ]
            for _, calls, _ in parts:
                for d in calls:
                    made[d.index].function.arguments += d.arguments
            done = Completion(
                request_id=rid,
                seq=len(parts),
                finish_reason="tool_calls",
                text=CALLS_TEXT,
                tool_calls=made,
                worker_id="fake",
                usage=Usage(prompt_tokens=len(prompt.split()), completion_tokens=len(parts)),
            )
            await publish(self._producer, TOKENS, done, partition=req.reply_partition)
            self.served[rid].finish_reason = "tool_calls"
        finally:
            self.active.discard(rid)
            self._cancel_flags.pop(rid, None)

    async def _control(self) -> None:
        while True:
            for records in (await self._control_in.getmany(timeout_ms=100)).values():
                for record in records:
                    rid = record.key.decode()
                    self.cancels.append(rid)
                    flag = self._cancel_flags.get(rid)
                    if flag is not None:
                        flag.set()
                    else:
                        self._pending_cancel.add(rid)


async def _tail(bootstrap: str, topic: str):
    """A group-less consumer of every partition of `topic`, from its current end."""
    consumer = await start_consumer(group=None, bootstrap=bootstrap, fetch_max_wait_ms=100)
    partitions = consumer.partitions_for_topic(topic)
    if not partitions:
        await consumer._client.force_metadata_update()
        partitions = consumer.partitions_for_topic(topic)
    tps = [TopicPartition(topic, p) for p in sorted(partitions)]
    consumer.assign(tps)
    await consumer.seek_to_end(*tps)
    for tp in tps:
        await consumer.position(tp)
    return consumer


# ------------------------------------------------------------------ API keys

_DEFAULT_KEYS: dict[str, str] = {}


def new_key(tenant: str = "test", **options) -> str:
    """A new API key, created through the real key store in the test stack's Redis.

    `options` are those of `tokenstream keys create` (tier, rpm, tpm, expires, admin, ...).
    """
    from tokenstream.keys import KeyStore

    secret, _ = KeyStore(os.environ["TOKENSTREAM_REDIS_URL"]).create(tenant, **options)
    return secret


def default_key() -> str:
    """The tests' default key (tenant `test`, paid, admin so it can read /metrics), one per stack.

    Its exact cache is off: tests that ask the same deterministic question twice expect two live
    answers; the cache has tests of its own with keys that use it.
    """
    url = os.environ["TOKENSTREAM_REDIS_URL"]
    if url not in _DEFAULT_KEYS or not _stored(url, _DEFAULT_KEYS[url]):
        # (again after an outage test restarted the session's Redis, which keeps nothing on disk)
        _DEFAULT_KEYS[url] = new_key("test", tier="paid", admin=True, name="tests", exact_cache=False)
    return _DEFAULT_KEYS[url]


def _stored(url: str, secret: str) -> bool:
    import redis

    from schemas import keys as K

    client = redis.Redis.from_url(url, socket_timeout=5)
    try:
        return bool(client.exists(K.api_key(K.digest(secret))))
    finally:
        client.close()


def auth_headers(key: str | None = None) -> dict[str, str]:
    """`Authorization: Bearer` for `key` (default: the tests' key): pass as headers= to httpx."""
    return {"Authorization": f"Bearer {key or default_key()}"}


# ------------------------------------------------------------------ gateway processes


def start_gateway(
    roles,
    models: list[str],
    *,
    index: int = 0,
    count: int = 1,
    env: dict | None = None,
    wait_ready: bool = True,
    timeout: float = 60.0,
    port: int | None = None,
) -> tuple[str, object]:
    """Run `tokenstream gateway` as a real process; returns (base URL, process)."""
    port = port or free_port()
    proc = roles.start(
        "gateway",
        "--port",
        str(port),
        "--instance-index",
        str(index),
        "--instance-count",
        str(count),
        name=f"gateway-{index}-{port}",
        env={
            "TOKENSTREAM_GATEWAY_MODELS": json.dumps(models),
            "TOKENSTREAM_GATEWAY_INSTANCE_ID": f"gw{index}-{port}",
            # FakePipeline writes no input verdicts: it plays the serial order
            "TOKENSTREAM_GATEWAY_SCREENING": "serial",
            **(env or {}),
        },
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError("gateway exited:\n" + roles.log(proc))
        try:
            with urllib.request.urlopen(url + ("/health/ready" if wait_ready else "/health/live"), timeout=2):
                return url, proc
        except Exception:  # noqa: BLE001
            if time.monotonic() > deadline:
                raise TimeoutError("gateway not ready:\n" + roles.log(proc)) from None
            time.sleep(0.2)


def headers() -> dict[str, str]:
    """Headers every test request to a gateway carries: the tests' API key."""
    return auth_headers()


def client(base_url: str, timeout: float = 30, **kwargs):
    """An httpx.AsyncClient for a gateway (see `api_client`)."""
    return api_client(base_url, kind="http", timeout=timeout, **kwargs)


def openai_client(base_url: str, timeout: float = 30, **kwargs):
    """The official SDK's async client for a gateway, `base_url` without /v1 (see `api_client`)."""
    return api_client(base_url, kind="openai", timeout=timeout, **kwargs)


def api_client(base_url: str, *, kind: str = "openai", timeout: float = 120.0, **kw):
    """The one place tests build a client of the gateway's API: kind "openai" (AsyncOpenAI, no
    retries), "http" (httpx.AsyncClient) or "langchain" (ChatOpenAI), each with `headers()`."""
    if kind == "openai":
        import openai

        return openai.AsyncOpenAI(
            base_url=base_url + "/v1",
            api_key="unused",
            max_retries=0,
            timeout=timeout,
            default_headers=headers(),
            **kw,
        )
    if kind == "http":
        import httpx

        return httpx.AsyncClient(base_url=base_url, timeout=timeout, headers=headers(), **kw)
    if kind == "langchain":
        from langchain_openai import ChatOpenAI

        return ChatOpenAI(
            base_url=base_url + "/v1",
            api_key="unused",
            max_retries=0,
            timeout=timeout,
            default_headers=headers(),
            **kw,
        )
    raise ValueError(kind)


def rss_bytes(pid: int) -> int:
    import psutil

    return psutil.Process(pid).memory_info().rss


def metric(url: str, name: str, labels: str = "") -> float:
    """One sample of the gateway's /metrics (sum over label sets containing `labels`)."""
    text = metrics_text(url)
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {") and labels in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def metrics_text(url: str) -> str:
    """The gateway's /metrics page (read with the tests' admin key)."""
    request = urllib.request.Request(url + "/metrics", headers=auth_headers())
    return urllib.request.urlopen(request, timeout=5).read().decode()


def here() -> Path:
    return Path(os.path.dirname(__file__))


#: (id, data) of each SSE event of an httpx streaming response; comments are skipped
sse = sse_events


def content_of(data: str) -> str:
    if data == "[DONE]":
        return ""
    body = json.loads(data)
    return "".join((c["delta"].get("content") or "") for c in body.get("choices", []))


# ------------------------------------------------------------------ a headless browser


class Chromium:
    """Debian's chromium, headless, driven over the Chrome DevTools Protocol.

    The websocket client is the few lines CDP needs (RFC 6455 text frames, client masking),
    so the test downloads nothing and needs no extra package.
    """

    def __init__(
        self, profile: Path, binary: str = "/usr/bin/chromium", extra_args: tuple[str, ...] = ()
    ) -> None:
        import subprocess

        self.port = free_port()
        self.proc = subprocess.Popen(
            [
                binary,
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                f"--remote-debugging-port={self.port}",
                f"--user-data-dir={profile}",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
                "--disable-quic",
                "--disable-extensions",
                "--mute-audio",
                "--window-size=1100,800",
                *extra_args,
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self._id = 0

    def connect(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                targets = json.load(
                    urllib.request.urlopen(f"http://127.0.0.1:{self.port}/json/list", timeout=2)
                )
                page = next(t for t in targets if t["type"] == "page")
                break
            except Exception:  # noqa: BLE001
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("chromium did not start") from None
                time.sleep(0.2)
        self._ws_connect(page["webSocketDebuggerUrl"])

    def _ws_connect(self, url: str) -> None:
        import base64

        host_port, path = url.removeprefix("ws://").split("/", 1)
        host, port = host_port.split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=60)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(
            (
                f"GET /{path} HTTP/1.1\r\nHost: {host_port}\r\nUpgrade: websocket\r\n"
                f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
        )
        head = b""
        while b"\r\n\r\n" not in head:
            head += self.sock.recv(1)
        if b" 101 " not in head.split(b"\r\n", 1)[0]:
            raise RuntimeError(f"websocket handshake failed: {head!r}")

    def _recv_exact(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError("devtools connection closed")
            out += chunk
        return out

    def _send_text(self, text: str) -> None:
        import struct

        data = text.encode()
        n = len(data)
        head = b"\x81" + (
            bytes([0x80 | n])
            if n < 126
            else b"\xfe" + struct.pack(">H", n)
            if n < 65536
            else b"\xff" + struct.pack(">Q", n)
        )
        mask = os.urandom(4)
        self.sock.sendall(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))

    def _recv_text(self) -> str:
        import struct

        parts = []
        while True:
            b0, b1 = self._recv_exact(2)
            n = b1 & 0x7F
            if n == 126:
                n = struct.unpack(">H", self._recv_exact(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self._recv_exact(8))[0]
            payload = self._recv_exact(n)
            opcode = b0 & 0x0F
            if opcode == 8:
                raise ConnectionError("devtools closed the websocket")
            if opcode in (0, 1, 2):
                parts.append(payload)
                if b0 & 0x80:
                    return b"".join(parts).decode()

    def call(self, method: str, **params) -> dict:
        self._id += 1
        my = self._id
        self._send_text(json.dumps({"id": my, "method": method, "params": params}))
        while True:
            msg = json.loads(self._recv_text())
            if msg.get("id") == my:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def js(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page error: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30.0):
        deadline = time.monotonic() + timeout
        guarded = f"(() => {{ try {{ return ({expression}); }} catch (e) {{ return false; }} }})()"
        while True:
            value = self.js(guarded)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"page never satisfied: {expression}")
            time.sleep(0.05)

    def screenshot(self, path: Path) -> None:
        import base64

        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        import signal

        with contextlib.suppress(Exception):
            self.sock.close()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


async def fill(producer, partition: int, n: int) -> None:
    """`n` chunks of a request nobody follows on tokens partition `partition` (traffic a reader of
    other requests must pass over or, better, never read), all acknowledged."""
    from producers import publish
    from schemas import TokenChunk
    from schemas.ids import new_request_id
    from topics import TOKENS

    other = new_request_id(partition, time.time())
    for i in range(n):
        await publish(
            producer, TOKENS, TokenChunk(request_id=other, seq=i, text="x"), partition=partition, wait=False
        )
    await producer.flush()
