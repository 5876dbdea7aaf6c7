"""The exact response cache against two real gateway processes, the real Redis and the real broker."""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid

import httpx
import pytest
import redis

from schemas import ChatRequest, Completion, TokenChunk
from schemas import keys as K
from tests.conftest import Roles
from tests.gateway_support import FakePipeline, auth_headers, new_key, sse, start_gateway
from tests.kafka_support import Tap
from topics import CHAT_REQUESTS, TOKENS

WORDS = " ".join(f"c{i}" for i in range(12))


@pytest.fixture(scope="module")
async def pipeline(stack, bootstrap):
    p = await FakePipeline(bootstrap, f"echo-{uuid.uuid4().hex[:6]}", token_delay=0.02, slots=8).start()
    yield p
    await p.stop()


@pytest.fixture(scope="module")
def gateways(stack, pipeline, tmp_path_factory):
    roles = Roles(stack, tmp_path_factory.mktemp("gateway-cache"))
    a = start_gateway(roles, [pipeline.model], index=0, count=2)
    b = start_gateway(roles, [pipeline.model], index=1, count=2)
    yield a[0], b[0]
    roles.stop_all()


def ask(model: str, text: str, **extra) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        **extra,
    }


async def stream(http: httpx.AsyncClient, url: str, key: str, body: dict) -> tuple[httpx.Headers, list]:
    async with http.stream("POST", url + "/v1/chat/completions", json=body, headers=auth_headers(key)) as r:
        assert r.status_code == 200
        return r.headers, [(event_id, data) async for event_id, data in sse(r)]


def content(events: list) -> str:
    return "".join(
        json.loads(d)["choices"][0]["delta"].get("content") or ""
        for _, d in events
        if d != "[DONE]" and json.loads(d)["choices"]
    )


def shape(events: list) -> list:
    """Each frame without what differs between two answers (its request id and creation time)."""
    out = []
    for _, data in events:
        body = data if data == "[DONE]" else json.loads(data)
        if body != "[DONE]":
            body.pop("id"), body.pop("created")
        out.append(body)
    return out


async def test_a_deterministic_request_asked_again_is_answered_from_the_cache(gateways, pipeline):
    a, b = gateways
    key = new_key("cache-tenant")
    text = WORDS + " " + uuid.uuid4().hex[:6]
    async with httpx.AsyncClient(timeout=30) as http, Tap(CHAT_REQUESTS) as requests, Tap(TOKENS) as tokens:
        headers, live = await stream(http, a, key, ask(pipeline.model, text))
        assert headers["x-tokenstream-cache"] == "miss"
        live_rid = live[0][0].split(":")[0]
        deadline = time.monotonic() + 20
        while True:  # the answer is stored once it has been delivered
            headers, hit = await stream(http, b, key, ask(pipeline.model, text))
            if headers["x-tokenstream-cache"] == "hit":
                break
            assert time.monotonic() < deadline, "never answered from the cache"
            await asyncio.sleep(0.2)
        assert headers["x-tokenstream-cached-request"] == live_rid
        hit_rid = hit[0][0].split(":")[0]
        assert hit_rid != live_rid
        assert shape(hit) == shape(live)  # byte-identical content in the same frames
        n = len(hit) - 4  # content frames between the role frame and finish, usage, [DONE]
        assert [e.split(":")[1] for e, _ in hit] == [str(p) for p in [-1, *range(n), n, n + 1, n + 2]]
        assert content(hit) == text
        # no generation: the pipeline never got it; the log holds the request and its answer for an audit
        assert hit_rid not in pipeline.requests
        [audit] = await requests.wait_for(lambda e: e.request_id == hit_rid)
        assert (
            isinstance(audit, ChatRequest)
            and audit.cached_from == live_rid
            and audit.tenant == "cache-tenant"
        )
        logged = await tokens.wait_for(lambda e: e.request_id == hit_rid and isinstance(e, Completion))
        assert logged[0].text == text
        assert all(
            e.worker_id == f"cache:{live_rid}"
            for e in tokens.matching(lambda e: e.request_id == hit_rid and isinstance(e, TokenChunk))
        )
        # and it resumes like any answer, on the other instance
        async with http.stream(
            "GET",
            f"{a}/v1/chat/completions/chatcmpl-{hit_rid}/stream",
            headers={**auth_headers(key), "Last-Event-ID": hit[3][0]},
        ) as r:
            rest = [item async for item in sse(r)]
        assert content(rest) == content(hit[4:]) and rest[-1] == hit[-1]  # (a replay may coalesce frames)

        # another tenant asking the same never gets this tenant's answer
        headers, _ = await stream(http, a, new_key("other-tenant"), ask(pipeline.model, text))
        assert headers["x-tokenstream-cache"] == "miss"
        # opted out per request, per key, or not deterministic: live, no cache header
        for body, k in (
            (ask(pipeline.model, text, cache=False), key),
            (ask(pipeline.model, text), new_key("cache-tenant", exact_cache=False)),
            (ask(pipeline.model, text, temperature=0.7), key),
        ):
            headers, events = await stream(http, a, k, body)
            assert "x-tokenstream-cache" not in headers
            assert events[0][0].split(":")[0] in pipeline.requests
        headers, _ = await stream(http, a, key, ask(pipeline.model, text, seed=7, temperature=0.7))
        assert headers["x-tokenstream-cache"] == "miss"  # a fixed seed is deterministic too

    # the hit's tokens are counted as cached in the key's usage
    r = redis.Redis.from_url(os.environ["TOKENSTREAM_REDIS_URL"])
    usage_key = K.usage(K.digest(key)[:16], K.usage_day())
    deadline = time.monotonic() + 20
    while int(r.hget(usage_key, "cached") or 0) == 0:
        assert time.monotonic() < deadline, r.hgetall(usage_key)
        await asyncio.sleep(0.2)
    final = json.loads(hit[-2][1])["usage"]
    assert int(r.hget(usage_key, "cached")) == final["total_tokens"]


async def test_a_near_duplicate_question_is_answered_from_the_semantic_cache(gateways, pipeline):
    a, b = gateways
    tenant = f"sem-{uuid.uuid4().hex[:6]}"
    key = new_key(tenant, semantic_cache=True)
    question = "What is the capital of France?"

    async def ask_once(url: str, k: str, messages: list[dict]) -> httpx.Response:
        r = await http.post(
            url + "/v1/chat/completions",
            headers=auth_headers(k),
            json={"model": pipeline.model, "messages": messages, "temperature": 0.8},
        )
        assert r.status_code == 200, r.text
        return r

    def user(text: str) -> list[dict]:
        return [{"role": "user", "content": text}]

    async with httpx.AsyncClient(timeout=120) as http:
        first = await ask_once(a, key, user(question))  # the first one also loads the embedder
        assert first.headers["x-tokenstream-cache"] == "miss"
        deadline = time.monotonic() + 30
        while True:  # stored once answered
            near = await ask_once(b, key, user("What is the capital city of France?"))
            if near.headers["x-tokenstream-cache"] == "semantic-hit":
                break
            assert time.monotonic() < deadline, "a near duplicate never hit"
            await asyncio.sleep(0.3)
        assert float(near.headers["x-tokenstream-cache-similarity"]) >= 0.9
        assert near.headers["x-tokenstream-cached-request"] == first.json()["id"].removeprefix("chatcmpl-")
        assert near.json()["choices"][0]["message"]["content"] == question  # the answer to the first question
        assert near.json()["id"].removeprefix("chatcmpl-") not in pipeline.requests

        # a different question, another tenant, another system message, or a conversation: never from it
        assert (await ask_once(a, key, user("What is the capital of Germany?"))).headers[
            "x-tokenstream-cache"
        ] == "miss"
        other = new_key(f"other-{tenant}", semantic_cache=True)
        assert (await ask_once(a, other, user(question))).headers["x-tokenstream-cache"] == "miss"
        system = [{"role": "system", "content": "Answer in French."}, *user(question)]
        assert (await ask_once(a, key, system)).headers["x-tokenstream-cache"] == "miss"
        history = [*user(question), {"role": "assistant", "content": "Paris."}, *user(question)]
        assert "x-tokenstream-cache" not in (await ask_once(a, key, history)).headers
        # a key that did not opt in
        assert "x-tokenstream-cache" not in (await ask_once(a, new_key(tenant), user(question))).headers
