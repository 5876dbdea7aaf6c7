"""No client waits forever, and no client holds up the others.

- A request that makes no progress within the gateway's deadline ends with a clear error (an error
  event on a stream, 504 otherwise) and is cancelled.
- A reader that keeps its tokens partition paused too long is dropped (its stream ends with an
  error event) while the other streams on that partition go on; it resumes from the log.

A real gateway process and a real broker; the pipeline is tests.gateway_support.FakePipeline.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import uuid

import openai
import pytest

from schemas import Cancel
from tests.conftest import Roles
from tests.gateway_support import (
    FakePipeline,
    client,
    content_of,
    headers,
    metric,
    openai_client,
    sse,
    start_gateway,
)
from tests.kafka_support import Tap
from topics import CONTROL

DEADLINE_S = 2.0


@pytest.fixture(scope="module")
async def stuck(stack, bootstrap):
    """A model whose requests are prepared but that no worker serves."""
    p = await FakePipeline(bootstrap, f"stuck-{uuid.uuid4().hex[:6]}", worker=False).start()
    yield p
    await p.stop()


@pytest.fixture(scope="module")
async def fast(stack, bootstrap):
    p = await FakePipeline(bootstrap, f"fast-{uuid.uuid4().hex[:6]}", token_delay=0, slots=4).start()
    yield p
    await p.stop()


@pytest.fixture(scope="module")
def gateway(stack, stuck, fast, tmp_path_factory):
    roles = Roles(stack, tmp_path_factory.mktemp("gateway-deadlines"))
    env = {
        "TOKENSTREAM_GATEWAY_PROGRESS_TIMEOUT_S": str(DEADLINE_S),
        "TOKENSTREAM_GATEWAY_SLOW_READER_S": "1",
        "TOKENSTREAM_GATEWAY_BUFFER_EVENTS": "4",
        "TOKENSTREAM_GATEWAY_COALESCE_CHARS": "64",
        "TOKENSTREAM_GATEWAY_REPLY_PARTITIONS": "[3]",
    }  # every stream shares one partition
    url, _ = start_gateway(roles, [stuck.model, fast.model], env=env)
    yield url
    roles.stop_all()


async def test_no_progress_ends_with_an_error_and_a_cancel(gateway, stuck):
    sdk = openai_client(gateway, timeout=60)
    messages = [{"role": "user", "content": "anyone there?"}]
    async with Tap(CONTROL) as control:
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as info:
            await sdk.chat.completions.create(model=stuck.model, messages=messages)
        assert info.value.status_code == 504 and info.value.code == "timeout"
        assert info.value.body["message"].startswith("The model made no progress")
        stream = await sdk.chat.completions.create(model=stuck.model, messages=messages, stream=True)
        with pytest.raises(openai.APIError) as info:
            async for _ in stream:
                pass
        assert "no progress" in str(info.value)
        assert time.monotonic() - started < 4 * DEADLINE_S + 10
        rids = list(stuck.requests)
        assert len(rids) == 2
        found = await control.wait_for(
            lambda e: isinstance(e, Cancel) and e.request_id in rids, count=2, timeout=30
        )
        assert {e.reason for e in found} == {"deadline"}


async def test_a_slow_reader_is_dropped_and_resumes_while_others_go_on(gateway, fast):
    block = [f"s{i}" + "x" * 200 for i in range(100)]
    words = block * 400  # 8 MB of text: more than the socket buffers absorb
    payload = json.dumps(
        {
            "model": fast.model,
            "stream": True,
            "max_tokens": 100_000,
            "messages": [{"role": "user", "content": "[[repeat 400]] " + " ".join(block)}],
        }
    ).encode()
    host, port = gateway.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32768)
    sock.connect((host, int(port)))
    sock.setblocking(False)
    reader, writer = await asyncio.open_connection(sock=sock, limit=4096)
    auth = "".join(f"{k}: {v}\r\n" for k, v in headers().items()).encode()
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + auth
        + b"Content-Length: "
        + str(len(payload)).encode()
        + b"\r\nConnection: close\r\n\r\n"
        + payload
    )
    await writer.drain()
    body = await reader.read(2048)  # headers and the first events, then the reader stalls
    deadline = time.monotonic() + 60
    # once the socket buffers and its stream's buffer are full, the slow reader is dropped at once
    # (no partition waits on it), and another stream on the same partition is answered while it
    # still stalls
    while metric(gateway, "gateway_slow_readers_dropped_total") < 1:
        assert time.monotonic() < deadline, "the slow reader was never dropped"
        await asyncio.sleep(0.1)
    while not (fast.served and all(s.finish_reason for s in fast.served.values())):
        assert time.monotonic() < deadline, "the double never finished writing the answer"
        await asyncio.sleep(0.1)  # (the double writes one answer at a time)
    sdk = openai_client(gateway, timeout=30)
    stream = await sdk.chat.completions.create(
        model=fast.model, stream=True, messages=[{"role": "user", "content": "others go on"}]
    )
    assert "".join([c.choices[0].delta.content or "" async for c in stream]) == "others go on"
    assert metric(gateway, "gateway_slow_readers_dropped_total") == 1

    while chunk := await reader.read(65536):  # the slow reader catches up: its stream was ended
        body += chunk
    writer.close()
    events, event_id = [], None  # (id, data) of each SSE event; chunked-encoding size lines are skipped
    for line in body.decode().split("\r\n\r\n", 1)[1].splitlines():
        if line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            events.append((event_id, line[6:]))
            event_id = None
    last_id = next(i for i, d in reversed(events) if i)
    error = json.loads(events[-1][1])["error"]
    assert error["code"] == "slow_reader" and "Last-Event-ID" in error["message"]
    received = "".join(content_of(d) for _, d in events[:-1])

    # it resumes from the log, at its own pace, and the two parts make the whole answer
    rid = last_id.rsplit(":", 1)[0]
    async with (
        client(gateway, timeout=60) as http,
        http.stream(
            "GET", f"/v1/chat/completions/chatcmpl-{rid}/stream", headers={"Last-Event-ID": last_id}
        ) as resumed,
    ):
        assert resumed.status_code == 200
        rest = [data async for _, data in sse(resumed)]
    assert rest[-1] == "[DONE]"
    assert received + "".join(content_of(d) for d in rest) == " ".join(words)
