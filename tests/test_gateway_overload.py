"""Backpressure: lag-based 429s with Retry-After while admitted requests complete, bounded
gateway memory, a slow client that gets coalesced chunks until it is dropped, and tool calls
and log probabilities that reach a slow client whole through every merge."""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx
import openai
import pytest

from schemas import call_id
from tests.conftest import Roles
from tests.gateway_support import (
    CALLS,
    CALLS_TEXT,
    FakePipeline,
    auth_headers,
    call_answer,
    default_key,
    metric,
    metrics_text,
    rss_bytes,
    sse,
    start_gateway,
    token_logprob,
)
from tests.kafka_support import wait_for

WORDS = " ".join(f"v{i}" for i in range(10))


@pytest.fixture(scope="module")
async def pipeline(stack, bootstrap):
    p = await FakePipeline(bootstrap, f"busy-{uuid.uuid4().hex[:6]}", token_delay=0.03, slots=2).start()
    yield p
    await p.stop()


@pytest.fixture(scope="module")
async def fast(stack, bootstrap):
    p = await FakePipeline(bootstrap, f"fast-{uuid.uuid4().hex[:6]}", token_delay=0, slots=4).start()
    yield p
    await p.stop()


@pytest.fixture(scope="module")
def gateway(stack, pipeline, fast, tmp_path_factory):
    roles = Roles(stack, tmp_path_factory.mktemp("gateway-overload"))
    env = {
        "TOKENSTREAM_GATEWAY_ADMISSION_BUDGET_S": "1.0",
        "TOKENSTREAM_GATEWAY_ADMISSION_POLL_S": "0.25",
        "TOKENSTREAM_GATEWAY_ADMISSION_MIN_RATE": "1",
        "TOKENSTREAM_GATEWAY_BUFFER_EVENTS": "4",
        "TOKENSTREAM_GATEWAY_COALESCE_CHARS": "2048",
    }
    url, proc = start_gateway(roles, [pipeline.model, fast.model], env=env)
    yield url, proc
    roles.stop_all()


async def test_overload_gets_429_with_retry_after(gateway, pipeline):
    url, proc = gateway
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=default_key(), max_retries=0, timeout=60)

    async def one(i: int):
        try:
            done = await client.chat.completions.create(
                model=pipeline.model, messages=[{"role": "user", "content": f"{i} {WORDS}"}]
            )
            return done.choices[0].message.content == f"{i} {WORDS}"
        except openai.RateLimitError as err:
            return err

    rss = []
    outcomes: list = []
    for wave in range(4):
        outcomes += await asyncio.gather(*(one(100 * wave + i) for i in range(40)))
        rss.append(rss_bytes(proc.pid))
    admitted = [o for o in outcomes if o is True]
    rejected = [o for o in outcomes if isinstance(o, openai.RateLimitError)]
    assert len(admitted) + len(rejected) == len(outcomes), "every admitted request completes correctly"
    assert admitted and len(rejected) > len(outcomes) // 2
    for err in rejected:
        assert err.status_code == 429 and err.body["type"] == "rate_limit_error"
        assert int(err.response.headers["retry-after"]) >= 1
    # the pipeline was never handed more than it could drain: only admitted requests reached it
    assert sum(1 for r in pipeline.requests.values() if r.model == pipeline.model) == len(admitted)
    assert metric(url, "gateway_admission_rejections_total") == len(rejected)
    assert 'gateway_admission_estimated_wait_seconds{model="' + pipeline.model in metrics_text(url)
    # memory stays flat across waves of overload (first wave warms up)
    assert max(rss[1:]) - rss[1] < 20 * 2**20, rss

    # once drained, requests are admitted again
    for _ in range(50):
        try:
            done = await client.chat.completions.create(
                model=pipeline.model, messages=[{"role": "user", "content": "later"}]
            )
            assert done.choices[0].message.content == "later"
            break
        except openai.RateLimitError:
            await asyncio.sleep(0.2)
    else:
        pytest.fail("never admitted again after the overload")


async def test_a_slow_client_gets_coalesced_chunks_in_bounded_memory_then_is_dropped(gateway, fast):
    """It reads nothing while the whole answer is written: its buffer merges chunks, memory stays
    bounded, and once merging is exhausted its stream ends with slow_reader after a prefix of the
    answer (the resume from the log: test_gateway_deadlines.py)."""
    url, proc = gateway
    block = [f"s{i}" + "x" * 200 for i in range(100)]
    words = block * 400  # 40,000 tokens, 8 MB of text: more than socket buffers absorb
    payload = json.dumps(
        {
            "model": fast.model,
            "stream": True,
            "max_tokens": 100_000,
            "messages": [{"role": "user", "content": "[[repeat 400]] " + " ".join(block)}],
        }
    ).encode()
    host, port = url.removeprefix("http://").split(":")
    import socket

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32768)
    sock.connect((host, int(port)))
    sock.setblocking(False)
    reader, writer = await asyncio.open_connection(sock=sock, limit=4096)  # reads stall too
    writer.write(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {default_key()}\r\nContent-Length: {len(payload)}\r\n"
        "Connection: close\r\n\r\n".encode()
        + payload
    )
    await writer.drain()
    body = await reader.read(2048)  # headers and the first events, then stall
    rss_before = rss_bytes(proc.pid)
    # the worker double writes all its tokens meanwhile; the gateway merges, then drops the stream
    await wait_for(
        lambda: fast.served and all(s.finish_reason for s in fast.served.values()),
        60,
        "the worker double writing the whole answer",
    )
    await wait_for(lambda: metric(url, "gateway_slow_readers_dropped_total") >= 1, 30, "a drop")
    rss_stalled = rss_bytes(proc.pid)
    while chunk := await reader.read(65536):
        body += chunk
    writer.close()
    text = body.decode()
    frames = [
        json.loads(line[6:])
        for line in text.split("\r\n\r\n", 1)[1].splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
    assert frames[-1]["error"]["code"] == "slow_reader"
    got = "".join((f["choices"][0]["delta"].get("content") or "") for f in frames[:-1] if f["choices"])
    assert got and " ".join(words).startswith(got)
    assert metric(url, "gateway_coalesced_chunks_total") > 0
    assert rss_stalled - rss_before < 20 * 2**20


async def test_a_slow_client_gets_the_calls_and_logprobs_of_a_fast_one_through_every_merge(
    gateway, pipeline, fast
):
    """The same answer (content, two calls, log probabilities), read by a prompt client of the paced
    double and by a client of the double that writes it at once: the second one's Stream (4 events)
    fills and merges chunk after chunk, and its client assembles exactly what the first one does."""
    url, _ = gateway
    groups = [" ".join(f"g{k}w{i}" for i in range(14)) for k in range(2)]
    prompt = CALLS + " " + " | ".join(groups)
    tools = [
        {"type": "function", "function": {"name": f"f{k}", "parameters": {"type": "object"}}}
        for k in range(2)
    ]
    body = {"messages": [{"role": "user", "content": prompt}], "stream": True, "tools": tools}
    body |= {"logprobs": True, "top_logprobs": 2}

    async def read(model: str) -> tuple[str, list[dict], list[dict], int]:
        async with (
            httpx.AsyncClient(timeout=60, headers=auth_headers()) as http,
            http.stream("POST", url + "/v1/chat/completions", json={"model": model, **body}) as r,
        ):
            assert r.status_code == 200, await r.aread()
            frames = [json.loads(d) for _, d in [e async for e in sse(r)] if d != "[DONE]"]
        rid = frames[0]["id"].removeprefix("chatcmpl-")
        content, calls, logprobs = _assembled(frames)
        assert [c.pop("id") for c in calls] == [call_id(rid, k) for k in range(2)]
        assert frames[-1]["choices"][0]["finish_reason"] == "tool_calls"
        return content, calls, logprobs, sum(bool(f["choices"][0]["delta"]) for f in frames[1:-1])

    parts = call_answer("r", prompt)  # 35 chunks
    reference = await read(pipeline.model)  # written 30 ms apart: read as they come
    merges = metric(url, "gateway_coalesced_chunks_total")
    slow = await read(fast.model)  # written at once: 4 pending, the rest merged into the last
    assert metric(url, "gateway_coalesced_chunks_total") > merges, "the slow client's chunks were merged"
    assert slow[3] < reference[3] and slow[3] < len(parts)
    assert slow[:3] == reference[:3]
    assert slow[0] == CALLS_TEXT
    assert slow[1] == [
        {"type": "function", "name": f"f{k}", "arguments": json.dumps({"words": groups[k]})} for k in range(2)
    ]
    assert slow[2] == [
        {
            "token": raw,
            "logprob": lp.logprob,
            "bytes": lp.bytes,
            "top_logprobs": [
                {"token": t.token, "logprob": t.logprob, "bytes": t.bytes} for t in lp.top_logprobs
            ],
        }
        for seq, (_, _, raw) in enumerate(parts)
        for lp in [token_logprob(seq, raw)]
    ]


def _assembled(frames: list[dict]) -> tuple[str, list[dict], list[dict]]:
    """Content, calls (by index) and log probabilities as an OpenAI client assembles them from chunks;
    a call's first entry names it (id, type, name) with no arguments, later ones add arguments only."""
    content, calls, logprobs = "", {}, []
    for frame in frames:
        for choice in frame["choices"]:
            content += choice["delta"].get("content") or ""
            logprobs += (choice.get("logprobs") or {}).get("content") or []
            for entry in choice["delta"].get("tool_calls") or []:
                if "id" in entry:
                    assert entry["index"] not in calls and entry["function"]["arguments"] == ""
                    calls[entry["index"]] = {
                        "id": entry["id"],
                        "type": entry["type"],
                        "name": entry["function"]["name"],
                    }
                    calls[entry["index"]]["arguments"] = ""
                else:
                    assert set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}
                    calls[entry["index"]]["arguments"] += entry["function"]["arguments"]
    return content, [calls[k] for k in sorted(calls)], logprobs
