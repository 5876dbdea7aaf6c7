"""Hostile and malformed input at the gateway: each gets the right 4xx in OpenAI's error shape, never
a (retryable) 5xx, and the gateway goes on serving normal requests.

A real gateway process and a real broker; the pipeline behind the fake model is
tests.gateway_support.FakePipeline. "smollm2" is served too, for the checks against its real context
(8,192 tokens, from common.models) made with its real tokenizer; nothing reaches a worker for it.
"""

from __future__ import annotations

import json
import uuid

import openai
import pytest

from tests.conftest import Roles
from tests.gateway_support import FakePipeline, client, openai_client, start_gateway
from tests.kafka_support import Tap
from topics import CHAT_REQUESTS

MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
async def pipeline(stack, bootstrap):
    p = await FakePipeline(bootstrap, f"echo-{uuid.uuid4().hex[:6]}", token_delay=0.0).start()
    yield p
    await p.stop()


@pytest.fixture(scope="module")
def gateway(stack, pipeline, tmp_path_factory):
    roles = Roles(stack, tmp_path_factory.mktemp("gateway-hostile"))
    url, _ = start_gateway(
        roles, [pipeline.model, "smollm2"], env={"TOKENSTREAM_GATEWAY_MAX_BODY_BYTES": str(MAX_BODY)}
    )
    yield url
    roles.stop_all()


def chat(model: str, text: str = "hello there", **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], **extra}


def assert_openai_error(response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, (response.status_code, response.text[:500])
    body = response.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert err["type"] == "invalid_request_error", err
    if code is not None:
        assert err["code"] == code, err
    return err


async def served_normally(url: str, model: str) -> None:
    async with client(url) as http:
        r = await http.post("/v1/chat/completions", json=chat(model, "still alive"))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "still alive"


async def test_body_over_the_limit_is_413_before_it_is_read(gateway, pipeline):
    big = json.dumps(chat(pipeline.model, "x" * (5 * 1024 * 1024))).encode()
    async with client(gateway) as http:
        r = await http.post("/v1/chat/completions", content=big, headers={"content-type": "application/json"})
        assert_openai_error(r, 413, "request_too_large")

        async def chunked():  # no Content-Length: counted while reading
            for i in range(0, len(big), 16384):
                yield big[i : i + 16384]

        r = await http.post(
            "/v1/chat/completions", content=chunked(), headers={"content-type": "application/json"}
        )
        assert_openai_error(r, 413, "request_too_large")
    # the SDK sees a non-retryable error (413 is not in its retry list)
    with pytest.raises(openai.APIStatusError) as info:
        await openai_client(gateway).chat.completions.create(
            model=pipeline.model, messages=[{"role": "user", "content": "y" * MAX_BODY}]
        )
    assert info.value.status_code == 413
    await served_normally(gateway, pipeline.model)


RAW_BODIES = {
    "lone high surrogate": (
        b'{"model": "M", "messages": [{"role": "user", "content": "a \\ud800 b"}]}',
        None,
    ),
    "lone low surrogate in user": (
        b'{"model": "M", "user": "\\udc00", "messages": [{"role": "user", "content": "x"}]}',
        None,
    ),
    "invalid utf-8": (
        b'{"model": "M", "messages": [{"role": "user", "content": "\xff\xfe bad"}]}',
        "invalid_json",
    ),
    "not json": (b"model=M&messages=hi", "invalid_json"),
    "truncated": (b'{"model": "M", "messages": [{"role": "user", "content": "hel', "invalid_json"),
    "empty": (b"", None),
    "json array": (b"[1, 2, 3]", None),
    "json string": (b'"hello"', None),
    "null": (b"null", None),
    "deep nesting": (b'{"model": "M", "messages": ' + b"[" * 20000 + b"]" * 20000 + b"}", "invalid_json"),
    "deep nesting in an ignored field": (
        b'{"model": "M", "x": '
        + b'{"a":' * 500
        + b"1"
        + b"}" * 500
        + b', "messages": [{"role": "user", "content": "\\ud83d"}]}',
        None,
    ),
    "nan temperature": (
        b'{"model": "M", "temperature": NaN, "messages": [{"role": "user", "content": "x"}]}',
        None,
    ),
    "infinite top_p": (
        b'{"model": "M", "top_p": Infinity, "messages": [{"role": "user", "content": "x"}]}',
        None,
    ),
    "huge integer": (b'{"model": "M", "max_tokens": 1' + b"0" * 5000 + b', "messages": []}', None),
    "messages not a list": (b'{"model": "M", "messages": {"role": "user"}}', None),
    "content a number": (b'{"model": "M", "messages": [{"role": "user", "content": 12}]}', None),
    "duplicate keys": (b'{"model": "M", "model": 5, "messages": [{"role": "user", "content": "x"}]}', None),
}


@pytest.mark.parametrize("name", list(RAW_BODIES))
async def test_malformed_bodies_are_400(gateway, pipeline, name):
    raw, code = RAW_BODIES[name]
    raw = raw.replace(b'"M"', json.dumps(pipeline.model).encode())
    async with client(gateway) as http:
        r = await http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert_openai_error(r, 400, code)


ABSURD = {
    "1,500 messages": dict(messages=[{"role": "user", "content": "h"}] * 1500),
    "max_tokens beyond any int64": dict(max_tokens=10**30),
    "max_completion_tokens negative": dict(max_completion_tokens=-5),
    "seed beyond int64": dict(seed=2**70),
    "temperature huge": dict(temperature=1e308),
    "n huge": dict(n=10**20),
    "five stop strings": dict(stop=["a", "b", "c", "d", "e"]),
    "a huge stop string": dict(stop="z" * 5000),
    "an empty stop string": dict(stop=[""]),
    "a huge model name": dict(model="m" * 10_000),
    "a huge user": dict(user="u" * 10_000),
    "stream not a bool": dict(stream="yes please"),
    "stream_options without stream": dict(stream_options={"include_usage": True}),
    "role unknown": dict(messages=[{"role": "root", "content": "x"}]),
    "message not an object": dict(messages=["hello"]),
}


@pytest.mark.parametrize("name", list(ABSURD))
async def test_absurd_values_are_400(gateway, pipeline, name):
    async with client(gateway) as http:
        r = await http.post("/v1/chat/completions", json=chat(pipeline.model) | ABSURD[name])
    assert_openai_error(r, 400)


async def test_wrong_content_type_path_and_method(gateway, pipeline):
    body = json.dumps(chat(pipeline.model)).encode()
    async with client(gateway) as http:
        for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
            r = await http.post("/v1/chat/completions", content=body, headers={"content-type": ctype})
            assert_openai_error(r, 400, "unsupported_content_type")
        r = await http.post(
            "/v1/chat/completions", content=body, headers={"content-type": "application/json; charset=utf-8"}
        )
        assert r.status_code == 200, r.text
        assert_openai_error(
            await http.post("/v1/chat/completion", json=chat(pipeline.model)), 404, "not_found"
        )
        assert_openai_error(await http.get("/v2/models"), 404, "not_found")
        assert_openai_error(await http.put("/v1/chat/completions"), 405, "method_not_allowed")
        assert_openai_error(await http.delete("/v1/models"), 405, "method_not_allowed")


async def test_unknown_preset_is_404_and_a_known_one_passes(gateway, pipeline):
    with pytest.raises(openai.NotFoundError) as info:
        await openai_client(gateway).chat.completions.create(
            model=pipeline.model,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"assistant": "nope"},
        )
    assert info.value.code == "preset_not_found" and info.value.body["param"] == "assistant"
    done = await openai_client(gateway).chat.completions.create(
        model=pipeline.model, messages=[{"role": "user", "content": "hi"}], extra_body={"assistant": "coder"}
    )
    assert done.choices[0].message.content == "hi"


async def test_context_limits_of_a_real_model_are_400_before_queueing(gateway, pipeline):
    sdk = openai_client(gateway)
    async with Tap(CHAT_REQUESTS) as queued:
        with pytest.raises(openai.BadRequestError) as info:
            await sdk.chat.completions.create(
                model="smollm2", max_tokens=9000, messages=[{"role": "user", "content": "hi"}]
            )
        assert info.value.body["param"] == "max_tokens" and "8192" in info.value.message
        long_text = " ".join(f"w{i}" for i in range(6000))  # about 14,000 tokens in 36 kB
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as info:
                await sdk.chat.completions.create(
                    model="smollm2", stream=stream, messages=[{"role": "user", "content": long_text}]
                )
            assert info.value.code == "context_length_exceeded" and "8192" in info.value.message
        # the tools the worker renders into the prompt count too: a short message with 4 long tool
        # descriptions (about 3,000 tokens each) does not fit
        tools = [
            {
                "type": "function",
                "function": {"name": f"tool_{t}", "description": " ".join(f"d{t}x{i}" for i in range(500))},
            }
            for t in range(4)
        ]
        with pytest.raises(openai.BadRequestError) as info:
            await sdk.chat.completions.create(
                model="smollm2", tools=tools, messages=[{"role": "user", "content": "hi"}]
            )
        assert info.value.code == "context_length_exceeded" and "and the tools" in info.value.message
        # a later request reaches the topic: everything before it would have too
        await served_normally(gateway, pipeline.model)
        await queued.wait_for(lambda e: e.model == pipeline.model)
        assert not queued.matching(lambda e: e.model == "smollm2")


@pytest.mark.parametrize(
    "text",
    [
        "emoji 👩‍👩‍👧‍👦 and flags 🇺🇦",
        "nul \u0000 and bell \u0007",
        "bom \ufeff rtl \u202e zwj \u200d",
        "combining e\u0301\u0301\u0301",
        "private \ue000 and max \U0010ffff",
        "cjk 漢字 かな",
        "\\ud800 as plain text",
    ],
)
async def test_unicode_edge_cases_are_served_unchanged(gateway, pipeline, text):
    async with client(gateway) as http:
        r = await http.post("/v1/chat/completions", json=chat(pipeline.model, text))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == " ".join(text.split())
