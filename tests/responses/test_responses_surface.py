"""The Responses surface as the Open Responses specification words it, against the real pipeline (the
chain both modules of this package share, tests/responses/conftest.py: processors, a SmolLM2 worker,
the tool processor, a gateway): the compaction request's fields, `previous_response_not_found`, one
not-found answer for any response id, a forced file_search's query, WebSocket mode's sessions
(continuation, a failed continuation, a reconnect, and every single-turn run reaching its terminal
event as over HTTP), and `/v1/moderations`.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx
import pytest

from tests import open_responses
from tests.gateway_support import auth_headers, new_key
from tests.kafka_support import Tap
from tests.responses.chain import MODEL
from tests.responses.test_responses import create, items, valid_event
from topics import PREPARED, TOOL_CALLS, VERDICTS

pytestmark = pytest.mark.slow
TERMINAL = ("response.completed", "response.incomplete", "response.failed", "error")


async def test_compaction_takes_prompt_cache_key_and_its_summary_run_carries_it(system):
    turns = [
        {"role": "user", "content": "My dog is called Rex."},
        {"role": "assistant", "content": "Rex is a fine name."},
        {"role": "user", "content": "He is three."},
    ]
    key = f"compact-{uuid.uuid4().hex[:8]}"
    async with (
        httpx.AsyncClient(base_url=system["url"], timeout=300, headers=auth_headers()) as http,
        Tap(PREPARED) as prepared,
    ):
        made = await http.post(
            "/v1/responses/compact",
            json={"model": MODEL, "input": turns, "prompt_cache_key": key, "service_tier": "auto"},
        )
        assert made.status_code == 200, made.text
        assert made.json()["output"][-1]["type"] == "compaction"
        await prepared.caught_up()
        # the summary run is placed by the key as a response's run is (the router's prefix placement)
        assert [e.cache_key for e, _ in prepared.events if e.cache_key == key] == [key]
        # a field of OpenAI's compaction request this server does not implement: a 400 naming it
        refused = await http.post(
            "/v1/responses/compact",
            json={"model": MODEL, "input": "x", "prompt_cache_retention": "24h"},
        )
        assert refused.status_code == 400 and "prompt_cache_retention" in refused.text, refused.text


async def test_every_include_value_of_the_specification_is_taken(client):
    """`reasoning.encrypted_content` (what clients that keep no state send with store false): the model
    writes no reasoning items, so there is nothing to include, and the response runs."""
    response = await client.responses.create(
        **create(
            input="hi",
            store=False,
            max_output_tokens=2,
            include=["reasoning.encrypted_content", "message.output_text.logprobs"],
        )
    )
    assert response.status in ("completed", "incomplete") and not items(response, "reasoning")


async def test_an_unknown_previous_response_is_previous_response_not_found_and_any_unowned_id_one_404(
    client, system
):
    mine = await client.responses.create(**create(input="hi", max_output_tokens=2))
    unstored = await client.responses.create(**create(input="hi", store=False, max_output_tokens=2))
    theirs = {"Authorization": f"Bearer {new_key('another')}"}
    async with httpx.AsyncClient(base_url=system["url"], timeout=60, headers=auth_headers()) as http:
        for previous, headers in [
            ("resp_nothing_a_gateway_made", None),  # no gateway's shape
            (mine.id, theirs),  # well formed, another tenant's
            (unstored.id, None),  # made with store false: nothing to continue over HTTP
        ]:
            answer = await http.post(
                "/v1/responses", headers=headers, json=create(input="hi", previous_response_id=previous)
            )
            assert answer.status_code == 400, answer.text
            open_responses.error(answer.json())
            assert answer.json()["error"] == {
                "message": f"Previous response with id {previous!r} not found.",
                "type": "invalid_request_error",
                "param": "previous_response_id",
                "code": "previous_response_not_found",
            }
        # GET, cancel, input_items and DELETE of an id the caller does not own: one answer, whatever its shape
        for path in ("", "/input_items", "/cancel"):
            answers = []
            for response, headers in [("resp_nothing_a_gateway_made", None), (mine.id, theirs)]:
                method = http.post if path == "/cancel" else http.get
                answer = await method(f"/v1/responses/{response}{path}", headers=headers)
                error = open_responses.error(answer.json()).model_dump()
                answers.append((answer.status_code, error["code"], error["message"].replace(response, "ID")))
            assert answers[0] == answers[1] == (404, "not_found", "No response with id 'ID'."), answers


async def test_a_forced_file_search_searches_with_the_users_input_and_includes_its_results(client):
    from tools.search.index import ChunkIndex
    from tools.search.ingest import ingest

    doc = (
        "The lighthouse on Skarv point was built in 1887 by the harbour board.\n\n"
        "The Skarv ferry carries at most forty bicycles on each crossing.\n"
    )
    store, file_id = f"vs_{uuid.uuid4().hex[:24]}", f"file-{uuid.uuid4().hex[:24]}"
    index = ChunkIndex.connect()
    try:
        await asyncio.to_thread(ingest, index, "test", store, file_id, "skarv.md", doc.encode())
    finally:
        index.close()
    question = "How many bicycles does the Skarv ferry carry?"
    async with Tap(TOOL_CALLS) as calls:
        response = await client.responses.create(
            **create(
                input=question,
                tools=[{"type": "file_search", "vector_store_ids": [store]}],
                tool_choice={"type": "file_search"},
                include=["file_search_call.results"],
            )
        )
        search = items(response, "file_search_call")[0]
        sent = [e for e, _ in calls.events if e.call_id == search.id.removeprefix("fs_")]
    # the tool was sent the user's question, never an empty query, and found the chunk that answers it
    assert json.loads(sent[0].arguments)["query"] == question
    assert search.status == "completed" and search.queries == [question], search
    assert search.results and any("forty bicycles" in r.text for r in search.results), search.results


async def _ended(conn, count: int = 1) -> list:
    """A WebSocket connection's events until `count` responses have ended (an error event ends one)."""
    events, ended = [], 0
    async for event in conn:
        events.append(event)
        if event.type != "error":
            valid_event(event.to_dict())
        else:  # WebSocket mode's own error event, as the specification has it
            open_responses.ws_error(event.to_dict())
        if event.type in TERMINAL:
            ended += 1
            if ended == count:
                return events
    raise AssertionError(f"the connection ended after {[e.type for e in events]}")


async def test_a_multi_turn_websocket_session_continues_fails_and_reconnects(client):
    async with client.responses.connect() as conn:
        await conn.response.create(**create(input="My name is Ada.", max_output_tokens=6))
        first = (await _ended(conn))[-1].response
        assert first.status in ("completed", "incomplete")
        # continuation: the next turn reads the first (over the connection, as over HTTP)
        await conn.response.create(
            **create(input="What is my name?", previous_response_id=first.id, max_output_tokens=6)
        )
        second = (await _ended(conn))[-1].response
        assert (
            second.previous_response_id == first.id and second.usage.input_tokens > first.usage.input_tokens
        )
        # a failed continuation: an error event with the specification's code; the connection goes on
        await conn.response.create(**create(input="hi", previous_response_id="resp_unknown"))
        failed = (await _ended(conn))[-1]
        assert failed.type == "error" and failed.status == 400, failed
        assert (failed.error.code, failed.error.param) == (
            "previous_response_not_found",
            "previous_response_id",
        )
        # a request refused before it runs: an error event with a code too (the specification requires one)
        await conn.send({"type": "response.create", **create(input="hi", background=True)})
        refused = (await _ended(conn))[-1]
        assert (refused.status, refused.error.param, refused.error.code) == (
            400,
            "background",
            "invalid_request_error",
        )
        # store false: continued on the connection that made it
        await conn.response.create(**create(input="I like tea.", store=False, max_output_tokens=4))
        unstored = (await _ended(conn))[-1].response
        await conn.response.create(
            **create(input="And coffee.", store=False, previous_response_id=unstored.id, max_output_tokens=4)
        )
        chained = (await _ended(conn))[-1]
        assert chained.type in ("response.completed", "response.incomplete"), chained
        assert chained.response.previous_response_id == unstored.id
    # a reconnect: stored responses continue; the store-false chain was the old connection's
    async with client.responses.connect() as conn:
        await conn.response.create(
            **create(input="Say my name.", previous_response_id=second.id, max_output_tokens=4)
        )
        resumed = (await _ended(conn))[-1]
        assert resumed.type in ("response.completed", "response.incomplete"), resumed
        await conn.response.create(**create(input="hi", previous_response_id=chained.response.id))
        lost = (await _ended(conn))[-1]
        assert lost.type == "error" and lost.error.code == "previous_response_not_found", lost


# the single-turn cases of the Open Responses compliance suite (tests/responses/test_responses.py)
COMPLIANCE = {
    "basic-response": [{"type": "message", "role": "user", "content": "Say hello in exactly 3 words."}],
    "streaming-response": [{"type": "message", "role": "user", "content": "Count from 1 to 5."}],
    "system-prompt": [
        {"type": "message", "role": "system", "content": "You are a pirate. Always respond in pirate speak."},
        {"type": "message", "role": "user", "content": "Say hello."},
    ],
}


async def test_single_turn_websocket_runs_end_as_their_http_streams_do(client, system):
    """Each single-turn case, sent as a compliance client sends it (its own connection, all at once),
    reaches the terminal event its HTTP stream reaches, with the same events in the same order."""

    async def over_http(given: list) -> list[str]:
        stream = await client.responses.create(**create(input=given, stream=True, max_output_tokens=24))
        return [e.type async for e in stream]

    async def over_ws(given: list, stream: bool) -> list[str]:
        async with client.responses.connect() as conn:  # the HTTP body as it is, `stream` included
            await conn.send(
                {"type": "response.create", **create(input=given, stream=stream, max_output_tokens=24)}
            )
            return [e.type for e in await asyncio.wait_for(_ended(conn), 240)]

    cases = list(COMPLIANCE.values())
    http = await asyncio.gather(*(over_http(given) for given in cases))
    ws = await asyncio.gather(
        *(over_ws(given, name.startswith("streaming")) for name, given in COMPLIANCE.items())
    )
    for name, sse, socket in zip(COMPLIANCE, http, ws, strict=True):
        assert sse[-1] in ("response.completed", "response.incomplete"), (name, sse)
        assert [t for t in socket if "delta" not in t] == [t for t in sse if "delta" not in t], (name, socket)


HARMFUL = "I am going to find him tonight and stab him until he stops breathing."


async def test_moderations_answer_in_openais_shape_with_the_chat_paths_verdict_through_the_log(
    client, system
):
    from openai.types import ModerationCreateResponse

    async with Tap(VERDICTS) as verdicts:
        answer = await client.moderations.create(input=["Name a colour.", HARMFUL])
        await verdicts.caught_up()
        logged = {e.request_id: e for e, _ in verdicts.events}
    ModerationCreateResponse.model_validate(answer.to_dict())  # every category OpenAI names, by its name
    calm, harmful = answer.results
    assert not calm.flagged and harmful.flagged and harmful.categories.violence, answer
    assert answer.model.startswith("tokenstream-safety:")
    assert harmful.category_applied_input_types.violence == ["text"]
    assert harmful.category_applied_input_types.violence_graphic == []  # a subcategory not judged: said so
    # the verdict is the chat path's for the same text: a moderated response's input result
    response = await client.responses.create(
        **create(input=HARMFUL, max_output_tokens=4, moderation={"model": "omni-moderation-latest"})
    )
    said = response.moderation.input
    assert said.flagged and said.category_scores == {
        c: s for c, s in harmful.category_scores.to_dict().items() if c in said.category_scores
    }
    # through the log: both verdicts are on ts.safety.verdicts, where an auditor reads them
    scores = [v.scores for v in logged.values() if v.stage == "input"]
    assert {c: round(s, 6) for c, s in said.category_scores.items()} in [
        {c: round(s, 6) for c, s in v.items()} for v in scores
    ]
    async with httpx.AsyncClient(base_url=system["url"], timeout=60, headers=auth_headers()) as http:
        for body, param in [
            ({"input": [{"type": "image_url", "image_url": {"url": "data:,"}}]}, "input[0].type"),
            ({"input": "hi", "model": "gpt-guard-9"}, "model"),
            ({"input": []}, "input"),
        ]:
            refused = await http.post("/v1/moderations", json=body)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
