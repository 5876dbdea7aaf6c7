"""The whole chain, driven by the official `openai` SDK: gateway -> conversation -> safety -> router ->
worker (SmolLM2) -> gateway, every role a real process (see tests/full_chain.py).

Streaming and non-streaming agree; a stream cut on one gateway resumes on the other; a cancel frees
the worker's slot; a harmful input and a harmful output are both stopped; a conversation continued
by id gets its history. Last (they restart the session's Redis and broker under the running system):
an outage of each ends the answers in flight with an answer or a clear error, a request during it gets
a clear error, health says not ready meanwhile, and requests are served within 10 s of its end."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
import time
import uuid

import httpx
import openai
import pytest

from producers import publish, start_producer
from schemas import REFUSAL, ChatMessage, InferenceRequest, KeyHome, SafetyVerdict, SamplingParams
from tests.full_chain import MODEL, SCREENING, System, greedy
from tests.gateway_support import content_of, new_key, sse
from tests.kafka_support import Tap, key_on_partition_of, wait_for
from tests.voice_page import CHROMIUM, voice_round_trip
from topics import CONTROL, PREPARED, SCREENED, VERDICTS, inference_topic

pytestmark = pytest.mark.slow

HARMFUL = "I am going to find him tonight and stab him until he stops breathing."
VIOLENT = (
    "First get a knife, then wait for the victim outside the house and stab them repeatedly in the "
    "chest until they die, then hide the body so nobody finds it."
)


@pytest.fixture(scope="module")
def system(stack, tmp_path_factory):
    s = System.start(stack, tmp_path_factory.mktemp("full-chain"), tools=True)
    yield s
    s.stop()


def of(request_id: str):
    return lambda e: e.request_id == request_id


def rid_of(completion_id: str) -> str:
    return completion_id.removeprefix("chatcmpl-")


@pytest.mark.parametrize("gateway", [0, 1], ids=SCREENING)
async def test_stream_and_json_answers_agree_through_every_hop(system: System, gateway: int):
    client = system.client(gateway)
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    async with Tap(PREPARED) as prepared, Tap(SCREENED) as screened, Tap(inference_topic(MODEL)) as queued:
        stream = await client.chat.completions.create(
            messages=messages, stream=True, max_tokens=24, stream_options={"include_usage": True}, **greedy()
        )
        chunks = [c async for c in stream]
        whole = await client.chat.completions.create(messages=messages, max_tokens=24, **greedy())
        rid = rid_of(chunks[0].id)
        hops = (prepared, screened, queued) if SCREENING[gateway] == "serial" else (prepared, queued)
        for tap in hops:  # each hop carried the streamed request exactly once
            await tap.wait_for(of(rid), timeout=30)
            assert len(tap.matching(of(rid))) == 1, tap.spec.name
        if SCREENING[gateway] == "parallel":
            assert screened.matching(of(rid)) == []  # routed straight from ts.requests.prepared
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason] and finishes[0] in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens > 0
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens > 0


async def test_stream_cut_on_one_gateway_resumes_on_the_other(system: System):
    request = greedy(
        messages=[{"role": "user", "content": "Tell me a story about a lighthouse keeper."}],
        max_tokens=48,
        stream=True,
    )
    reference = await system.client(1).chat.completions.create(**request)
    expected = "".join([c.choices[0].delta.content or "" async for c in reference])
    async with system.http() as http:
        first = []
        async with http.stream("POST", system.gateways[0] + "/v1/chat/completions", json=request) as r:
            assert r.status_code == 200
            async for event_id, data in sse(r):
                first.append((event_id, data))
                if sum(1 for _, d in first if content_of(d)) >= 4:
                    break  # the client drops the connection mid-answer
        cid = json.loads(first[0][1])["id"]
        async with http.stream(
            "GET",
            f"{system.gateways[1]}/v1/chat/completions/{cid}/stream",
            headers={"Last-Event-ID": first[-1][0]},
        ) as r:
            assert r.status_code == 200
            rest = [e async for e in sse(r)]
    assert rest[-1][1] == "[DONE]"
    ids = [i for i, _ in first + rest if i]
    assert len(ids) == len(set(ids)), "a frame was delivered twice"
    assert "".join(content_of(d) for _, d in first + rest) == expected


async def test_cancel_ends_the_stream_and_frees_the_worker_slot(system: System):
    request = greedy(
        messages=[{"role": "user", "content": "Write a very long essay about the sea."}],
        max_tokens=400,
        stream=True,
        stream_options={"include_usage": True},
    )
    async with (
        system.http() as http,
        http.stream("POST", system.gateways[0] + "/v1/chat/completions", json=request) as r,
    ):
        seen, cancelled = [], False
        async for _, data in sse(r):
            seen.append(data)
            if not cancelled and sum(1 for d in seen if content_of(d)) >= 3:
                cid = json.loads(data)["id"]
                answer = await http.post(f"{system.gateways[1]}/v1/chat/completions/{cid}/cancel")
                assert answer.status_code == 200 and answer.json()["cancelled"] is True
                cancelled = True
    assert seen[-1] == "[DONE]"
    usage = json.loads(seen[-2])["usage"]
    assert usage["completion_tokens"] < 400
    deadline = time.monotonic() + 20
    while await asyncio.to_thread(system.worker_gauge, "vllm:num_requests_running") != 0:
        assert time.monotonic() < deadline, "the worker kept generating a cancelled request"
        await asyncio.sleep(0.2)


@pytest.mark.parametrize("gateway", [0, 1], ids=SCREENING)
async def test_harmful_input_is_refused_and_no_generated_token_reaches_the_client(
    system: System, gateway: int
):
    async with Tap(VERDICTS) as verdicts, Tap(inference_topic(MODEL)) as queued, Tap(CONTROL) as control:
        stream = await system.client(gateway).chat.completions.create(
            messages=[{"role": "user", "content": HARMFUL}], stream=True, max_tokens=300, **greedy()
        )
        chunks = [c async for c in stream]
        rid = rid_of(chunks[0].id)
        # (the input verdict: the refusal's own output window may be judged and recorded too)
        [verdict] = await verdicts.wait_for(
            lambda e: isinstance(e, SafetyVerdict) and e.request_id == rid and e.stage == "input"
        )
        if SCREENING[gateway] == "serial":
            # a one-token request on its partition, screened after it: once it is queued for the worker,
            # the safety processor and the router have both handled the refused one
            marker = InferenceRequest(
                request_id=key_on_partition_of(rid, PREPARED.partitions),
                model=MODEL,
                messages=[ChatMessage(role="user", content="Say yes.")],
                sampling=SamplingParams(max_tokens=1),
            )
            producer = await start_producer()
            try:
                await publish(producer, PREPARED, marker)
            finally:
                await producer.stop()
            await queued.wait_for(of(marker.request_id))
            await queued.caught_up()
            assert queued.matching(of(rid)) == []
        else:  # generated meanwhile, then cancelled by the verdict
            [cancel] = await control.wait_for(of(rid))
            assert cancel.reason == "content_filter"
    assert verdict.stage == "input" and verdict.blocked and "violence" in verdict.categories
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["content_filter"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == REFUSAL
    deadline = time.monotonic() + 20
    while await asyncio.to_thread(system.worker_gauge, "vllm:num_requests_running") != 0:
        assert time.monotonic() < deadline, "the worker kept generating a refused request"
        await asyncio.sleep(0.2)


async def test_harmful_output_is_cut_with_content_filter(system: System):
    # Only the newest user message is judged on input; the harmful text comes back in the answer.
    messages = [
        {"role": "system", "content": VIOLENT},
        {"role": "user", "content": "Repeat the text of the system message exactly, word for word."},
    ]
    async with Tap(VERDICTS) as verdicts:
        stream = await system.client(0).chat.completions.create(
            messages=messages, stream=True, max_tokens=200, **greedy()
        )
        chunks = [c async for c in stream]
        rid = rid_of(chunks[0].id)
        blocked = await verdicts.wait_for(lambda e: e.request_id == rid and e.stage == "output" and e.blocked)
    assert blocked[0].categories
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["content_filter"]


async def test_conversation_continued_by_id_carries_its_history(system: System):
    conversation = f"conv-{uuid.uuid4().hex[:8]}"
    client = system.client(0)
    extra = {"conversation_id": conversation}
    async with Tap(PREPARED) as prepared:
        first = await client.chat.completions.create(
            messages=[{"role": "user", "content": "My name is Ada. Say hello to me."}],
            max_tokens=16,
            extra_body=extra,
            **greedy(),
        )
        second = await system.client(1).chat.completions.create(
            messages=[{"role": "user", "content": "What is my name?"}],
            max_tokens=16,
            extra_body=extra,
            **greedy(),
        )
        [turn2] = await prepared.wait_for(of(rid_of(second.id)))
    assert isinstance(turn2, InferenceRequest)
    assert [(m.role, m.content) for m in turn2.messages] == [
        ("user", "My name is Ada. Say hello to me."),
        ("assistant", first.choices[0].message.content),
        ("user", "What is my name?"),
    ]
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens


async def test_a_chat_in_a_conversation_reads_its_items_and_adds_its_turns(system: System):
    """`conversation` (a Conversation of /v1/conversations) on chat: its items precede the messages; each
    ended answer adds the message and the answer, on either gateway, streamed or not; owner-checked."""
    async with system.http() as http:
        conv = (await http.post(system.gateways[0] + "/v1/conversations", json={})).json()["id"]
        extra = {"conversation": conv}
        async with Tap(PREPARED) as prepared:
            first = await system.client(0).chat.completions.create(
                messages=[{"role": "user", "content": "My name is Ada. Say hello to me."}],
                max_tokens=16,
                extra_body=extra,
                **greedy(),
            )
            stream = await system.client(1).chat.completions.create(
                messages=[{"role": "user", "content": "What is my name?"}],
                max_tokens=16,
                stream=True,
                extra_body={"conversation": {"id": conv}},
                **greedy(),
            )
            chunks = [c async for c in stream]
            [turn2] = await prepared.wait_for(of(rid_of(chunks[0].id)))
        items = (
            await http.get(f"{system.gateways[1]}/v1/conversations/{conv}/items", params={"order": "asc"})
        ).json()["data"]
        both = await http.post(
            system.gateways[0] + "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "conversation": conv,
                "conversation_id": "c-1",
            },
        )
        other = await http.post(
            system.gateways[0] + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "conversation": conv},
            headers={"Authorization": f"Bearer {new_key('another')}"},
        )
    answer = first.choices[0].message.content
    said = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [(m.role, m.content) for m in turn2.messages] == [
        ("user", "My name is Ada. Say hello to me."),
        ("assistant", answer),
        ("user", "What is my name?"),
    ]
    assert [(i["role"], i["content"][0]["text"]) for i in items] == [
        ("user", "My name is Ada. Say hello to me."),
        ("assistant", answer),
        ("user", "What is my name?"),
        ("assistant", said),
    ]
    assert both.status_code == 400 and both.json()["error"]["param"] == "conversation_id"
    assert other.status_code == 404 and other.json()["error"]["param"] == "conversation"


# Every documented field of POST /v1/chat/completions beyond those the tests above send, each with a value
# that asks for something: the honoured ones change the answer as documented, the others are a 400 naming
# them.
REFUSED_FIELDS = {
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "high",
    "verbosity": "low",
    "web_search_options": {},
    "functions": [{"name": "f", "parameters": {"type": "object"}}],
    "function_call": "auto",
    "metadata": {"k": "v"},
    "service_tier": "flex",  # metadata without store
    "n": 2,
    "not_a_field": 1,
}


@pytest.mark.parametrize(
    "stream",
    [False, pytest.param(True, marks=pytest.mark.heavy)],  # streamed: 13 s, make test-all
    ids=["json", "stream"],
)
async def test_every_documented_chat_field_is_honoured_or_refused(system: System, stream: bool):
    from common.models import load_tokenizer

    http = system.http()
    url = system.gateways[0] + "/v1/chat/completions"
    ask = [{"role": "user", "content": "Write a short poem about the sea."}]

    async def answer(**fields) -> tuple[str, list[dict], dict]:
        """(text, logprobs content, usage) of one greedy answer."""
        body = {
            "model": MODEL,
            "messages": ask,
            "temperature": 0,
            "max_completion_tokens": 24,
            "stream": stream,
            **({"stream_options": {"include_usage": True, "include_obfuscation": False}} if stream else {}),
            **fields,
        }
        got = await http.post(url, json=body)
        assert got.status_code == 200, got.text
        if not stream:
            choice = got.json()["choices"][0]
            return (
                choice["message"]["content"],
                (choice["logprobs"] or {}).get("content"),
                got.json()["usage"],
            )
        data = [line[len("data: ") :] for line in got.text.splitlines() if line.startswith("data: ")]
        frames = [json.loads(f) for f in data if f != "[DONE]"]
        text = "".join(f["choices"][0]["delta"].get("content") or "" for f in frames if f["choices"])
        reported = [
            e
            for f in frames
            if f["choices"] and f["choices"][0]["logprobs"]
            for e in f["choices"][0]["logprobs"]["content"]
        ]
        return text, reported if fields.get("logprobs") else None, frames[-1]["usage"]

    for name, value in REFUSED_FIELDS.items():
        refused = await http.post(url, json={"model": MODEL, "messages": ask, "stream": stream, name: value})
        assert refused.status_code == 400, (name, refused.text)
        assert refused.json()["error"]["param"] == name, refused.json()
    for bad, param in (
        (
            ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}),
            "messages[0].content[0].type",
        ),
        ({"role": "assistant", "content": "x", "refusal": "no"}, "messages[0].refusal"),
    ):
        refused = await http.post(url, json={"model": MODEL, "messages": [bad, *ask], "stream": stream})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
    refused = await http.post(url, json={"model": MODEL, "messages": ask, "top_logprobs": 2})
    assert refused.status_code == 400 and "logprobs" in refused.json()["error"]["message"]

    # neutral values pass, and the logprobs reported are the greedy answer's own
    plain, _, _ = await answer(
        store=False,
        metadata={},
        modalities=["text"],
        service_tier="auto",
        n=1,
        seed=7,
        user="u-1",
        safety_identifier="s-1",
        stop=["\n\n\n"],
        presence_penalty=0,
        frequency_penalty=0,
        logit_bias={},
    )
    text, reported, usage = await answer(logprobs=True, top_logprobs=3)
    assert text == plain and reported
    assert b"".join(bytes(e["bytes"]) for e in reported).decode("utf-8", "replace").startswith(text)
    assert len(reported) <= usage["completion_tokens"]
    for e in reported:  # greedy: the chosen token is the most likely one, and the three are in order
        assert e["top_logprobs"][0]["token"] == e["token"] and len(e["top_logprobs"]) == 3
        assert e["logprob"] == e["top_logprobs"][0]["logprob"] <= 0
        assert [t["logprob"] for t in e["top_logprobs"]] == sorted(
            (t["logprob"] for t in e["top_logprobs"]), reverse=True
        )
    # a bias of +100 on one token makes the answer that token alone
    tokenizer = load_tokenizer(MODEL)
    [wave] = tokenizer.encode(" wave", add_special_tokens=False)
    biased, _, usage = await answer(logit_bias={str(wave): 100})
    assert biased == " wave" * usage["completion_tokens"]
    # penalties: the unpenalised greedy answer repeats a token; the penalised one is another answer
    ids = tokenizer.encode(plain, add_special_tokens=False)
    assert len(set(ids)) < len(ids)
    penalised, _, _ = await answer(presence_penalty=2, frequency_penalty=2)
    assert penalised != plain
    repeated = max(ids.count(t) for t in set(ids))
    again = tokenizer.encode(penalised, add_special_tokens=False)
    assert max(again.count(t) for t in set(again)) <= repeated
    await stored_completions_are_kept_for_their_owner(system, http, url, ask, plain, stream)
    await a_prompt_cache_key_puts_its_requests_on_one_partition(http, url, stream)
    await http.aclose()


async def a_prompt_cache_key_puts_its_requests_on_one_partition(http, url: str, stream: bool) -> None:
    """prompt_cache_key: different first turns that share it reach the model's inference topic on the
    partition the router names for the tenant's key, so one worker's prefix cache serves them all."""
    from processors.router.prefixes import Placement, by_cache_key

    key = f"kb-{uuid.uuid4().hex[:8]}"
    questions = ["Name a colour.", "Name a fruit.", "Name a city."]
    async with Tap(inference_topic(MODEL)) as queued:
        for question in questions:
            got = await http.post(
                url,
                json={
                    "model": MODEL,
                    "messages": [{"role": "user", "content": question}],
                    "max_completion_tokens": 4,
                    "stream": stream,
                    "prompt_cache_key": key,
                },
            )
            assert got.status_code == 200, got.text
        placed = await queued.wait_for(
            lambda e: isinstance(e, InferenceRequest) and e.cache_key == key, count=len(questions)
        )
    assert len(placed) == len(questions)
    named = {
        by_cache_key(Placement(None, "first-turn"), e, e.model, inference_topic(MODEL).partitions).partition
        for e in placed
    }
    landed = {p for e, p in queued.events if isinstance(e, InferenceRequest) and e.cache_key == key}
    assert len(named) == 1 and landed == named, (landed, named)


async def stored_completions_are_kept_for_their_owner(
    system: System, http, url: str, ask: list[dict], plain: str, stream: bool
) -> None:
    """store + metadata: the ended answer is listed, read, re-labelled and deleted by its owner only."""
    label = {"run": uuid.uuid4().hex[:8]}
    got = await http.post(
        url,
        json={
            "model": MODEL,
            "messages": ask,
            "temperature": 0,
            "max_completion_tokens": 24,
            "stream": stream,
            "store": True,
            "metadata": label,
        },
    )
    assert got.status_code == 200, got.text
    first = next(line for line in got.text.splitlines() if line.startswith("data: ")) if stream else None
    cid = (json.loads(first[len("data: ") :]) if stream else got.json())["id"]
    base = url + "/" + cid

    async def stored():  # kept once the answer has ended
        answer = await http.get(base)
        return answer if answer.status_code == 200 else None

    kept = await wait_for(stored, 10, "the stored completion")
    assert kept.json()["choices"][0]["message"]["content"] == plain and kept.json()["metadata"] == label
    listed = await http.get(url, params={"model": MODEL, "metadata[run]": label["run"]})
    assert [c["id"] for c in listed.json()["data"]] == [cid]
    asked = await http.get(base + "/messages")
    assert [(m["role"], m["content"]) for m in asked.json()["data"]] == [("user", ask[0]["content"])]
    relabelled = await http.post(base, json={"metadata": {"run": "done"}})
    assert relabelled.json()["metadata"] == {"run": "done"}
    assert (await http.get(url, params={"metadata[run]": label["run"]})).json()["data"] == []
    other = {"Authorization": f"Bearer {new_key('another')}"}
    assert (await http.get(base, headers=other)).status_code == 404
    assert (await http.delete(base, headers=other)).status_code == 404
    assert (await http.delete(base)).json()["deleted"] is True
    assert (await http.get(base)).status_code == 404


async def test_input_tokens_counts_what_the_model_reads(system: System):
    """`POST /v1/responses/input_tokens` counts the prompt the worker will build (instructions, input, and
    the tools written into it): the same count the answer's usage reports as input_tokens."""
    from common.models import load_tokenizer
    from schemas import ChatMessage, OutputSpec
    from schemas.prompt import prompt_ids

    url = system.gateways[0] + "/v1/responses/input_tokens"
    tool = {
        "type": "function",
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
    async with system.http() as http:
        plain = (
            await http.post(url, json={"model": MODEL, "input": "Say hello.", "instructions": "Be brief."})
        ).json()
        tools = (
            await http.post(
                url,
                json={"model": MODEL, "input": "Say hello.", "instructions": "Be brief.", "tools": [tool]},
            )
        ).json()
        refused = await http.post(url, json={"model": MODEL, "input": "x", "previous_response_id": "resp_1"})
        answered = await http.post(
            system.gateways[0] + "/v1/responses",
            json={
                "model": MODEL,
                "input": "Say hello.",
                "instructions": "Be brief.",
                "max_output_tokens": 4,
                "temperature": 0,
            },
        )
    expected = prompt_ids(
        load_tokenizer(MODEL),
        [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Say hello.")],
        OutputSpec(),
    )
    assert plain == {"object": "response.input_tokens", "input_tokens": len(expected)}
    assert tools["input_tokens"] > plain["input_tokens"] + 20  # the tool's schema is in the prompt
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "previous_response_id"
    assert answered.json()["usage"]["input_tokens"] == plain["input_tokens"]


@pytest.mark.heavy  # about 70 s of a headless browser speaking and listening: make test-all (make test keeps
# speech through the log, tests/test_speech.py)
@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian's chromium is not installed")
async def test_the_chat_page_voice_mode_hears_the_question_and_speaks_the_answer_as_it_streams(
    system: System, tmp_path
):
    await voice_round_trip(system.gateways[0], tmp_path, interrupt=False)


@pytest.mark.heavy  # the round trip above again, then stop pressed mid-answer (about 25 s)
async def test_the_chat_page_voice_mode_stop_silences_the_answer_being_spoken(system: System, tmp_path):
    await voice_round_trip(system.gateways[0], tmp_path, interrupt=True)


async def _stored(http: httpx.AsyncClient, completion_id: str) -> httpx.Response | None:
    kept = await http.get(f"/v1/chat/completions/{completion_id}")
    return kept if kept.status_code != 404 else None


async def test_erasing_a_tenant_leaves_nothing_of_its_content_readable_anywhere(
    system: System, stack, unique
):
    """Crypto-shredding through the whole chain: a tenant's question and answer cross every role sealed
    (the broker's segments hold the request's id, never its words); `tokenstream erase` destroys its
    keys, after which the audit shows its records as erased and no file or record of the broker,
    either Redis or Weaviate holds its words or its keys."""
    import redis

    from schemas import keys as K
    from tests.erasure_support import found_in_files, found_in_redis, found_in_segments
    from tests.gateway_support import auth_headers

    tenant, marker = f"erase-{unique}", f"quokka{unique}"
    async with httpx.AsyncClient(
        base_url=system.gateways[1], timeout=180, headers=auth_headers(new_key(tenant))
    ) as http:
        r = await http.post(
            "/v1/chat/completions",
            json=greedy(
                messages=[{"role": "user", "content": f"My locker code is {marker}. Repeat the code."}],
                max_tokens=24,
                store=True,
            ),
        )
        assert r.status_code == 200, r.text
        # stored, with its messages: kept once the answer has ended (settled after the response went out)
        kept = await wait_for(lambda: _stored(http, r.json()["id"]), 10, "the stored completion")
        conversation = await http.post(
            "/v1/conversations",
            json={"items": [{"type": "message", "role": "user", "content": f"Remember {marker}."}]},
        )
        assert kept.status_code == 200 and conversation.status_code == 200, (kept.text, conversation.text)
    rid, answer = rid_of(r.json()["id"]), r.json()["choices"][0]["message"]["content"]
    words = {marker.encode()} | ({answer.strip().encode()} if len(answer.strip()) >= 12 else set())
    durable = redis.Redis.from_url(stack.redis.address)
    # the stored completion and the conversation's item are in the durable store, sealed like the events
    assert durable.exists(K.conversation_items(conversation.json()["id"])) and durable.exists(
        K.stored_chat(rid)
    )
    assert not await asyncio.to_thread(found_in_redis, stack.redis.address, words)
    key_ids = {k.decode() for k in durable.smembers(f"ts:seal:tenant:{tenant}")}
    assert key_ids, "the tenant's content was sealed with no key of its own"
    segments = stack.kafka.data_dir / "log"
    found = await asyncio.to_thread(found_in_segments, segments, words | {rid.encode()})
    assert rid.encode() in found and not found & words, "the broker's log holds the tenant's words in clear"
    held = {f"ts:seal:key:{k}".encode() for k in key_ids}  # each key's hash (its material with it)
    await wait_for(
        lambda: found_in_files(stack.redis.data_dir, held) == held,
        timeout=10,  # (fsync: every second)
        what="the keys in the durable store's append-only file",
    )  # so that the check after can fail

    erase = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tokenstream.cli",
        "erase",
        "--tenant",
        tenant,
        "--yes",
        env={**os.environ, **stack.environment()},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out = (await erase.communicate())[0].decode()
    assert erase.returncode == 0 and "sealing keys destroyed" in out, out
    assert not durable.smembers(f"ts:seal:tenant:{tenant}")

    audit = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tokenstream.cli",
        "audit",
        "request",
        rid,
        env={**os.environ, **stack.environment(), "COLUMNS": "200"},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    report = (await audit.communicate())[0].decode()
    assert "(content erased)" in report and "gap check: erased" in report and marker not in report, report
    assert not await asyncio.to_thread(found_in_redis, stack.redis.address, words | held)
    assert not await asyncio.to_thread(found_in_redis, stack.cache.address, words)
    assert not await asyncio.to_thread(found_in_files, stack.redis.data_dir, words | held)
    assert not await asyncio.to_thread(found_in_files, stack.weaviate.data_dir, words)
    assert not await asyncio.to_thread(found_in_segments, segments, words)
    durable.close()
    # another tenant's conversations go on as before
    again = await system.client(1).chat.completions.create(
        messages=[{"role": "user", "content": "Say hello."}], max_tokens=4, **greedy()
    )
    assert again.choices[0].message.content


@pytest.mark.heavy  # a second cluster, about 40 s: make test-all; make test keeps tests/test_regions.py
async def test_a_key_at_home_in_eu_is_served_by_eu_through_the_us_gateway_and_nothing_of_it_lands_in_us(
    system: System, stack, tmp_path
):
    """Residency: the session's stack is region eu, a second cluster region us (tests/regions_support.py). A
    key made in eu is served through us's gateway by eu's pipeline, and nothing of its tenant reaches us's
    cluster or stores (nor eu's broker passwords: MirrorMaker's connector configs there hold placeholders),
    while eu's cluster does hold it (the scan's positive control)."""
    from tests.regions_support import files_holding, records_on, topics_holding, two_regions
    from tokenstream.stack.stack import used
    from topics import CHAT_REQUESTS, KEY_HOMES

    tenant, marker = f"eu-tenant-{uuid.uuid4().hex[:8]}", f"zebra{uuid.uuid4().hex[:8]}"
    key = new_key(tenant, tier="paid")
    async with two_regions(stack, system.roles, tmp_path, MODEL) as regions:
        async with httpx.AsyncClient(timeout=30, headers={"Authorization": f"Bearer {key}"}) as http:
            seen = await wait_for(
                lambda: _served_from(http, regions.us_gateway), 60, "the key's home known in us"
            )
        assert seen == "eu"  # us's gateway learnt the key's home from eu, through MirrorMaker
        question = [{"role": "user", "content": f"Repeat this word: {marker}"}]
        via_us = openai.AsyncOpenAI(base_url=regions.us_gateway + "/v1", api_key=key, timeout=120)
        stream = await via_us.chat.completions.create(
            messages=question, stream=True, max_tokens=12, **greedy()
        )
        streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        via_eu = openai.AsyncOpenAI(base_url=regions.eu_gateway + "/v1", api_key=key, timeout=120)
        direct = await via_eu.chat.completions.create(messages=question, max_tokens=12, **greedy())
        assert streamed and streamed == direct.choices[0].message.content

        written = await records_on(regions.us.kafka)
        assert set(written) <= {KEY_HOMES.name}, written  # no request, token or tool event of anyone in us
        needles = [
            tenant.encode(),
            marker.encode(),
            *(stack.kafka.secret(u).encode() for u in ("admin", "mirror")),
        ]
        digest = hashlib.sha256(key.encode()).hexdigest().encode()  # what alone may cross: the key's home
        in_us = await topics_holding(regions.us.kafka, [*needles, digest])  # every record, decompressed
        assert in_us.pop(digest) == {"eu." + KEY_HOMES.name}  # (the scan finds what is there)
        assert not any(in_us.values()), in_us
        for needle in needles:  # and the raw bytes of us's log segments and Redis files
            assert not files_holding(regions.us.redis.data_dir, needle), needle
            assert not files_holding(regions.us.kafka.data_dir, needle, ".log"), needle
        assert files_holding(
            regions.us.kafka.data_dir, digest, ".log"
        )  # (MirrorMaker's copy is not compressed)
        in_eu = await topics_holding(stack.kafka, needles[:1], [CHAT_REQUESTS.name])  # (the scan's control)
        assert in_eu[needles[0]] == {CHAT_REQUESTS.name}

        # a key whose home has no gateway here: 421 naming it, never served locally
        with used({"TOKENSTREAM_REGION": "ap"}):  # made in a region this deployment has no gateway of
            stray = new_key(f"ap-tenant-{uuid.uuid4().hex[:8]}")
        producer = await start_producer(stack.kafka.address)
        try:
            digest = hashlib.sha256(stray.encode()).hexdigest()
            await publish(
                producer,
                KEY_HOMES,
                KeyHome(request_id=f"key-{digest[:16]}", digest=digest, region="ap"),
                key=digest,
            )
        finally:
            await producer.stop()
        async with httpx.AsyncClient(timeout=30, headers={"Authorization": f"Bearer {stray}"}) as http:
            refused = await wait_for(
                lambda: _refused(http, regions.eu_gateway), 30, "a 421 for a key of region ap"
            )
        assert refused["error"]["code"] == "wrong_region" and "region ap" in refused["error"]["message"]


async def _served_from(http: httpx.AsyncClient, gateway: str) -> str | None:
    response = await http.get(gateway + "/v1/models")
    return response.headers.get("x-tokenstream-region") if response.status_code == 200 else None


async def _refused(http: httpx.AsyncClient, gateway: str) -> dict | None:
    response = await http.get(gateway + "/v1/models")
    return response.json() if response.status_code == 421 else None


# ---------------------------------------------------------------- outages under the running system

SERVED_WITHIN_S = 10.0  # after an outage ends, a request is answered within this long


async def readiness(url: str) -> tuple[int, dict]:
    answer = await asyncio.to_thread(httpx.get, url + "/health/ready", timeout=5)
    return answer.status_code, answer.json()


async def until_ready(url: str, want: bool, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        status, body = await readiness(url)
        if (status == 200) == want:
            return body
        assert time.monotonic() < deadline, f"ready stayed {not want}: {body}"
        await asyncio.sleep(0.2)


async def in_flight(system: System) -> asyncio.Task:
    """A streamed answer that has begun, read on to its end by a task whose result is `ending`."""
    stream = await system.client(0).chat.completions.create(
        messages=[{"role": "user", "content": "Write a long story about a sailor and the sea."}],
        stream=True,
        max_tokens=120,
        **greedy(),
    )
    first = await anext(stream)
    assert first.choices
    return asyncio.create_task(ending(stream))


async def ending(stream) -> str:
    """How a stream ended: its finish reason, or the error it ended with (never a hang)."""

    async def rest() -> str:
        try:
            finishes = [
                c.choices[0].finish_reason async for c in stream if c.choices and c.choices[0].finish_reason
            ]
            return finishes[-1] if finishes else "no finish"
        except openai.APIError as exc:
            return f"error: {exc.message}"

    return await asyncio.wait_for(rest(), timeout=120)


async def served_after(system: System, back: float) -> float:
    """Seconds from `back` (monotonic) to the first answer in full, retrying what fails at once."""
    tries = []
    while True:
        try:
            done = await system.client(1, timeout=SERVED_WITHIN_S).chat.completions.create(
                messages=[{"role": "user", "content": "Say hello."}], max_tokens=4, **greedy()
            )
            if done.choices[0].finish_reason in ("stop", "length"):
                return time.monotonic() - back
            tries.append(f"+{time.monotonic() - back:.1f}s {done.choices[0].finish_reason}")
        except (openai.APIError, httpx.HTTPError) as exc:
            tries.append(f"+{time.monotonic() - back:.1f}s {type(exc).__name__}: {str(exc)[:120]}")
        assert time.monotonic() - back < SERVED_WITHIN_S + 20, (
            f"no request served 30 s after the outage's end: {tries}"
        )
        await asyncio.sleep(0.3)


async def baseline(system: System) -> float:
    """Seconds a request like `served_after`'s takes on this machine now, before any outage."""
    started = time.monotonic()
    await system.client(1).chat.completions.create(
        messages=[{"role": "user", "content": "Say hello."}], max_tokens=4, **greedy()
    )
    return time.monotonic() - started


async def test_redis_outage_under_the_running_system(system: System, stack):
    normal = await baseline(system)
    answer = await in_flight(system)
    client = system.client(1)  # (its key is looked up now, while Redis answers)
    await asyncio.to_thread(stack.redis.stop, lambda _m: None)
    try:
        down = await until_ready(system.gateways[0], False, timeout=10)  # no key can be checked: not ready
        assert down["redis"] is False, down
        with pytest.raises(openai.APIStatusError) as during:  # refused at once with a clear 503
            await asyncio.wait_for(
                client.chat.completions.create(
                    messages=[{"role": "user", "content": "Hi"}], max_tokens=4, **greedy()
                ),
                timeout=15,
            )
        assert during.value.status_code == 503 and "Redis" in during.value.message
        await asyncio.sleep(3.0)  # the outage lasts a while (what is tested: riding it out)
    finally:
        await asyncio.to_thread(stack.redis.start, lambda _m: None)
    back = time.monotonic()
    took = await served_after(system, back)  # (its client makes the tests' key again: Redis kept nothing)
    assert took < SERVED_WITHIN_S, (took, normal)
    await until_ready(system.gateways[0], True, timeout=10)
    assert await answer in ("stop", "length")  # its tokens never needed Redis


@pytest.mark.heavy  # a drill (tens of seconds): `make test-all`
async def test_broker_restart_under_the_running_system(system: System, stack):
    normal = await baseline(system)
    answer = await in_flight(system)
    client = system.client(1)
    await asyncio.to_thread(stack.kafka.stop, lambda _m: None)
    try:
        down = await until_ready(system.gateways[0], False, timeout=30)
        assert down["broker"] is False, down
        with pytest.raises(openai.APIStatusError) as during:
            await asyncio.wait_for(
                client.chat.completions.create(
                    messages=[{"role": "user", "content": "Hi"}], max_tokens=4, **greedy()
                ),
                timeout=30,
            )
        assert during.value.status_code == 503
    finally:
        await asyncio.to_thread(stack.kafka.start, lambda _m: None)
    back = time.monotonic()
    took = await served_after(system, back)
    assert took < SERVED_WITHIN_S, (took, normal)
    await until_ready(system.gateways[0], True, timeout=30)
    end = await answer
    assert end in ("stop", "length") or end.startswith("error: "), end


@pytest.mark.heavy  # a drill (tens of seconds): `make test-all`
async def test_weaviate_outage_under_the_running_system(system: System, stack):
    """Weaviate stopped under the running system with a tool processor: chat is answered (the semantic
    cache misses at once), a vector store search gets a clear 503, a file added meanwhile is held, the
    gateway and tool processor say `degraded` while staying ready; within 10 s of Weaviate's return the
    cached answer, the search and the held file are all back."""
    from tests.gateway_support import new_key
    from tests.test_file_search import FACTS, document

    tools, tools_ready = system.procs["tools"], system.tools_health
    began = time.monotonic()

    def phase(name: str) -> None:
        print(f"{name}: +{time.monotonic() - began:.1f} s")

    key = new_key(f"vec-{uuid.uuid4().hex[:6]}", semantic_cache=True, exact_cache=False)
    client = openai.AsyncOpenAI(base_url=system.gateways[0] + "/v1", api_key=key, max_retries=0, timeout=120)
    question, near = "What is the capital of France?", "What is the capital city of France?"

    async def ask(text: str) -> tuple[str, str]:
        raw = await client.chat.completions.with_raw_response.create(
            messages=[{"role": "user", "content": text}], max_tokens=8, **greedy()
        )
        done = raw.parse()
        assert done.choices[0].finish_reason in ("stop", "length"), done
        return raw.headers.get("x-tokenstream-cache", ""), done.choices[0].message.content

    async def until_hit(timeout: float) -> float:
        started = time.monotonic()
        while (await ask(near))[0] != "semantic-hit":
            assert time.monotonic() - started < timeout, "the near duplicate never hit"
            await asyncio.sleep(0.3)
        return time.monotonic() - started

    _fact, query, expected = FACTS[0]

    async def search() -> list:
        return (await client.vector_stores.search(store.id, query=query, max_num_results=3)).data

    async def cached() -> float:
        assert (await ask(question))[0] == "miss"  # answered live, then stored
        phase("a first semantic-cache request answered (the gateway's embedder loaded)")
        await until_hit(timeout=30)
        phase("a near duplicate hit")
        started = time.monotonic()
        assert (await ask("Name a colour of the grass."))[0] == "miss"
        return time.monotonic() - started  # a live answer, before the outage

    async def indexed() -> None:
        deadline = time.monotonic() + 120
        while True:  # (its health server answers once the process has imported its modules)
            try:
                await until_ready(tools_ready, True, timeout=120)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline and tools.poll() is None, system.roles.log(tools)[-3000:]
                await asyncio.sleep(0.5)
        phase("the tool processor ready")
        while (await client.vector_stores.retrieve(store.id)).status != "completed":
            assert time.monotonic() < deadline and tools.poll() is None, system.roles.log(tools)[-3000:]
            await asyncio.sleep(0.3)
        phase("the store indexed")
        assert any(expected in hit.content[0].text for hit in await search())

    uploaded = await client.files.create(
        file=("nordvik.md", document().encode(), "text/markdown"), purpose="assistants"
    )
    store = await client.vector_stores.create(name="nordvik", file_ids=[uploaded.id])
    normal, _ = await asyncio.gather(cached(), indexed())
    phase("indexed, cached, searched")

    await asyncio.to_thread(stack.weaviate.stop, lambda _m: None)
    phase("weaviate stopped")
    try:
        # ready, and degraded: serving all that does not need Weaviate
        deadline = time.monotonic() + 10
        while (body := await until_ready(system.gateways[0], True, timeout=10))["weaviate"]:
            assert time.monotonic() < deadline, body
            await asyncio.sleep(0.2)
        assert body["degraded"] and "weaviate" in body["degraded"][0], body
        tools_body = await until_ready(tools_ready, True, timeout=10)
        assert tools_body["checks"]["weaviate"] is False and "weaviate" in tools_body["degraded"][0], (
            tools_body
        )

        async def chat() -> None:  # the cached question is answered live now (a miss at once), a new one too
            started = time.monotonic()
            assert (await ask(near))[0] == "miss"
            assert (await ask("Name a colour of the sky."))[0] == "miss"
            took = (time.monotonic() - started) / 2
            assert took < normal + 10, (took, normal)  # no lookup waited on the missing Weaviate

        async def refused() -> None:  # a clear 503 saying why, quickly (the tool's own timeout is 5 s)
            started = time.monotonic()
            with pytest.raises(openai.APIStatusError) as caught:
                await search()
            assert time.monotonic() - started < 10
            assert caught.value.status_code == 503 and "Weaviate" in caught.value.message, (
                caught.value.message
            )

        async def held_file():  # a file added now: held (in progress) while the tool processor says so
            held = await client.files.create(
                file=("ferry.md", b"The Lindholm ferry horn is tuned to B flat.\n", "text/markdown"),
                purpose="assistants",
            )
            await client.vector_stores.files.create(vector_store_id=store.id, file_id=held.id)
            body, deadline = tools_body, time.monotonic() + 20
            while not any(d.startswith("ingestion: an event held") for d in body["degraded"]):
                assert time.monotonic() < deadline, body
                await asyncio.sleep(0.3)
                body = await until_ready(tools_ready, True, timeout=10)
            assert (
                await client.vector_stores.files.retrieve(held.id, vector_store_id=store.id)
            ).status == "in_progress"
            return held

        _, _, held = await asyncio.gather(chat(), refused(), held_file())
        assert tools.poll() is None
        phase("outage checked")
    finally:
        await asyncio.to_thread(stack.weaviate.start, lambda _m: None)
    back = time.monotonic()
    phase("weaviate ready again")

    # within 10 s: the cached answer, the search, the held file, and health saying so
    async def found() -> None:
        while True:
            try:
                if any(expected in hit.content[0].text for hit in await search()):
                    return
            except openai.APIStatusError as exc:
                assert exc.status_code == 503, exc
            assert time.monotonic() - back < SERVED_WITHIN_S, "search did not come back"
            await asyncio.sleep(0.3)

    async def indexed_held() -> None:
        while (
            await client.vector_stores.files.retrieve(held.id, vector_store_id=store.id)
        ).status != "completed":
            assert time.monotonic() - back < SERVED_WITHIN_S, "the held file was not indexed"
            await asyncio.sleep(0.3)

    await asyncio.gather(until_hit(timeout=SERVED_WITHIN_S), found(), indexed_held())
    recovered = time.monotonic() - back
    phase(f"all back ({recovered:.1f} s after weaviate)")
    assert recovered < SERVED_WITHIN_S, recovered
    assert (await until_ready(system.gateways[0], True, timeout=5))["weaviate"] is True
    assert (await until_ready(tools_ready, True, timeout=5))["degraded"] == []
