"""The Responses API and the multi-step server-tool loop, against the real pipeline: gateway ->
conversation (which drives the run), safety and router processors -> a real SmolLM2 worker ->
tokens -> gateway, with a real tool processor (bubblewrap sandbox, Weaviate file search) answering
the ToolCalls on ts.tool.calls. Every answer is greedy. The code the model writes is its own, so
the tests compare what the sandbox returned with what the same code gives run here.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import uuid

import httpx
import openai
import pytest

from schemas import ToolCall, ToolResult
from schemas.ids import run_id_of, step_request_id
from tests.conftest import Roles
from tests.gateway_support import api_client, auth_headers, new_key, start_gateway
from tests.kafka_support import Tap
from tests.test_worker_kafka import wait_for_log
from tests.tool_support import sandbox_root, tools_env, wait_ready
from tokenstream.chaos.verify import drained
from topics import CONVERSATION_TURNS, TOKENS, TOOL_CALLS, TOOL_RESULTS
from topics.registry import processor_group

pytestmark = pytest.mark.slow
MODEL = f"smollm2-resp-{uuid.uuid4().hex[:6]}"
CODE = {"type": "code_interpreter", "container": {"type": "auto"}}
FORCE_CODE = {"type": "code_interpreter"}
# SmolLM2-135M copies a short expression into the call; asked to write code of its own, it rarely
# closes the string. The instructions and input below are ones it answers with a whole call.
RUN_CODE = "Run the user's Python code with code_interpreter."
PROMPT = "open('n.txt', 'w').write(str(19 + 23))"
LIST_FILES = "The code is: import os; os.listdir('.')"


@pytest.fixture(scope="module")
def system(stack, tmp_path_factory):
    """The three processors, a SmolLM2 worker under its own model name, a tool processor, a gateway."""
    from gpu_workers.model_loader import smollm2_dir
    from topics.admin import apply
    from topics.registry import all_topics

    asyncio.run(apply(all_topics([MODEL]), stack.kafka.address))
    roles = Roles(stack, tmp_path_factory.mktemp("responses"))
    env = tools_env(sandbox_root())
    try:
        for name in ("conversation", "safety", "router"):
            roles.start("processor", name, "--loglevel", "info", name=f"processor-{name}")
        tools = roles.start("tools", env=env, name="tools")
        worker = roles.start("worker", "--model", MODEL, "--model-path", str(smollm2_dir()), name="worker")
        url, _ = start_gateway(roles, [MODEL], timeout=120, env={"TOKENSTREAM_GATEWAY_RESPONSES_MAX_STEPS": "3",
                                                                 "TOKENSTREAM_GATEWAY_PROGRESS_TIMEOUT_S": "240"})
        wait_for_log(roles, worker, "worker ready", 300)
        asyncio.run(wait_ready(tools, roles.log))
        yield {"url": url, "roles": roles, "tools": tools, "env": env}
    finally:
        roles.stop_all()


@pytest.fixture
def client(system):
    return api_client(system["url"], timeout=300)


def create(**kw) -> dict:
    # max_output_tokens bounds the whole run (every step's answer together)
    return {"model": MODEL, "temperature": 0, "max_output_tokens": 160, **kw}


# The response object's fields the Open Responses specification requires (spec 2026-04-24,
# ResponseResource), with the JSON types each may take
OPEN_RESPONSES_REQUIRED = {
    "id": str, "object": str, "created_at": int, "completed_at": (int, type(None)), "status": str,
    "incomplete_details": (dict, type(None)), "model": str, "previous_response_id": (str, type(None)),
    "instructions": (str, list, type(None)), "output": list, "error": (dict, type(None)), "tools": list,
    "tool_choice": (str, dict), "truncation": str, "parallel_tool_calls": bool, "text": dict,
    "top_p": (int, float), "presence_penalty": (int, float), "frequency_penalty": (int, float),
    "top_logprobs": int, "temperature": (int, float), "reasoning": (dict, type(None)), "user": (str, type(None)),
    "usage": (dict, type(None)), "max_output_tokens": (int, type(None)), "max_tool_calls": (int, type(None)),
    "store": bool, "background": bool, "service_tier": str, "metadata": dict,
    "safety_identifier": (str, type(None)), "prompt_cache_key": (str, type(None)),
}


def conforms(response: dict) -> None:
    """The response object has every field Open Responses requires, each of its type; a completed one
    says when it completed, and every function tool says whether it is strict."""
    for name, kind in OPEN_RESPONSES_REQUIRED.items():
        assert name in response and isinstance(response[name], kind), (name, response.get(name))
    assert (response["completed_at"] is not None) == (response["status"] == "completed"), response
    if response["completed_at"] is not None:
        assert response["completed_at"] >= response["created_at"]
    assert all(isinstance(t["strict"], bool) for t in response["tools"] if t["type"] == "function")


def ran_as_here(call) -> None:
    """The sandbox's run of the call's code printed what plain Python prints for it, failed exactly
    when plain Python fails, and an expression's value is its repr (the code is the model's own)."""
    done = subprocess.run([sys.executable, "-I", "-c", call.code], capture_output=True, text=True, timeout=30,
                          cwd=tempfile.mkdtemp())
    logs, result = call.outputs[0].logs, call.model_extra["result"]
    assert logs.startswith(done.stdout), (call.code, logs, done.stdout)
    assert (result["exit_code"] == 0) == (done.returncode == 0), (call.code, result, done)
    assert call.status == ("completed" if done.returncode == 0 else "failed"), call
    try:
        expression = compile(call.code, "<code>", "eval")
    except SyntaxError:
        return
    if done.returncode == 0 and "open(" not in call.code:
        assert result["value"] == repr(eval(expression, {})), (call.code, result)  # noqa: S307 - the test's own check


def items(response, kind: str) -> list:
    return [item for item in response.output if item.type == kind]


async def test_forced_code_interpreter_runs_the_code_and_the_model_answers_after_its_output(client):
    raw = await client.responses.with_raw_response.create(**create(
        instructions=RUN_CODE, input=PROMPT, tools=[CODE], tool_choice=FORCE_CODE, safety_identifier="user-7",
        service_tier="auto", extra_body={"presence_penalty": 0.0, "frequency_penalty": 0.0}))
    response = raw.parse()
    assert response.status == "completed", (response.incomplete_details, response.usage, response.output)
    assert response.safety_identifier == "user-7" and response.service_tier == "default"
    conforms(raw.http_response.json())  # the object as sent (the SDK turns created_at into a float)
    calls = items(response, "code_interpreter_call")
    assert calls and calls[0].code.strip(), response.output
    for call in calls:  # after the forced first step the model chose; the last step answered in text
        ran_as_here(call)
    assert len(calls) <= 2 and response.output[0].type == "code_interpreter_call"
    # the step after the result answered in text: the run went on through the tool's output
    assert response.output[-1].type == "message" and response.output_text.strip()
    assert response.usage.input_tokens > 0 and response.usage.output_tokens > 0


async def test_stream_parses_with_the_sdk_helper_in_openai_order_and_resumes_from_any_event(client, system):
    async with client.responses.stream(**create(instructions=RUN_CODE, input=PROMPT, tools=[CODE],
                                                tool_choice=FORCE_CODE)) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_response()
    names = [e.type for e in events]
    assert names[:3] == ["response.created", "response.in_progress", "response.output_item.added"], names
    assert names[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    first = events[2].item.id
    order = [e.type for e in events if getattr(e, "item_id", None) == first or getattr(
        getattr(e, "item", None), "id", None) == first]
    assert order == ["response.output_item.added", "response.code_interpreter_call.in_progress",
                     "response.code_interpreter_call_code.delta", "response.code_interpreter_call_code.done",
                     "response.code_interpreter_call.interpreting", "response.code_interpreter_call.completed",
                     "response.output_item.done"], names
    assert names.index("response.code_interpreter_call.completed") < names.index("response.content_part.added")
    assert names.count("response.output_text.done") == 1 and names.count("response.content_part.done") == 1
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text and final.status == "completed"
    ran_as_here(items(final, "code_interpreter_call")[0])

    # stored: GET returns the same response; another tenant gets 404 as for an unknown id
    async with httpx.AsyncClient(base_url=system["url"], timeout=300) as http:
        got = (await http.get(f"/v1/responses/{final.id}", headers=auth_headers())).json()
        assert got["id"] == final.id and got["status"] == "completed"
        conforms(got)
        given = await client.responses.input_items.list(final.id)
        assert [(i.type, i.role, i.content[0].text) for i in given.data] == [("message", "user", PROMPT)]
        assert [o["id"] for o in got["output"]] == [i.id for i in final.output]
        assert got["output"][-1]["content"][0]["text"] == final.output_text
        other = auth_headers(new_key("someone-else"))
        assert (await http.get(f"/v1/responses/{final.id}", headers=other)).status_code == 404
        assert (await http.get(f"/v1/responses/{final.id}?stream=true", headers=other)).status_code == 404
        # resume after event k, on the log: exactly the events after k, equal to the live ones
        k = names.index("response.code_interpreter_call.interpreting")
        rid = run_id_of(final.id)
        resumed = []
        async with http.stream("GET", f"/v1/responses/{final.id}?stream=true",
                               headers={**auth_headers(), "Last-Event-ID": f"{rid}:{k}"}) as sse:
            async for line in sse.aiter_lines():
                if line.startswith("data:"):
                    resumed.append(json.loads(line[5:]))
        assert [e["sequence_number"] for e in resumed] == list(range(k + 1, len(events)))
        assert [e["type"] for e in resumed] == names[k + 1:]
        assert [e.get("delta") for e in resumed] == [getattr(e, "delta", None) for e in events[k + 1:]]


async def test_previous_response_id_continues_the_conversation_and_its_working_folder(client, system):
    from tools.sandbox import folder_name

    first = await client.responses.create(**create(instructions=RUN_CODE, input=LIST_FILES, tools=[CODE],
                                                   tool_choice=FORCE_CODE))
    assert first.status == "completed"
    before = items(first, "code_interpreter_call")[0]
    alone = await client.responses.create(**create(input="What was the result?", max_output_tokens=8))
    second = await client.responses.create(**create(input="What was the result?", previous_response_id=first.id,
                                                    max_output_tokens=8))
    assert second.previous_response_id == first.id and second.status in ("completed", "incomplete")
    # the stored conversation (question, calls, their results, answer) came before the new question
    assert second.usage.input_tokens > alone.usage.input_tokens + 20
    # the conversation's working folder: a file put there is seen by a later response's code (code
    # that writes a file is beyond this model: the tool processor's tests run code-to-code persistence)
    conversation = run_id_of(first.id)
    folder = f"{system['env']['TOKENSTREAM_TOOLS_SANDBOX_DIR']}/{folder_name('test', conversation)}"
    with open(f"{folder}/notes.txt", "w") as f:
        f.write("41")
    async with Tap(TOOL_CALLS) as calls:
        third = await client.responses.create(**create(instructions=RUN_CODE, input=LIST_FILES, tools=[CODE],
                                                       tool_choice=FORCE_CODE, previous_response_id=second.id))
        made = {e.call_id: e.conversation_id for e, _ in calls.events}
    listing = items(third, "code_interpreter_call")[0]
    assert made[listing.id.removeprefix("ci_")] == conversation and listing.container_id == before.container_id
    assert before.code == listing.code and "listdir" in listing.code, (before, listing)
    assert "notes.txt" not in before.model_extra["result"]["value"], before
    assert "notes.txt" in listing.model_extra["result"]["value"], listing
    other = openai.AsyncOpenAI(base_url=system["url"] + "/v1", api_key=new_key("another"), max_retries=0)
    with pytest.raises(openai.NotFoundError):
        await other.responses.create(**create(input="hi", previous_response_id=first.id))
    unstored = await client.responses.create(**create(input="hi", store=False, max_output_tokens=4))
    async with httpx.AsyncClient(base_url=system["url"], timeout=60, headers=auth_headers()) as http:
        assert (await http.get(f"/v1/responses/{unstored.id}")).status_code == 404
    with pytest.raises(openai.NotFoundError):
        await client.responses.create(**create(input="hi", previous_response_id=unstored.id))


async def test_an_assistant_with_knowledge_searches_its_stores_without_the_client_sending_tools(client):
    from tools.search.index import ChunkIndex
    from tools.search.ingest import ingest

    doc = ("The Harbour Street bakery opened in 1962 and was founded by Margit Olsen.\n\n"
           "The ferry to Lindholm island leaves the pier at 07:40 on weekdays.\n\n"
           "Members may borrow at most six books at a time from the town library.\n")
    file_id = f"file-{uuid.uuid4().hex[:12]}"
    index = ChunkIndex.connect()
    try:  # the store the `librarian` preset names, for the tests' tenant
        await asyncio.to_thread(ingest, index, "test", "vs_library", file_id, "town.md", doc.encode())
    finally:
        index.close()
    async with Tap(TOOL_CALLS) as calls:
        response = await client.responses.create(**create(
            input="When does the ferry to Lindholm leave?", tool_choice={"type": "file_search"},
            extra_body={"assistant": "librarian"}))
        search = items(response, "file_search_call")[0]
        sent = [e for e, _ in calls.events if e.call_id == search.id.removeprefix("fs_")]
    assert search.status == "completed" and search.queries and search.queries[0].strip(), search
    assert json.loads(sent[0].arguments)["vector_store_ids"] == ["vs_library"]  # the preset's, fixed by the grammar
    assert search.results and all(r.file_id == file_id for r in search.results)
    assert any("07:40" in r.text for r in search.results)  # three short facts: every chunk comes back
    assert response.tools[0].type == "file_search"


async def test_unsupported_fields_and_bad_tools_are_400_naming_them(system):
    async with httpx.AsyncClient(base_url=system["url"], timeout=60, headers=auth_headers()) as http:
        for body, param in [({"input": "hi", "conversation": "conv_1"}, "conversation"),
                            ({"input": "hi", "reasoning": {"effort": "low"}}, "reasoning"),
                            ({"input": "hi", "frobnicate": 1}, "frobnicate"),
                            ({"input": "hi", "service_tier": "flex"}, "service_tier"),
                            ({"input": "hi", "top_logprobs": 3}, "top_logprobs"),
                            ({"input": [{"role": "user", "content": [
                                {"type": "input_image", "image_url": "data:,"}]}]}, "input"),
                            ({"input": "hi", "tools": [{"type": "web_search"}]}, None),
                            ({"input": "hi", "tool_choice": {"type": "code_interpreter"}}, "tool_choice")]:
            answer = await http.post("/v1/responses", json={"model": MODEL, **body})
            assert answer.status_code == 400, (body, answer.text)
            error = answer.json()["error"]
            assert error["type"] == "invalid_request_error"
            if param:
                assert param in (error["param"] or "") + error["message"], error
        assert (await http.post("/v1/responses", json={"model": MODEL, "input": "hi"},
                                headers={"Authorization": "Bearer nope"})).status_code == 401
        assert (await http.get("/v1/responses/resp_nothing")).status_code == 404


async def test_a_background_response_outlives_the_gateway_that_took_it_and_can_be_cancelled(client, system):
    """Created on gateway A, which is then killed (-9); gateway B, another process that never saw the
    request, answers GET from the log while the run goes on and stores it at its end; the answer is the
    one a foreground run gives. A second background response cancelled at once ends `cancelled`, and a
    deleted response is gone."""
    roles = system["roles"]
    env = {"TOKENSTREAM_GATEWAY_RESPONSES_MAX_STEPS": "3"}
    url_a, gateway_a = start_gateway(roles, [MODEL], index=0, count=2, timeout=120, env=env)
    url_b, _ = start_gateway(roles, [MODEL], index=1, count=2, timeout=120, env=env)
    a, b = api_client(url_a, timeout=300), api_client(url_b, timeout=300)
    request = create(instructions=RUN_CODE, input=PROMPT, tools=[CODE], tool_choice=FORCE_CODE)
    created = await a.responses.create(**request, background=True)
    assert created.status == "queued" and created.background is True and not created.output
    os.kill(gateway_a.pid, signal.SIGKILL)
    seen = set()
    deadline = asyncio.get_running_loop().time() + 240
    while True:
        got = await b.responses.retrieve(created.id)
        seen.add(got.status)
        if got.status not in ("queued", "in_progress"):
            break
        assert asyncio.get_running_loop().time() < deadline, seen
        await asyncio.sleep(0.5)
    assert got.status == "completed" and got.background is True, got
    foreground = await client.responses.create(**request)
    assert [i.type for i in got.output] == [i.type for i in foreground.output]
    assert got.output_text == foreground.output_text  # greedy: the same answer
    again = await b.responses.retrieve(created.id)  # stored by B at its end
    assert again.model_dump() == got.model_dump()
    replayed = [e async for e in await b.responses.retrieve(created.id, stream=True, starting_after=1)]
    assert replayed[0].sequence_number == 2 and replayed[-1].type == "response.completed"

    doomed = await b.responses.create(**request, background=True)
    cancelled = await b.responses.cancel(doomed.id)
    assert cancelled.status == "cancelled", cancelled
    assert (await b.responses.retrieve(doomed.id)).status == "cancelled"
    async with httpx.AsyncClient(base_url=url_b, timeout=60, headers=auth_headers()) as http:
        assert (await http.post(f"/v1/responses/{foreground.id}/cancel")).status_code == 400  # not background
        deleted = await http.delete(f"/v1/responses/{doomed.id}")
        assert deleted.json() == {"id": doomed.id, "object": "response", "deleted": True}
        assert (await http.get(f"/v1/responses/{doomed.id}")).status_code == 404
        refused = await http.post("/v1/responses", json={"model": MODEL, "input": "hi", "background": True,
                                                         "store": False})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "store"


async def test_kill_9_of_the_tool_processor_mid_run_completes_the_run_each_call_once(client, system, bootstrap):
    roles, env = system["roles"], system["env"]
    async with Tap(TOOL_CALLS) as calls, Tap(TOOL_RESULTS) as results, Tap(TOKENS) as tokens:
        task = asyncio.create_task(client.responses.create(**create(
            instructions=RUN_CODE, input=PROMPT, tools=[CODE], tool_choice=FORCE_CODE)))
        deadline = asyncio.get_running_loop().time() + 240
        while not any(isinstance(e, ToolCall) for e, _ in calls.events):
            assert asyncio.get_running_loop().time() < deadline and not task.done()
            await asyncio.sleep(0.05)
        os.killpg(system["tools"].pid, signal.SIGKILL)
        system["tools"].wait()
        system["tools"] = roles.start("tools", env=env, name="tools-after-kill")
        response = await asyncio.wait_for(task, 300)
        assert response.status == "completed", response
        ran_as_here(items(response, "code_interpreter_call")[0])
        rid = run_id_of(response.id)
        steps = {step_request_id(rid, k) for k in range(3)}
        mine = {e.call_id for e, _ in calls.events if e.request_id in steps}
        assert mine

        def once(events) -> dict[str, int]:
            counts = {c: 0 for c in mine}
            for e, _ in events:
                if isinstance(e, ToolResult) and e.call_id in counts:
                    counts[e.call_id] += 1
            return counts

        while min(once(results.events).values()) == 0:  # every result published before the run went on
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.1)
        # a call run again after the restart would have its result out (and relayed) by the time the tool
        # processor, then the conversation processor, have committed past everything: then count
        for group, spec in (("tools", TOOL_CALLS), ("conversation", TOOL_RESULTS), ("conversation", CONVERSATION_TURNS)):
            lag = await drained(bootstrap, [(processor_group(group), spec.name)], timeout=60)
            assert not any(lag.values()), lag
        await results.caught_up()
        await tokens.caught_up()
        # each call: one result on ts.tool.results, one in band in the response's stream
        assert set(once(results.events).values()) == {1} and set(once(tokens.events).values()) == {1}
