"""Function calling and structured output in pieces, with the real llguidance and SmolLM2 tokenizer:
the gateway's checks, the grammars of the 50 benchmark tools, masks, the compile limit, the call
parser under any split, and the prompt rendering."""

from __future__ import annotations

import asyncio
import json
import random

import msgspec
import pytest
import torch

from bench.tool_schemas import tools
from common.models import load_tokenizer
from gateway.tool_params import BadField, Tool, check_tool_messages, output_spec
from gpu_workers.grammar import GrammarError, Grammars, grammar_text
from gpu_workers.tool_calls import ToolCallParser
from schemas import (
    ChatMessage,
    ChatRequest,
    FunctionCall,
    MessageToolCall,
    OutputSpec,
    call_id,
    decode,
    encode,
)
from schemas.prompt import render

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        },
    },
}
NOARGS = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture(scope="module")
def grammars():
    tok = load_tokenizer("smollm2")
    return Grammars(tok, {tok.eos_token_id}, timeout_s=10)


def spec(tool_list, choice="required", parallel=None, fmt=None) -> OutputSpec:
    return output_spec([Tool(**t) for t in tool_list], choice, parallel, fmt)


def test_gateway_checks():
    with pytest.raises(BadField, match="Invalid schema") as e:
        spec([{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}])
    assert e.value.param == "tools[0].function.parameters"
    from gateway.tool_params import NamedToolChoice

    with pytest.raises(BadField, match="not in tools"):
        spec([WEATHER], NamedToolChoice(type="function", function={"name": "nope"}))
    with pytest.raises(BadField, match="only allowed when tools"):
        output_spec(None, "required", None, None)
    with pytest.raises(BadField, match="duplicate"):
        spec([WEATHER, WEATHER])
    assert (
        spec([WEATHER], None).tool_choice == "auto"
        and output_spec(None, None, None, None).tool_choice == "none"
    )
    named = spec([WEATHER, NOARGS], NamedToolChoice(type="function", function={"name": "get_time"}))
    assert [t.function.name for t in named.callable_tools] == ["get_time"]

    class M:  # the gateway's Message, reduced to what the check reads
        def __init__(self, role, tool_call_id=None, tool_calls=None):
            self.role, self.tool_call_id, self.tool_calls = role, tool_call_id, tool_calls

    class C:
        def __init__(self, id_):
            self.id = id_

    check_tool_messages([M("user"), M("assistant", tool_calls=[C("c1")]), M("tool", "c1")], continued=False)
    with pytest.raises(BadField, match="no earlier assistant"):
        check_tool_messages([M("user"), M("tool", "c9")], continued=False)
    check_tool_messages([M("tool", "c9")], continued=True)  # the stored history is checked by the processor


def test_old_events_decode_with_defaults():
    old = (
        b'{"type":"chat_request","request_id":"r","model":"m",'
        b'"messages":[{"role":"user","content":"hi"}],"v":1}'
    )
    request = decode(old, ChatRequest)
    assert request.output == OutputSpec() and not request.output.constrained
    again = decode(
        encode(
            ChatRequest(
                request_id="r",
                model="m",
                messages=[
                    ChatMessage(
                        role="assistant",
                        content="",
                        tool_calls=[MessageToolCall(id="c", function=FunctionCall(name="f"))],
                    )
                ],
                output=spec([WEATHER]),
            )
        ),
        ChatRequest,
    )
    assert again.output.tools[0].function.name == "get_weather" and again.messages[0].tool_calls[0].id == "c"


def test_fifty_tool_grammars_compile_and_accept_valid_calls(grammars):
    tok = load_tokenizer("smollm2")

    async def run():
        for tool, _ in tools(50):
            state = await grammars.state_for(spec([tool]))
            name = tool["function"]["name"]
            text = f'<tool_call>{{"name": "{name}", "arguments": {{}}}}</tool_call>'
            ok = state.matcher.consume_tokens(tok.encode(text, add_special_tokens=False))
            required = tool["function"].get("parameters", {}).get("required")
            assert ok == (not required), (name, state.matcher.get_error())

    asyncio.run(run())


def test_mask_forces_the_call_format(grammars):
    tok = load_tokenizer("smollm2")

    async def run():
        forced = await grammars.state_for(spec([WEATHER]))
        logits = torch.zeros(3, len(tok))
        grammars.mask(logits, [None, forced, None])
        assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()
        allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
        assert allowed and all("<tool_call>".startswith(tok.decode([t])) for t in allowed)
        forced.advance(tok.encode("hello", add_special_tokens=False)[0])  # a token the grammar forbids
        assert forced.error is not None
        logits = torch.zeros(1, len(tok))
        grammars.mask(logits, [forced])  # a failed grammar may only end
        assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [tok.eos_token_id]

    asyncio.run(run())


def test_compile_limits(grammars):
    slow = Grammars(load_tokenizer("smollm2"), {2}, timeout_s=1e-6)
    big = {
        "type": "object",
        "allOf": [
            {"anyOf": [{"properties": {f"a{i}": {"const": j}}, "required": [f"a{i}"]} for j in range(8)]}
            for i in range(8)
        ],
    }

    async def run():
        enums = {f"p{i}": {"enum": [f"v{i}-{j}-{j * 7919 % 10007}" for j in range(3000)]} for i in range(10)}
        with pytest.raises(GrammarError, match="did not compile within"):  # a compile of ~0.3 s
            await slow.state_for(
                OutputSpec(
                    response_format="json_schema",
                    json_schema={"type": "object", "properties": enums, "required": list(enums)},
                )
            )
        with pytest.raises(GrammarError, match="too large"):
            await grammars.state_for(
                spec([{"type": "function", "function": {"name": "f", "parameters": big}}])
            )

    asyncio.run(run())


def test_grammar_shapes():
    assert grammar_text(OutputSpec()) is None
    one = grammar_text(spec([WEATHER, NOARGS], "required", parallel=False))
    assert "calls: call\n" in one and '"properties":{}' in one  # one call; no parameters -> {}
    assert "TEXT" in grammar_text(spec([WEATHER], "auto"))
    assert grammar_text(spec([WEATHER], "none")).startswith("start: TEXT\n")  # none: text, never a call


def test_parser_any_split_gives_the_same_calls():
    text = (
        '<tool_call>{"name": "get_weather", '
        '"arguments": {"city": "Pa\\"ri}s", "x": [1, {"a": 2}]}}</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    rng = random.Random(3)
    for _ in range(50):
        parser, deltas, i = ToolCallParser("r1"), [], 0
        while i < len(text):
            n = rng.randint(1, 9)
            content, got = parser.feed(text[i : i + n])
            assert content == ""
            deltas += got
            i += n
        firsts = [d for d in deltas if d.id]
        assert [(d.index, d.id, d.name, d.arguments) for d in firsts] == [
            (0, call_id("r1", 0), "get_weather", ""),
            (1, call_id("r1", 1), "get_time", ""),
        ]
        args = {}
        for d in deltas:
            args[d.index] = args.get(d.index, "") + d.arguments
        assert args == {0: '{"city": "Pa\\"ri}s", "x": [1, {"a": 2}]}', 1: "{}"}
        assert [json.loads(c.function.arguments) for c in parser.calls] == [
            {"city": 'Pa"ri}s', "x": [1, {"a": 2}]},
            {},
        ]
    parser = ToolCallParser("r2")
    assert parser.feed("<tool") == ("", []) and parser.feed("s are nice") == ("<tools are nice", [])


def test_rendering_describes_tools_and_replays_calls():
    call = MessageToolCall(id="c1", function=FunctionCall(name="get_weather", arguments='{"city": "Oslo"}'))
    msgs = render(
        [
            ChatMessage(role="user", content="weather?"),
            ChatMessage(role="assistant", content="", tool_calls=[call]),
            ChatMessage(role="tool", content="12 C", tool_call_id="c1"),
        ],
        spec([WEATHER]),
    )
    assert msgs[0]["role"] == "system" and '"name": "get_weather"' in msgs[0]["content"]
    assert (
        msgs[2]["content"] == '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    )
    assert msgs[3] == {"role": "tool", "content": "12 C"}
    assert msgspec.json.decode(msgspec.json.encode(msgs))  # plain data for the chat template


def test_keep_alive_between_events_is_invisible_to_the_openai_sdk():
    """The SDK keeps the last event id, so a blank-line-ended ping after an event with an id became an
    empty event it failed to parse; the gateway's ping ends no event."""
    from openai._streaming import SSEDecoder

    from gateway.sse import PING, frame

    wire = frame('{"a": 1}', id="r:0") + PING + PING + frame('{"a": 2}', id="r:1")
    events = list(SSEDecoder().iter_bytes(iter([wire])))
    assert [json.loads(e.data) for e in events] == [{"a": 1}, {"a": 2}]
    assert [e.id for e in events] == ["r:0", "r:1"]
    old = frame('{"a": 1}', id="r:0") + b": ping\r\n\r\n"
    assert [e.data for e in SSEDecoder().iter_bytes(iter([old]))] == ['{"a": 1}', ""]  # what broke before


def test_an_sse_frame_keeps_every_line_of_its_data_and_one_line_ids():
    from openai._streaming import SSEDecoder

    from gateway.sse import frame

    wire = frame("one\ntwo\r\nthree", id="r:\n7", event="response.done")
    (event,) = SSEDecoder().iter_bytes(iter([wire]))
    assert (event.data, event.id, event.event) == ("one\ntwo\nthree", "r:7", "response.done")


def test_history_keeps_calls_and_finds_unanswered_tool_messages():
    from processors.conversation.history import merge, unmatched_tool_message, with_answer
    from schemas import Completion

    call = MessageToolCall(
        id="call_1", function=FunctionCall(name="get_weather", arguments='{"city": "Oslo"}')
    )
    history = with_answer(
        [ChatMessage(role="user", content="weather?")],
        Completion(request_id="r", seq=3, finish_reason="tool_calls", tool_calls=[call]),
    )
    assert history[-1].role == "assistant" and history[-1].tool_calls == [call]
    turn = [ChatMessage(role="tool", content="12 C", tool_call_id="call_1")]
    assert unmatched_tool_message(merge(history, turn)) is None  # only the new message was sent
    assert (
        unmatched_tool_message(merge(history, [ChatMessage(role="tool", content="x", tool_call_id="c9")]))
        == "c9"
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from gpu_workers.model_loader import load
    from gpu_workers.random_model import build

    return load("tiny", build(tmp_path_factory.mktemp("tiny-model")), dtype="float32")


def test_stop_strings_never_cut_what_the_grammar_forces(tiny):
    """A stop string inside a forced call or JSON answer does not end it; in free text it does."""
    from gpu_workers.engine import Engine, Sequence
    from gpu_workers.kv_cache import KVBudget
    from schemas.prompt import prompt_ids

    engine = Engine(tiny.model, tiny.tokenizer, KVBudget.for_model(tiny.model, 256, 16, 1.0))
    grammars = Grammars(tiny.tokenizer, engine.eos_ids, timeout_s=30)
    shape = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"],
    }
    cases = {
        "call": spec([WEATHER], "required", parallel=False),
        "json": OutputSpec(response_format="json_schema", json_schema=shape),
        "text": spec([WEATHER], "none"),
    }
    stops = {"call": ['"arguments"', "city", "<tool_call>", '"}'], "json": ['{"n"', ": "]}

    async def run(name: str, stop: list[str]) -> Sequence:
        ids = prompt_ids(tiny.tokenizer, [ChatMessage(role="user", content="Weather in Paris?")], cases[name])
        seq = Sequence(name, ids, max_tokens=160 if name != "text" else 24, temperature=0, stop=stop)
        seq.grammar = await grammars.state_for(cases[name])
        engine.generate([seq])
        return seq

    async def main():
        for name in ("call", "json"):
            free, stopped = await run(name, []), await run(name, stops[name])
            assert all(s in free.emitted_text for s in stops[name])  # each stop string is inside the answer
            assert (
                stopped.emitted_text == free.emitted_text
                and stopped.finish_reason == free.finish_reason == "stop"
            )
            assert stopped.grammar.error is None
        call = (await run("call", stops["call"])).emitted_text
        assert call.startswith('<tool_call>{"name": "get_weather", "arguments": ') and call.endswith(
            "</tool_call>"
        )
        assert isinstance(
            json.loads(call.removeprefix("<tool_call>").removesuffix("</tool_call>"))["arguments"]["city"],
            str,
        )
        assert json.loads((await run("json", stops["json"])).emitted_text)["n"] in range(100)
        # free text (tool_choice none): the stop string ends the answer where it first occurs
        text = (await run("text", [])).emitted_text
        cut = text[6:9]
        assert len(cut) == 3
        stopped = await run("text", [cut])
        assert stopped.finish_reason == "stop" and stopped.emitted_text == text[: text.index(cut)]

    asyncio.run(main())


def test_the_stop_region_of_auto_is_free_text_until_a_call_opens():
    from gpu_workers.grammar import GrammarState, stop_scope

    assert stop_scope(spec([WEATHER], "auto")) == "text" and stop_scope(spec([WEATHER], "none")) == "all"
    assert (
        stop_scope(spec([WEATHER], "required"))
        == stop_scope(OutputSpec(response_format="json_object"))
        == "none"
    )
    auto = GrammarState(None, None, "text")
    assert auto.stop_region("") is None and auto.stop_region("<tool_") is None  # could still open a call
    assert auto.stop_region('<tool_call>{"name": "x"') == ""
    assert auto.stop_region("<b>Sunny</b>") == "<b>Sunny</b>" and auto.stop_region("Sunny") == "Sunny"
