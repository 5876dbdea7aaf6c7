"""The pieces of a response run without a broker: the request checks, the run's rule and state
steps (processors/conversation/runs.py), and the fold of a run's events into OpenAI's stream events."""

from __future__ import annotations

import json

import msgspec
import pytest
from pydantic import ValidationError

from gateway import openai_api as api
from gateway.conversations import history
from gateway.responses_api import ResponseCreate, messages_of, output_and_run
from gateway.responses_framing import ResponseFramer, base_response
from processors.conversation import runs
from schemas import (
    ChatRequest,
    Completion,
    FunctionCall,
    FunctionSpec,
    MessageToolCall,
    OutputSpec,
    RunSpec,
    SamplingParams,
    TokenChunk,
    ToolCallDelta,
    ToolResult,
    ToolSpec,
    Usage,
    call_id,
    decode,
    encode,
)
from schemas.ids import new_request_id, parse_request_id, run_id_of, step_request_id
from tests.open_responses import CODE_INTERPRETER_ITEM_EVENTS

RID = new_request_id(3, 1764480000.0)


def test_step_ids_keep_the_runs_partition_and_time_and_differ_per_step():
    ids = [step_request_id(RID, k) for k in range(8)]
    assert ids[0] == RID and len(set(ids)) == 8
    assert {parse_request_id(i) for i in ids} == {parse_request_id(RID)}
    assert run_id_of("resp_" + RID) == RID
    with pytest.raises(ValueError):
        run_id_of("resp_nope")


def test_the_run_rule_goes_on_only_through_server_calls_and_forces_text_at_the_last_step():
    spec = RunSpec(server_tools=["code_interpreter"], max_steps=3)

    def done(*names: str, reason: str = "tool_calls") -> Completion:
        return Completion(
            request_id=RID,
            seq=1,
            finish_reason=reason,
            tool_calls=[
                MessageToolCall(id=call_id(RID, i), function=FunctionCall(name=n))
                for i, n in enumerate(names)
            ],
        )

    assert spec.continues(0, done("code_interpreter"), 0)
    assert not spec.continues(0, done("code_interpreter", "get_weather"), 0)  # the client answers that one
    assert not spec.continues(2, done("code_interpreter"), 0)  # no step 3
    assert not spec.continues(0, done(reason="stop"), 0)
    body = ResponseCreate(
        model="m", input="x", tools=[{"type": "code_interpreter"}], tool_choice={"type": "code_interpreter"}
    )
    output, run = output_and_run(body.tools, body, 3)
    assert output.tool_choice == "function" and output.tool_name == "code_interpreter"
    assert run.server_tools == ["code_interpreter"]
    assert run.output_for(0, output) is output
    assert run.output_for(1, output).tool_choice == "auto"  # forcing again would loop
    assert run.output_for(2, output).tool_choice == "none"


def test_max_output_tokens_bounds_the_whole_run_not_each_step():
    """The response's max_output_tokens is one budget for all its steps: the conversation processor gives
    each next step what is left, and a step that spends it while calling a server tool ends the run
    (the gateway's framer ends the response incomplete, reason max_output_tokens)."""
    spec = RunSpec(server_tools=["code_interpreter"], max_steps=8, max_output_tokens=10)
    request = ChatRequest(
        request_id=RID,
        conversation_id="c",
        model="m",
        messages=[],
        run=spec,
        sampling=SamplingParams(max_tokens=10),
    )
    run = runs.start(request)

    def answered(step_rid: str, tokens: int) -> Completion:
        return Completion(
            request_id=step_rid,
            seq=1,
            finish_reason="tool_calls",
            usage=Usage(completion_tokens=tokens),
            tool_calls=[
                MessageToolCall(id=call_id(step_rid, 0), function=FunctionCall(name="code_interpreter"))
            ],
        )

    first = answered(RID, 6)
    assert runs.on_answer(run, first) is run
    ran = ToolResult(
        request_id=RID,
        conversation_id="c",
        call_id=call_id(RID, 0),
        name="code_interpreter",
        ok=True,
        output="{}",
    )
    runs.on_result(run, ran)
    step = runs.next_step(run, [ran])
    assert step.sampling.max_tokens == 4  # 10 - 6
    second = answered(step.request_id, 4)
    assert runs.on_answer(run, second) is None  # spent: no third step
    assert spec.out_of_tokens(second, 10) and not spec.continues(1, second, 10)
    framer = ResponseFramer(RID, spec, base_response(RID, 0, "m", {}), "c")
    framer.feed([first])
    assert not framer.done
    ended = framer.feed([second])
    assert framer.done and ended[-1]["type"] == "response.incomplete"
    assert ended[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert ended[-1]["response"]["usage"]["output_tokens"] == 10


def test_results_before_or_after_the_answer_advance_the_run_once_in_call_order():
    request = ChatRequest(
        request_id=RID,
        conversation_id="c",
        model="m",
        messages=[],
        run=RunSpec(server_tools=["code_interpreter"], max_steps=4),
    )
    run = runs.start(request)
    calls = [call_id(RID, 0), call_id(RID, 1)]
    result = [
        ToolResult(
            request_id=RID,
            conversation_id="c",
            call_id=c,
            name="code_interpreter",
            ok=True,
            output=json.dumps({"stdout": str(i)}),
        )
        for i, c in enumerate(calls)
    ]
    assert runs.on_result(run, result[1])  # a result may come before the step's Completion
    assert not runs.on_result(run, result[1])  # a duplicate
    done = Completion(
        request_id=RID,
        seq=5,
        finish_reason="tool_calls",
        tool_calls=[MessageToolCall(id=c, function=FunctionCall(name="code_interpreter")) for c in calls],
    )
    assert runs.on_answer(run, done) is run and runs.ready(run) is None
    assert runs.on_result(run, result[0])
    assert [r.call_id for r in runs.ready(run)] == calls
    step = runs.next_step(run, runs.ready(run))
    assert step.request_id == step_request_id(RID, 1) and run.step == 1 and runs.ready(run) is None
    assert not runs.on_result(run, result[0])  # of a step left behind (re-read after a restart)
    tool = runs.tool_message(ToolResult(request_id=RID, call_id="x", name="n", ok=False, error="boom"))
    assert tool.role == "tool" and json.loads(tool.content) == {"error": "boom"}
    ran = ToolResult(
        request_id=RID,
        call_id="y",
        name="code_interpreter",
        ok=True,
        output=json.dumps(
            {
                "stdout": "",
                "stderr": "",
                "value": str(2**100),
                "files": [{"path": "out.csv", "bytes": 4}],
                "exit_code": 0,
            }
        ),
    )
    assert (
        runs.tool_message(ran).content == f"{2**100}\nfiles written: out.csv"
    )  # the number as text, not JSON
    quiet = msgspec.structs.replace(ran, output=json.dumps({"stdout": "", "value": None}))
    assert runs.tool_message(quiet).content == "(the code ran and printed nothing)"
    assert decode(encode(request), ChatRequest).run == request.run


def test_a_step_that_repeats_a_call_to_the_same_outcome_is_followed_by_an_answer_in_text():
    """SmolLM2 forced to `print(2**100)` called it again under `auto`, step after step, until the run
    ended incomplete: the step after a repeat with the same outcome must answer in text. A repeat
    with a new outcome (the working folder changed, a call that polls) is not circling."""
    output = OutputSpec(
        tools=[ToolSpec(function=FunctionSpec(name="code_interpreter"))], tool_choice="required"
    )
    request = ChatRequest(
        request_id=RID,
        conversation_id="c",
        model="m",
        messages=[],
        output=output,
        run=RunSpec(server_tools=["code_interpreter"], max_steps=8),
    )
    run = runs.start(request)

    def step(arguments: str, printed: str, ok: bool = True):
        rid = runs.current_step(run)
        call = MessageToolCall(
            id=call_id(rid, 0), function=FunctionCall(name="code_interpreter", arguments=arguments)
        )
        assert runs.on_answer(
            run, Completion(request_id=rid, seq=1, finish_reason="tool_calls", tool_calls=[call])
        )
        result = ToolResult(
            request_id=rid,
            conversation_id="c",
            tenant="t",
            call_id=call.id,
            name="code_interpreter",
            ok=ok,
            output=json.dumps({"stdout": printed}),
            error=None if ok else "SyntaxError",
        )
        assert runs.on_result(run, result)
        return runs.next_step(run, runs.ready(run)).output.tool_choice

    assert step('{"code": "print(2**100)"}', "1267650600228229401496703205376\n") == "auto"
    assert step('{"code": "print(len(open(\'log\').read()))"}', "3\n") == "auto"
    assert (
        step('{"code": "print(len(open(\'log\').read()))"}', "6\n") == "auto"
    )  # the same call, a new outcome
    # the first call again, spaced differently: the same call, the same outcome
    assert step('{ "code" : "print(2**100)" }', "1267650600228229401496703205376\n") == "none"
    assert step('{"code": "100 + 100 = 200"}', "", ok=False) == "auto"
    assert step('{"code": "100 + 100 = 200"}', "", ok=False) == "none"  # failed the same way again


def test_a_commentary_is_read_back_as_one_turn_with_the_calls_after_it():
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}
    later = {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{}"}
    answered = [{"type": "function_call_output", "call_id": c, "output": "sunny"} for c in ("c1", "c2")]
    said = {"role": "assistant", "content": "Let me look."}
    turns = {}
    for phase in ("commentary", "final_answer", None):
        body = ResponseCreate(
            model="m",
            input=[{"role": "user", "content": "weather?"}, {**said, "phase": phase}, call, later, *answered],
        )
        turns[phase] = [(m.role, m.content, [c.id for c in m.tool_calls]) for m in messages_of(body, "t")]
    assert turns["commentary"] == [
        ("user", "weather?", []),
        ("assistant", "Let me look.", ["c1", "c2"]),
        ("tool", "sunny", []),
        ("tool", "sunny", []),
    ]
    assert (
        turns["final_answer"]
        == turns[None]
        == [
            ("user", "weather?", []),
            ("assistant", "Let me look.", []),
            ("assistant", "", ["c1", "c2"]),
            ("tool", "sunny", []),
            ("tool", "sunny", []),
        ]
    )
    stored = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {
            "type": "message",
            "role": "assistant",
            "phase": "commentary",
            "content": [{"type": "output_text", "text": "Let me look."}],
        },
        call,
        answered[0],
    ]
    assert [len(m.tool_calls) for m in history(stored, "t")] == [0, 1, 0]  # a conversation's items alike
    with pytest.raises(ValidationError):
        ResponseCreate(model="m", input=[{"role": "user", "content": "x", "phase": "commentary"}])


def test_input_items_become_messages_and_unknown_fields_are_named():
    body = ResponseCreate(
        model="m",
        instructions="be brief",
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ],
    )
    msgs = messages_of(body, "t")
    assert [m.role for m in msgs] == ["system", "user", "assistant", "tool"]
    assert msgs[2].tool_calls[0].id == "c1" and msgs[3].content == "sunny"
    with pytest.raises(api.APIError):
        messages_of(
            ResponseCreate(
                model="m", input=[{"type": "function_call_output", "call_id": "zz", "output": "x"}]
            ),
            "t",
        )
    assert ResponseCreate(model="m", input="x", top_logprobs=2).unsupported() is None
    assert ResponseCreate(model="m", input="x", prompt={"id": "p"}).unsupported() == "prompt"
    assert ResponseCreate(model="m", input="x", conversation={"id": "conv_1"}).conversation_id == "conv_1"
    with pytest.raises(ValidationError):
        ResponseCreate(model="m", input="x", conversation={"id": "conv_1", "title": "t"})
    assert ResponseCreate(model="m", input="x", whatever=1).unsupported() == "whatever"
    with pytest.raises(ValidationError):
        ResponseCreate(model="m", input="x", tools=[{"type": "code_interpreter", "container": "cntr_1"}])
    with pytest.raises(ValidationError):
        ResponseCreate(model="m", input="x", tools=[{"type": "web_search"}])


def _events_of_a_two_step_run() -> list:
    spec = RunSpec(server_tools=["code_interpreter"], max_steps=3)
    step1 = step_request_id(RID, 1)
    cid = call_id(RID, 0)
    args = json.dumps({"code": "print(42)"})
    return spec, [
        TokenChunk(
            request_id=RID,
            seq=0,
            text="",
            tool_calls=[ToolCallDelta(index=0, id=cid, name="code_interpreter")],
        ),
        TokenChunk(request_id=RID, seq=1, text="", tool_calls=[ToolCallDelta(index=0, arguments=args)]),
        TokenChunk(
            request_id=RID, seq=1, text="", tool_calls=[ToolCallDelta(index=0, arguments=args)]
        ),  # again
        Completion(
            request_id=RID,
            seq=2,
            finish_reason="tool_calls",
            usage=Usage(prompt_tokens=10, completion_tokens=5),
            tool_calls=[
                MessageToolCall(id=cid, function=FunctionCall(name="code_interpreter", arguments=args))
            ],
        ),
        ToolResult(
            request_id=RID,
            call_id=cid,
            name="code_interpreter",
            ok=True,
            output=json.dumps({"stdout": "42\n", "stderr": "", "value": None, "files": [], "exit_code": 0}),
        ),
        TokenChunk(request_id=step1, seq=0, text="It is "),
        TokenChunk(request_id=step1, seq=1, text="42."),
        Completion(
            request_id=step1, seq=2, finish_reason="stop", usage=Usage(prompt_tokens=20, completion_tokens=3)
        ),
    ]


def test_a_runs_events_fold_into_openais_stream_events_the_same_in_any_batching():
    spec, events = _events_of_a_two_step_run()

    def fold(batches):
        framer = ResponseFramer(RID, spec, base_response(RID, 1, "m", {}), "conv")
        out = framer.start()
        for batch in batches:
            out += framer.feed(batch)
        return framer, out

    _framer, out = fold([events])
    names = [e["type"] for e in out]
    assert names == [
        "response.created",
        "response.in_progress",
        *CODE_INTERPRETER_ITEM_EVENTS,
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    final = out[-1]["response"]
    assert final["status"] == "completed" and final["usage"]["input_tokens"] == 30
    assert final["output"][0]["outputs"] == [{"type": "logs", "logs": "42\n"}]
    assert final["output"][0]["code"] == "print(42)"
    assert final["output"][1]["content"][0]["text"] == "It is 42."
    assert fold([[e] for e in events])[1] == out  # one event at a time: the same stream


def test_a_bare_expressions_value_shows_in_the_logs_after_what_the_code_printed():
    """`2**100` alone prints nothing; a notebook (which OpenAI's interpreter is) shows its value, so
    the logs do too, after the printed lines and before a failure's reason."""
    spec, events = _events_of_a_two_step_run()

    def logs(output: dict, error: str | None = None) -> str:
        events[4] = msgspec.structs.replace(
            events[4], ok=error is None, error=error, output=json.dumps(output)
        )
        framer = ResponseFramer(RID, spec, base_response(RID, 1, "m", {}), "conv")
        return (framer.start() + framer.feed(events))[-1]["response"]["output"][0]["outputs"][0]["logs"]

    big = str(2**100)
    assert logs({"stdout": "", "value": big}) == big
    assert logs({"stdout": "x", "value": "'y'"}) == "x\n'y'"
    assert logs({"stdout": "x\n", "stderr": "warn\n", "value": "3"}) == "x\nwarn\n3"
    assert (
        logs({"stdout": "42\n", "value": "42"}) == "42\n42"
    )  # `print(42); 42` shows both, as a notebook does
    assert (
        logs({"stdout": "", "value": None}, error="SyntaxError: invalid syntax")
        == "SyntaxError: invalid syntax"
    )


def test_files_the_code_wrote_are_image_outputs_and_cited_by_the_answer():
    """A code interpreter result with kept files: an image is an `image` output of the call (a URL of
    the containers API), and the message after it cites every kept file (container_file_citation)."""
    spec, events = _events_of_a_two_step_run()
    files = [
        {"path": "plot.png", "bytes": 10, "file_id": "cfile_p", "container_id": "cntr_conv", "kept": True},
        {
            "path": "data.csv",
            "bytes": 8,
            "text": "a,b\n",
            "file_id": "cfile_d",
            "container_id": "cntr_conv",
            "kept": True,
        },
        {
            "path": "huge.bin",
            "bytes": 1 << 30,
            "file_id": "cfile_h",
            "container_id": "cntr_conv",
            "kept": False,
        },
    ]
    events[4] = msgspec.structs.replace(
        events[4], meta={"container_id": "cntr_conv", "files": json.dumps(files)}
    )
    framer = ResponseFramer(RID, spec, base_response(RID, 1, "m", {}), "conv")
    out = framer.start() + framer.feed(events)
    final = out[-1]["response"]
    assert final["output"][0]["outputs"] == [
        {"type": "logs", "logs": "42\n"},
        {"type": "image", "url": "/v1/containers/cntr_conv/files/cfile_p/content"},
    ]
    text = final["output"][1]["content"][0]
    assert text["annotations"] == [
        {
            "type": "container_file_citation",
            "container_id": "cntr_conv",
            "file_id": f,
            "filename": name,
            "start_index": 9,
            "end_index": 9,
        }
        for f, name in (("cfile_p", "plot.png"), ("cfile_d", "data.csv"))
    ]
    added = [e for e in out if e["type"] == "response.output_text.annotation.added"]
    assert [e["annotation_index"] for e in added] == [0, 1]


async def test_truncation_disabled_refuses_a_whole_prompt_over_the_context_before_the_pipeline():
    from gateway import context
    from schemas import ChatMessage

    await context.check_whole("smollm2", [ChatMessage(role="user", content="word " * 100)], 256)
    with pytest.raises(api.APIError) as refused:
        await context.check_whole(
            "smollm2",
            [ChatMessage(role="user", content="word " * 9000), ChatMessage(role="user", content="hi")],
            256,
        )
    assert refused.value.status == 400 and refused.value.code == "context_length_exceeded"
    assert refused.value.param == "input"


def test_max_tool_calls_makes_one_call_a_step_and_ends_server_calls_when_spent():
    tools = [
        {"type": "code_interpreter"},
        {"type": "function", "name": "lookup", "parameters": {"type": "object"}},
    ]
    body = ResponseCreate(model="m", input="x", tools=tools, max_tool_calls=2)
    output, spec = output_and_run(body.tools, body, 8)
    assert output.parallel_tool_calls is False and spec.max_tool_calls == 2
    assert spec.output_for(1, output).tool_choice == "auto" and not spec.output_for(1, output).allowed
    spent = spec.output_for(2, output)  # two steps, two calls: only the client's function is left
    assert spent.tool_choice == "auto" and [t.function.name for t in spent.callable_tools] == ["lookup"]
    only_server = ResponseCreate(model="m", input="x", tools=tools[:1], max_tool_calls=1)
    output, spec = output_and_run(only_server.tools, only_server, 8)
    assert spec.output_for(1, output).tool_choice == "none"
    unlimited = ResponseCreate(model="m", input="x", tools=tools[:1])
    output, spec = output_and_run(unlimited.tools, unlimited, 8)
    assert output.parallel_tool_calls is True and spec.output_for(5, output).tool_choice == "auto"
    with pytest.raises(ValidationError):
        ResponseCreate(model="m", input="x", max_tool_calls=0)
