"""The gateway as an OpenAI-compatible API, driven by the official `openai` SDK, unchanged.

A real gateway process, a real broker; the pipeline behind it is tests.gateway_support.FakePipeline.
"""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest

from tests.conftest import Roles
from tests.gateway_support import (
    FakePipeline,
    auth_headers,
    default_key,
    expected_answer,
    free_port,
    metric,
    start_gateway,
)

PROMPT = "the quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
async def pipeline(stack, bootstrap):
    p = await FakePipeline(bootstrap, f"echo-{uuid.uuid4().hex[:6]}", token_delay=0.005).start()
    yield p
    await p.stop()


@pytest.fixture(scope="module")
def gateway(stack, pipeline, tmp_path_factory):
    roles = Roles(stack, tmp_path_factory.mktemp("gateway-api"))
    url, _proc = start_gateway(roles, [pipeline.model, "smollm2"])
    yield url
    roles.stop_all()


@pytest.fixture
def client(gateway):
    return openai.AsyncOpenAI(base_url=gateway + "/v1", api_key=default_key(), max_retries=0, timeout=30)


def ask(text: str = PROMPT):
    return [{"role": "system", "content": "you echo"}, {"role": "user", "content": text}]


async def test_models_health_metrics(gateway, client, pipeline):
    models = await client.models.list()
    # the chat models, and the speech models the tool processor serves (/v1/audio) under both names
    assert {m.id for m in models.data} == {
        pipeline.model,
        "smollm2",
        "whisper-tiny.en",
        "whisper-1",
        "espeak-ng",
        "tts-1",
        "tts-1-hd",
    }
    async with httpx.AsyncClient(base_url=gateway, headers=auth_headers()) as http:
        assert (await http.get("/health/live")).status_code == 200
        ready = await http.get("/health/ready")
        assert ready.status_code == 200 and ready.json()["ready"] is True
        assert "gateway_admission_lag" in (await http.get("/metrics")).text
        assert "<html" in (await http.get("/")).text.lower()


async def test_non_streaming(client, pipeline):
    done = await client.chat.completions.create(
        model=pipeline.model, messages=ask(), user="alice", temperature=0, seed=7, top_p=0.5
    )
    assert done.object == "chat.completion"
    assert done.choices[0].message.role == "assistant"
    assert done.choices[0].message.content == PROMPT
    assert done.choices[0].finish_reason == "stop"
    assert done.usage.completion_tokens == 9 and done.usage.prompt_tokens == 11
    assert done.usage.total_tokens == 20
    rid = done.id.removeprefix("chatcmpl-")
    sent = pipeline.requests[rid]  # what reached the pipeline
    assert sent.user == "alice" and sent.sampling.temperature == 0 and sent.sampling.seed == 7
    assert sent.sampling.top_p == 0.5 and sent.model == pipeline.model
    assert [m.role for m in sent.messages] == ["system", "user"]
    assert sent.conversation_id == rid and sent.assistant is None  # a new conversation of its own


async def test_conversation_and_assistant_extensions(client, pipeline):
    done = await client.chat.completions.create(
        model=pipeline.model,
        messages=ask(),
        extra_body={"conversation_id": "conv-42", "assistant": "coder"},
        extra_headers={"x-tenant": "acme"},
    )
    sent = pipeline.requests[done.id.removeprefix("chatcmpl-")]
    # the tenant and tier come from the API key; the x-tenant header decides nothing
    assert (sent.conversation_id, sent.assistant, sent.tenant) == ("conv-42", "coder", "test")
    assert (sent.tier, sent.priority) == ("paid", 1)


async def test_streaming(client, pipeline):
    stream = await client.chat.completions.create(model=pipeline.model, messages=ask(), stream=True)
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == PROMPT
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(c.usage is None for c in chunks)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")


async def test_streaming_include_usage(client, pipeline):
    stream = await client.chat.completions.create(
        model=pipeline.model, messages=ask(), stream=True, stream_options={"include_usage": True}
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == PROMPT
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 9 and last.usage.prompt_tokens == 11
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "stop"


async def test_max_tokens_stop_and_max_completion_tokens(client, pipeline):
    done = await client.chat.completions.create(model=pipeline.model, messages=ask(), max_tokens=3)
    assert done.choices[0].message.content == expected_answer(PROMPT, 3)
    assert done.choices[0].finish_reason == "length"
    done = await client.chat.completions.create(model=pipeline.model, messages=ask(), max_completion_tokens=2)
    assert done.choices[0].message.content == "the quick" and done.choices[0].finish_reason == "length"
    stream = await client.chat.completions.create(
        model=pipeline.model, messages=ask(), stream=True, stop=["fox"]
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream])
    assert text == "the quick brown"


async def test_generation_error_is_reported(client, pipeline):
    with pytest.raises(openai.InternalServerError):
        await client.chat.completions.create(model=pipeline.model, messages=ask("a [[error]] b"))
    stream = await client.chat.completions.create(
        model=pipeline.model, messages=ask("a [[error]] b"), stream=True
    )
    with pytest.raises(openai.APIError):
        async for _ in stream:
            pass


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(messages=[]), "messages"),
        (dict(temperature=3.5), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(n=2), "n"),
        (dict(messages=[{"role": "wizard", "content": "hi"}]), "messages.0"),
    ],
)
async def test_invalid_request_is_400(client, pipeline, kwargs, param):
    args = dict(model=pipeline.model, messages=ask()) | kwargs
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(**args)
    err = info.value
    assert err.status_code == 400
    assert err.body["type"] == "invalid_request_error" and err.body["param"].startswith(param)
    assert err.body["message"]


@pytest.mark.parametrize(
    "field, value",
    [
        ("stream_interval", 0),
        ("stream_interval", 1025),
        ("stream_interval", "often"),
        ("stream_interval_ms", -1),
        ("stream_interval_ms", 10_001),
    ],
)
async def test_a_stream_interval_out_of_range_is_400_naming_it(gateway, client, pipeline, field, value):
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(
            model=pipeline.model, messages=ask(), stream=True, extra_body={field: value}
        )
    assert info.value.body["type"] == "invalid_request_error" and info.value.body["param"] == field
    async with httpx.AsyncClient(timeout=30) as http:  # the Responses API shares the field
        r = await http.post(
            gateway + "/v1/responses",
            json={"model": pipeline.model, "input": PROMPT, field: value},
            headers=auth_headers(),
        )
    assert r.status_code == 400 and r.json()["error"]["param"] == field


async def test_a_stream_interval_is_carried_to_the_worker(client, pipeline):
    stream = await client.chat.completions.create(
        model=pipeline.model,
        messages=ask(),
        stream=True,
        extra_body={"stream_interval": 4, "stream_interval_ms": 0},
    )
    chunks = [c async for c in stream]
    sampling = pipeline.requests[chunks[0].id.removeprefix("chatcmpl-")].sampling
    assert (sampling.stream_interval, sampling.stream_interval_ms) == (4, 0)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected_answer(PROMPT)


async def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        await client.chat.completions.create(model="no-such-model", messages=ask())
    assert info.value.status_code == 404 and info.value.code == "model_not_found"
    assert info.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("no-such-model")


def test_pipeline_down_is_503(stack, tmp_path):
    """A gateway whose broker is unreachable: live, not ready, and 503 with the OpenAI body."""
    roles = Roles(stack, tmp_path)
    dead = f"127.0.0.1:{free_port()}"
    try:
        url, _ = start_gateway(
            roles, ["smollm2"], env={"TOKENSTREAM_KAFKA_BOOTSTRAP": dead}, wait_ready=False
        )
        assert httpx.get(url + "/health/ready").status_code == 503
        client = openai.OpenAI(base_url=url + "/v1", api_key=default_key(), max_retries=0)
        with pytest.raises(openai.InternalServerError) as info:
            client.chat.completions.create(model="smollm2", messages=ask())
        assert info.value.status_code == 503
        assert info.value.body["type"] == "service_unavailable"
        with pytest.raises(openai.InternalServerError):
            client.chat.completions.create(model="smollm2", messages=ask(), stream=True)
    finally:
        roles.stop_all()


async def test_requests_are_counted(gateway, client, pipeline):
    before = metric(gateway, "gateway_requests_total", 'status="200"')
    await client.chat.completions.create(model=pipeline.model, messages=ask("one two"))
    assert metric(gateway, "gateway_requests_total", 'status="200"') == before + 1
