"""Two gateway instances at once: per-instance reply partitions, resume on another instance,
cancel after a disconnect, and the stop route. Real processes, real broker, SDK and raw SSE."""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid

import httpx
import openai
import pytest

from tests.conftest import Roles
from tests.gateway_support import (
    FakePipeline,
    auth_headers,
    content_of,
    default_key,
    expected_answer,
    metric,
    metrics_text,
    sse,
    start_gateway,
)
from tests.kafka_support import wait_for

LONG = " ".join(f"w{i}" for i in range(40))
GRACE = 1.0


@pytest.fixture(scope="module")
async def pipeline(stack, bootstrap):
    p = await FakePipeline(bootstrap, f"echo-{uuid.uuid4().hex[:6]}", token_delay=0.05, slots=8).start()
    yield p
    await p.stop()


@pytest.fixture(scope="module")
def gateways(stack, pipeline, tmp_path_factory):
    roles = Roles(stack, tmp_path_factory.mktemp("gateway-streams"))
    env = {"TOKENSTREAM_GATEWAY_CANCEL_GRACE_S": str(GRACE)}
    a = start_gateway(roles, [pipeline.model], index=0, count=2, env=env)
    b = start_gateway(roles, [pipeline.model], index=1, count=2, env=env)
    yield a[0], b[0]
    roles.stop_all()


def body(model: str, text: str, **extra) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "stream": True,
        "temperature": 0,
        **extra,
    }


async def test_each_instance_gets_only_its_partitions(gateways, pipeline):
    """Ten streams on each instance at once; each instance reads only its own tokens partitions."""
    clients = [openai.AsyncOpenAI(base_url=u + "/v1", api_key=default_key(), max_retries=0) for u in gateways]

    async def one(i: int) -> tuple[int, str, str]:
        text = f"stream {i} " + " ".join(f"t{i}x{j}" for j in range(8))
        stream = await clients[i % 2].chat.completions.create(
            model=pipeline.model, messages=[{"role": "user", "content": text}], stream=True
        )
        got, cid = "", ""
        async for c in stream:
            cid = c.id
            got += c.choices[0].delta.content or ""
        assert got == text
        return i % 2, cid, text

    results = await asyncio.gather(*(one(i) for i in range(20)))
    for instance, cid, _ in results:
        assert pipeline.requests[cid.removeprefix("chatcmpl-")].reply_partition % 2 == instance
    for instance, url in enumerate(gateways):
        text = metrics_text(url)
        parts = {int(p) for p in re.findall(r'gateway_token_events_total\{partition="(\d+)"\}', text)}
        assert parts == {p for p in range(12) if p % 2 == instance}
        assert metric(url, "gateway_token_events_total") > 0
        async with httpx.AsyncClient() as http:
            ready = await http.get(url + "/health/ready")
        ids = {json.loads(ready.text)["instance"]}
        assert ids == {f"gw{instance}-{url.rsplit(':', 1)[1]}"}


async def test_resume_on_another_instance(gateways, pipeline):
    """Cut a stream on instance 0 midway, resume it on instance 1 with Last-Event-ID."""
    a, b = gateways
    first: list[tuple[str, str]] = []
    async with httpx.AsyncClient(timeout=30, headers=auth_headers()) as http:
        async with http.stream("POST", a + "/v1/chat/completions", json=body(pipeline.model, LONG)) as r:
            assert r.status_code == 200
            async for event_id, data in sse(r):
                first.append((event_id, data))
                if sum(1 for _, d in first if content_of(d)) >= 6:
                    break  # the connection drops here
        cid = json.loads(first[0][1])["id"]
        last_id = first[-1][0]
        assert last_id.startswith(cid.removeprefix("chatcmpl-") + ":")
        disconnect_cancels = metric(a, "gateway_cancels_total", 'reason="client_disconnected"')
        await asyncio.sleep(0.3)  # the client comes back after a moment, within the grace period
        rest: list[tuple[str, str]] = []
        async with http.stream(
            "GET", f"{b}/v1/chat/completions/{cid}/stream", headers={"Last-Event-ID": last_id}
        ) as r:
            assert r.status_code == 200
            async for event_id, data in sse(r):
                rest.append((event_id, data))
    assert rest[-1][1] == "[DONE]"
    positions = [int(i.rsplit(":", 1)[1]) for i, _ in first + rest]
    assert positions == sorted(set(positions)), "an event was sent twice or out of order"
    joined = "".join(content_of(d) for _, d in first + rest)
    assert joined == expected_answer(LONG)
    assert any(content_of(d) for _, d in rest) and any(content_of(d) for _, d in first)

    # the same request, uninterrupted and greedy, through the SDK on instance 1
    client = openai.AsyncOpenAI(base_url=b + "/v1", api_key=default_key(), max_retries=0)
    stream = await client.chat.completions.create(
        model=pipeline.model, temperature=0, stream=True, messages=[{"role": "user", "content": LONG}]
    )
    assert joined == "".join([c.choices[0].delta.content or "" async for c in stream])

    # resumed within the grace period: never cancelled, it ran to its end. A stream dropped on the same
    # instance after it, and not resumed, is cancelled when its grace period ends: this one's would have
    # come before
    rid = cid.removeprefix("chatcmpl-")
    later = await dropped(a, pipeline.model)
    await wait_for(lambda: later in pipeline.cancels, GRACE + 15, "the later dropped stream cancelled")
    assert rid not in pipeline.cancels
    assert metric(a, "gateway_cancels_total", 'reason="client_disconnected"') == disconnect_cancels + 1
    assert pipeline.served[rid].finish_reason == "stop"


async def dropped(url: str, model: str) -> str:
    """The request id of a stream whose client leaves after three chunks and does not come back."""
    async with (
        httpx.AsyncClient(timeout=30, headers=auth_headers()) as http,
        http.stream("POST", url + "/v1/chat/completions", json=body(model, LONG)) as r,
    ):
        n = 0
        async for _, data in sse(r):
            cid = json.loads(data)["id"]
            n += bool(content_of(data))
            if n >= 3:
                break
    return cid.removeprefix("chatcmpl-")


async def test_resume_from_the_start_and_after_the_end(gateways, pipeline):
    a, b = gateways
    client = openai.AsyncOpenAI(base_url=a + "/v1", api_key=default_key(), max_retries=0)
    done = await client.chat.completions.create(
        model=pipeline.model, messages=[{"role": "user", "content": "alpha beta gamma"}]
    )
    async with httpx.AsyncClient(timeout=30, headers=auth_headers()) as http:
        async with http.stream("GET", f"{b}/v1/chat/completions/{done.id}/stream") as r:
            events = [e async for e in sse(r)]
        assert "".join(content_of(d) for _, d in events) == "alpha beta gamma"
        assert events[-1][1] == "[DONE]"
        last = events[-1][0]
        async with http.stream(
            "GET", f"{a}/v1/chat/completions/{done.id}/stream", headers={"Last-Event-ID": last}
        ) as r:
            assert [e async for e in sse(r)] == []
        bad = await http.get(f"{a}/v1/chat/completions/{done.id}/stream", headers={"Last-Event-ID": "x:1"})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
        missing = await http.get(f"{a}/v1/chat/completions/chatcmpl-nonsense/stream")
        assert missing.status_code == 404
        never = await http.get(f"{a}/v1/chat/completions/chatcmpl-0123456789abcdefp3t1700000000000/stream")
        assert never.status_code == 404 and never.json()["error"]["code"] == "not_found"


async def test_disconnect_cancels_after_grace_and_frees_the_slot(gateways, pipeline):
    a, _ = gateways
    rid = await dropped(a, pipeline.model)
    assert rid in pipeline.active, "still generating right after the disconnect (grace period)"
    deadline = time.monotonic() + GRACE + 5
    while rid in pipeline.active and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert rid not in pipeline.active, "the worker's slot was not freed"
    assert rid in pipeline.cancels
    assert pipeline.served[rid].finish_reason == "cancelled"
    assert metric(a, "gateway_cancels_total", 'reason="client_disconnected"') >= 1


async def test_stop_route_cancels_now(gateways, pipeline):
    _, b = gateways
    async with (
        httpx.AsyncClient(timeout=30, headers=auth_headers()) as http,
        http.stream("POST", b + "/v1/chat/completions", json=body(pipeline.model, LONG)) as r,
    ):
        got, finish = "", None
        async for _, data in sse(r):
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            got += content_of(data)
            finish = chunk["choices"][0]["finish_reason"] or finish
            if len(got.split()) == 3 and finish is None:
                stop = await http.post(f"{b}/v1/chat/completions/{chunk['id']}/cancel")
                assert stop.status_code == 200 and stop.json()["cancelled"] is True
    assert finish == "stop"
    assert 3 <= len(got.split()) < 40
    assert pipeline.served[chunk["id"].removeprefix("chatcmpl-")].finish_reason == "cancelled"


async def test_non_streaming_client_that_leaves_is_cancelled(gateways, pipeline):
    a, _ = gateways
    before = set(pipeline.served)
    async with httpx.AsyncClient(timeout=1.0, headers=auth_headers()) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post(a + "/v1/chat/completions", json=body(pipeline.model, LONG, stream=False))
    rid = next(iter(set(pipeline.served) - before))
    deadline = time.monotonic() + 5
    while rid in pipeline.active and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert rid not in pipeline.active and pipeline.served[rid].finish_reason == "cancelled"
