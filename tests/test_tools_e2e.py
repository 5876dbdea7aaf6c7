"""Function calling and structured output end to end, with the official `openai` SDK against the real
pipeline: gateway -> conversation, safety and router processors -> a real worker serving SmolLM2 ->
tokens -> gateway. Every answer is greedy, so a streamed answer must equal the non-streamed one.

The 50 tools of bench/tool_schemas.py are asked for concurrently (one batch in the worker),
once streamed and once not, half with tool_choice "required" and half naming the tool; their
parameter schemas are then used as strict json_schema response formats.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import jsonschema
import openai
import pytest

from bench.tool_schemas import tools
from tests.conftest import Roles
from tests.gateway_support import api_client, sse, start_gateway
from tests.kafka_support import Tap
from tests.test_worker_kafka import wait_for_log
from topics import TOOL_CALLS, inference_topic

pytestmark = pytest.mark.slow
MODEL = f"smollm2-tools-{uuid.uuid4().hex[:6]}"
N = 50
MAX_TOKENS = 256  # two calls of the longest tool (its digit strings are a token per digit) fit
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def system(stack, tmp_path_factory):
    """The processors, one SmolLM2 worker (under its own model name) and a gateway."""
    from gpu_workers.model_loader import smollm2_dir
    from topics.admin import apply
    from topics.registry import all_topics

    asyncio.run(apply(all_topics([MODEL]), stack.kafka.address))
    roles = Roles(stack, tmp_path_factory.mktemp("tools-e2e"))
    try:
        roles.start_processors()
        worker = roles.start(
            "worker",
            "--model",
            MODEL,
            "--model-path",
            str(smollm2_dir()),
            "--max-running",
            "64",
            "--kv-blocks",
            "2048",
            "--prefill-chunk",
            "1024",
            name="worker",
        )
        wait_for_log(roles, worker, "worker ready", 300)
        # the whole set is asked for at once: admission must queue it rather than answer 429
        url, _ = start_gateway(
            roles,
            [MODEL],
            timeout=120,
            env={
                "TOKENSTREAM_GATEWAY_ADMISSION_BUDGET_S": "3600",
                "TOKENSTREAM_GATEWAY_PROGRESS_TIMEOUT_S": "1800",
            },
        )
        yield url, roles, worker
    finally:
        roles.stop_all()


@pytest.fixture
def client(system):
    return api_client(system[0], timeout=900)


def parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or NO_PARAMETERS


async def streamed(client, **kw) -> tuple[list[dict], str | None, str]:
    """(calls as {id, name, arguments}, finish_reason, content) of a streamed answer, checking the chunk
    shape."""
    calls: list[dict] = []
    finish, content = None, ""
    stream = await client.chat.completions.create(stream=True, **kw)
    async for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                if d.id is not None:  # the first delta of a call: index, id, type, name, empty arguments
                    assert d.index == len(calls) and d.type == "function" and d.function.arguments == ""
                    calls.append({"id": d.id, "name": d.function.name, "arguments": ""})
                else:
                    assert d.function.name is None
                    calls[d.index]["arguments"] += d.function.arguments
            finish = choice.finish_reason or finish
    return calls, finish, content


def plain(done) -> tuple[list[dict], str | None, str | None]:
    message = done.choices[0].message
    calls = [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
        for c in message.tool_calls or []
    ]
    return calls, done.choices[0].finish_reason, message.content


@pytest.mark.heavy
@pytest.mark.timeout(1800)
async def test_fifty_tools_required_and_named_streamed_and_not(client):
    pairs = tools(N)

    async def one(i: int, tool: dict, prompt: str):
        name = tool["function"]["name"]
        choice = "required" if i % 2 == 0 else {"type": "function", "function": {"name": name}}
        kw = dict(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            tools=[tool],
            tool_choice=choice,
            temperature=0,
            max_tokens=MAX_TOKENS,
        )
        return await asyncio.gather(client.chat.completions.create(**kw), streamed(client, **kw))

    results = await asyncio.gather(*(one(i, t, p) for i, (t, p) in enumerate(pairs)), return_exceptions=True)
    failures = []
    for i, ((tool, _), result) in enumerate(zip(pairs, results)):
        name = tool["function"]["name"]
        if isinstance(result, BaseException):
            failures.append(f"{name}: {result!r}")
            continue
        done, (s_calls, s_finish, s_content) = result
        calls, finish, content = plain(done)
        try:
            assert finish == "tool_calls" and s_finish == "tool_calls", (finish, s_finish)
            assert content is None and s_content == "", (content, s_content)
            assert calls and all(c["name"] == name for c in calls), calls
            if i % 2:
                assert len(calls) == 1  # a named choice makes exactly one call
            for call in calls:
                jsonschema.validate(json.loads(call["arguments"]), parameters(tool))
                if "parameters" not in tool["function"]:
                    assert call["arguments"] == "{}"
            assert [(c["name"], c["arguments"]) for c in s_calls] == [
                (c["name"], c["arguments"]) for c in calls
            ]
            assert all(c["id"].startswith("call_") for c in calls + s_calls)
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            failures.append(f"{name}: {exc}\n  plain {calls}\n  streamed {s_calls}")
    assert not failures, f"{len(failures)} of {N} failed:\n" + "\n".join(failures)


@pytest.mark.heavy
@pytest.mark.timeout(1800)
async def test_fifty_json_schema_answers_validate(client):
    pairs = tools(N)

    async def one(tool: dict, prompt: str):
        fmt = {
            "type": "json_schema",
            "json_schema": {"name": tool["function"]["name"], "strict": True, "schema": parameters(tool)},
        }
        return await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            response_format=fmt,
            temperature=0,
            max_tokens=MAX_TOKENS,
        )

    answers = await asyncio.gather(*(one(t, p) for t, p in pairs), return_exceptions=True)
    failures = []
    for (tool, _), done in zip(pairs, answers):
        if isinstance(done, BaseException):
            failures.append(f"{tool['function']['name']}: {done!r}")
            continue
        try:
            assert done.choices[0].finish_reason == "stop"
            jsonschema.validate(json.loads(done.choices[0].message.content), parameters(tool))
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            failures.append(f"{tool['function']['name']}: {exc}: {done.choices[0].message.content!r}")
    assert not failures, f"{len(failures)} of {N} failed:\n" + "\n".join(failures)


async def test_parallel_false_makes_one_call_and_usage_follows(client):
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris, Tokyo and Lima?"}],
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    many, one = await asyncio.gather(
        client.chat.completions.create(**kw), client.chat.completions.create(parallel_tool_calls=False, **kw)
    )
    assert len(one.choices[0].message.tool_calls) == 1
    assert len(many.choices[0].message.tool_calls) >= 1
    chunks = [
        c
        async for c in await client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, parallel_tool_calls=False, **kw
        )
    ]
    assert chunks[-2].choices[0].finish_reason == "tool_calls"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == one.usage.completion_tokens


async def test_auto_lets_the_model_answer_in_text(client):
    done = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello to my friend Ann."}],
        tools=[WEATHER],
        temperature=0,
        max_tokens=24,
    )
    message = done.choices[0].message
    if message.tool_calls:  # the model chose to call: then the call is complete and valid
        assert done.choices[0].finish_reason == "tool_calls"
        jsonschema.validate(json.loads(message.tool_calls[0].function.arguments), parameters(WEATHER))
    else:
        assert message.content and "<tool_call>" not in message.content


@pytest.mark.parametrize(
    "body, param, message",
    [
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]},
            "tools[0].function.parameters",
            "Invalid schema",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not in tools",
        ),
        ({"tool_choice": "required"}, "tool_choice", "only allowed when tools"),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "tool", "tool_call_id": "call_x", "content": "1"},
                ]
            },
            "messages[1].tool_call_id",
            "no earlier assistant",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
            "response_format.json_schema.schema",
            "Invalid schema",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parmeters": {}}}]},
            "tools.0.function.parmeters",
            "Extra inputs",
        ),
    ],
)
async def test_bad_requests_get_openai_shaped_400s(client, body, param, message):
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body}
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(**kw)
    error = e.value.response.json()["error"]
    assert (
        error["type"] == "invalid_request_error" and error["param"] == param and message in error["message"]
    )


async def test_a_schema_over_the_compile_limit_ends_alone(client):
    """The grammar is too large for llguidance's limits: that request ends with a clear error, the
    requests in the same batch finish normally."""
    huge = {
        "type": "object",
        "allOf": [
            {"anyOf": [{"properties": {f"a{i}": {"const": j}}, "required": [f"a{i}"]} for j in range(8)]}
            for i in range(8)
        ],
    }
    bad = {"type": "function", "function": {"name": "huge", "parameters": huge}}
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Rome?"}],
        temperature=0,
        max_tokens=MAX_TOKENS,
        tool_choice="required",
    )
    results = await asyncio.gather(
        client.chat.completions.create(tools=[bad], **kw),
        *(client.chat.completions.create(tools=[WEATHER], **kw) for _ in range(3)),
        return_exceptions=True,
    )
    assert isinstance(results[0], openai.InternalServerError)
    assert "output grammar" in str(results[0]) and "too large" in str(results[0])
    for done in results[1:]:
        assert not isinstance(done, BaseException), done
        assert done.choices[0].finish_reason == "tool_calls"


async def test_client_tool_round_trip_without_and_with_conversation_id(client):
    """The call is recorded as a ToolCall event; the client's tool message reaches the worker behind the
    assistant's call (sent whole, or completed by the conversation processor from the stored history),
    and the answer is text. (Whether a 135M model then states the result is not asserted.)"""
    ask = {"role": "user", "content": "What is the weather in Paris?"}
    kw = dict(model=MODEL, tools=[WEATHER], temperature=0, max_tokens=40)
    async with Tap(inference_topic(MODEL)) as prepared, Tap(TOOL_CALLS) as audit:
        for cid in (None, f"tools-{uuid.uuid4().hex[:8]}"):
            extra = {"conversation_id": cid} if cid else {}
            first = await client.chat.completions.create(
                messages=[ask], tool_choice="required", extra_body=extra, **kw
            )
            call = first.choices[0].message.tool_calls[0]
            assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"]
            [event] = await audit.wait_for(lambda e, c=call: e.call_id == c.id)
            # the tenant is the API key's (the tests' default key belongs to tenant "test")
            assert (event.name, event.arguments, event.tenant) == (
                "get_weather",
                call.function.arguments,
                "test",
            )
            assert event.request_id == first.id.removeprefix("chatcmpl-") and event.conversation_id == (
                cid or event.request_id
            )
            result = {
                "role": "tool",
                "tool_call_id": call.id,
                "content": "It is 31 degrees and sunny in Paris.",
            }
            # without conversation_id the client sends the whole history back; with it, only the new message
            messages = (
                [ask, first.choices[0].message.model_dump(exclude_none=True), result]
                if cid is None
                else [result]
            )
            second = await client.chat.completions.create(
                messages=messages, tool_choice="none", extra_body=extra, **kw
            )
            answer = second.choices[0].message
            assert second.choices[0].finish_reason in ("stop", "length") and not answer.tool_calls
            assert answer.content and "<tool_call>" not in answer.content
            second_id = second.id.removeprefix("chatcmpl-")
            [seen] = await prepared.wait_for(lambda e, r=second_id: e.request_id == r)
            roles = [
                (m.role, [c.id for c in m.tool_calls], m.tool_call_id)
                for m in seen.messages
                if m.role != "system"
            ]
            assert roles == [("user", [], None), ("assistant", [call.id], None), ("tool", [], call.id)]
        with pytest.raises(openai.InternalServerError, match="no earlier assistant message made"):
            await client.chat.completions.create(
                messages=[{**result, "tool_call_id": "call_unknown"}],
                extra_body={"conversation_id": cid},
                **kw,
            )


async def test_resume_in_the_middle_of_a_call_gives_the_same_arguments(system, client):
    url = system[0]
    request = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Buenos Aires please"}],
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    whole = await client.chat.completions.create(**request)
    expected = whole.choices[0].message.tool_calls[0].function.arguments

    def arguments(data: str) -> str:
        if data == "[DONE]":
            return ""
        return "".join(
            d["function"].get("arguments", "")
            for c in json.loads(data).get("choices", [])
            for d in c["delta"].get("tool_calls", [])
        )

    async with api_client(url, kind="http") as http:
        first = []
        async with http.stream("POST", "/v1/chat/completions", json={**request, "stream": True}) as r:
            async for event_id, data in sse(r):
                first.append((event_id, data))
                if arguments(data):  # inside the arguments: drop the connection
                    break
        cid = json.loads(first[0][1])["id"]
        async with http.stream(
            "GET", f"/v1/chat/completions/{cid}/stream", headers={"Last-Event-ID": first[-1][0]}
        ) as r:
            rest = [e async for e in sse(r)]
    assert rest[-1][1] == "[DONE]"
    got = "".join(arguments(d) for _, d in first + rest)
    assert got == expected and len(arguments(first[-1][1])) < len(expected)


async def test_langchain_bind_tools_two_step_loop(system):
    """A second real client: LangChain's ChatOpenAI with bind_tools, a call, the tool's result, an answer."""
    from langchain_core.messages import HumanMessage, ToolMessage

    llm = api_client(system[0], kind="langchain", model=MODEL, temperature=0, max_tokens=40)
    ask = HumanMessage("What is the weather in Paris?")
    first = await llm.bind_tools([WEATHER], tool_choice="required").ainvoke([ask])
    [call] = first.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] and call["id"].startswith("call_")
    result = ToolMessage("It is 31 degrees and sunny in Paris.", tool_call_id=call["id"])
    second = await llm.bind_tools([WEATHER], tool_choice="none").ainvoke([ask, first, result])
    assert not second.tool_calls and isinstance(second.content, str) and second.content
    assert second.response_metadata["finish_reason"] in ("stop", "length")
