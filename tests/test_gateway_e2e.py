"""End to end with the real worker (`tokenstream worker`, a tiny random-weight model on the CPU):
SDK -> gateway -> ts.chat.requests -> (processor double) -> ts.inference.<model> -> worker -> ts.tokens.
A stream cut on one gateway and resumed on another joins to the uninterrupted greedy answer;
a dropped stream is cancelled after the grace period and the worker's batch slot is freed."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx
import openai
import pytest

from tests.conftest import Roles
from tests.gateway_support import (
    FakePipeline,
    auth_headers,
    content_of,
    default_key,
    free_port,
    new_key,
    sse,
    start_gateway,
)

pytestmark = pytest.mark.slow
PROMPT = [{"role": "user", "content": "Tell me a story about a lighthouse keeper."}]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from gpu_workers.random_model import build

    return build(tmp_path_factory.mktemp("gateway-tiny-model"))


def wait_for_log(roles, proc, text: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while text not in roles.log(proc):
        assert proc.poll() is None, roles.log(proc)[-3000:]
        assert time.monotonic() < deadline, roles.log(proc)[-3000:]
        time.sleep(0.2)


def running(metrics_url: str, name: str = "vllm:num_requests_running") -> float:
    for line in httpx.get(metrics_url).text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    return -1.0


@pytest.mark.heavy  # about 23 s; resume, cancel: test_full_chain.py in make test
async def test_real_worker_resume_and_cancel(stack, bootstrap, tmp_path, tiny_model):
    model = f"tiny-{uuid.uuid4().hex[:6]}"
    processor = await FakePipeline(bootstrap, model, worker=False).start()  # ChatRequest -> InferenceRequest
    roles = Roles(stack, tmp_path)
    metrics_port = free_port()
    try:
        worker = roles.start(
            "worker",
            "--model",
            model,
            "--model-path",
            str(tiny_model),
            "--step-delay",
            "0.05",
            "--metrics-port",
            str(metrics_port),
            name="worker",
        )
        await asyncio.to_thread(wait_for_log, roles, worker, "worker ready")
        env = {"TOKENSTREAM_GATEWAY_CANCEL_GRACE_S": "1"}
        a, _ = await asyncio.to_thread(start_gateway, roles, [model], index=0, count=2, env=env)
        b, _ = await asyncio.to_thread(start_gateway, roles, [model], index=1, count=2, env=env)

        client = openai.AsyncOpenAI(base_url=b + "/v1", api_key=default_key(), max_retries=0, timeout=120)
        stream = await client.chat.completions.create(
            model=model, messages=PROMPT, temperature=0, max_tokens=40, stream=True
        )
        greedy = "".join([c.choices[0].delta.content or "" async for c in stream])
        assert greedy

        request = {"model": model, "messages": PROMPT, "temperature": 0, "max_tokens": 40, "stream": True}
        async with httpx.AsyncClient(timeout=120, headers=auth_headers()) as http:
            first = []
            async with http.stream("POST", a + "/v1/chat/completions", json=request) as r:
                async for event_id, data in sse(r):
                    first.append((event_id, data))
                    if sum(1 for _, d in first if content_of(d)) >= 5:
                        break
            cid = json.loads(first[0][1])["id"]
            async with http.stream(
                "GET", f"{b}/v1/chat/completions/{cid}/stream", headers={"Last-Event-ID": first[-1][0]}
            ) as r:
                rest = [e async for e in sse(r)]
        assert rest[-1][1] == "[DONE]"
        assert "".join(content_of(d) for _, d in first + rest) == greedy

        # a dropped stream: cancelled after the grace period, the worker's slot freed
        long = dict(request, max_tokens=400)
        async with (
            httpx.AsyncClient(timeout=120, headers=auth_headers()) as http,
            http.stream("POST", a + "/v1/chat/completions", json=long) as r,
        ):
            n = 0
            async for _, data in sse(r):
                cid = json.loads(data)["id"]
                n += bool(content_of(data))
                if n >= 3:
                    break
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        assert await asyncio.to_thread(running, metrics_url) == 1
        deadline = time.monotonic() + 15
        while await asyncio.to_thread(running, metrics_url) != 0:
            assert time.monotonic() < deadline, "the worker never freed the slot"
            await asyncio.sleep(0.2)
        async with (
            httpx.AsyncClient(timeout=60, headers=auth_headers()) as http,
            http.stream("GET", f"{a}/v1/chat/completions/{cid}/stream?include_usage=true") as r,
        ):
            events = [e async for e in sse(r)]
        usage = json.loads(events[-2][1])["usage"]
        assert usage["completion_tokens"] < 400
        assert cid.removeprefix("chatcmpl-") in processor.cancels
    finally:
        await asyncio.to_thread(roles.stop_all)
        await processor.stop()


@pytest.mark.heavy  # about 24 s; the order itself: tests/test_worker_priority.py in make test
async def test_a_paid_key_is_served_first_under_a_free_tier_flood(stack, bootstrap, tmp_path, tiny_model):
    """One batch slot, twelve free-tier requests queued: the paid key's two requests are next."""
    model = f"tiny-{uuid.uuid4().hex[:6]}"
    processor = await FakePipeline(bootstrap, model, worker=False).start()
    roles = Roles(stack, tmp_path)
    metrics_port = free_port()
    free, paid = new_key("flood", tier="free"), new_key("vip", tier="paid")
    finished: dict[str, float] = {}
    try:
        worker = roles.start(
            "worker",
            "--model",
            model,
            "--model-path",
            str(tiny_model),
            "--step-delay",
            "0.03",
            "--max-running",
            "1",
            "--metrics-port",
            str(metrics_port),
            name="worker",
        )
        await asyncio.to_thread(wait_for_log, roles, worker, "worker ready")
        # the flood is meant to queue at the worker: no early 429 from the gateway's admission
        url, _ = await asyncio.to_thread(
            start_gateway, roles, [model], env={"TOKENSTREAM_GATEWAY_ADMISSION_BUDGET_S": "1000"}
        )
        request = {"model": model, "messages": PROMPT, "max_tokens": 16, "cache": False}

        async def one(http: httpx.AsyncClient, name: str, key: str) -> None:
            r = await http.post(url + "/v1/chat/completions", json=request, headers=auth_headers(key))
            assert r.status_code == 200, r.text
            finished[name] = time.monotonic()

        async with httpx.AsyncClient(timeout=300) as http:
            flood = [asyncio.create_task(one(http, f"free{i}", free)) for i in range(12)]
            metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
            deadline = time.monotonic() + 60
            while await asyncio.to_thread(running, metrics_url, "vllm:num_requests_waiting") < 8:
                assert time.monotonic() < deadline, "the flood never queued at the worker"
                await asyncio.sleep(0.05)
            await asyncio.gather(*flood, one(http, "paid0", paid), one(http, "paid1", paid))
    finally:
        await asyncio.to_thread(roles.stop_all)
        await processor.stop()
    order = sorted(finished, key=finished.get)
    # at most the running request and the one admitted meanwhile finish before them (FIFO: last)
    assert order.index("paid0") <= 4 and order.index("paid1") <= 4, order
