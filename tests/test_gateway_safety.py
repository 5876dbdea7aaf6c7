"""A blocking output verdict, sent in band on the tokens partition, cuts the stream at the gateway."""

from __future__ import annotations

import asyncio
import uuid

import openai
import pytest

from producers import publish, start_producer
from schemas import SafetyVerdict, TokenChunk
from tests.conftest import Roles
from tests.gateway_support import FakePipeline, default_key, start_gateway
from tests.kafka_support import Tap, wait_for
from topics import TOKENS

LONG = " ".join(f"word{i}" for i in range(60))


@pytest.fixture(scope="module")
async def pipeline(stack, bootstrap):
    p = await FakePipeline(bootstrap, f"cut-{uuid.uuid4().hex[:6]}", token_delay=0.1, slots=4).start()
    yield p
    await p.stop()


@pytest.fixture(scope="module")
def gateway(stack, pipeline, tmp_path_factory):
    roles = Roles(stack, tmp_path_factory.mktemp("gateway-safety"))
    url, _ = start_gateway(roles, [pipeline.model])
    yield url
    roles.stop_all()


@pytest.mark.parametrize("stream", [True, False])
async def test_output_verdict_cuts_the_answer_with_content_filter(gateway, pipeline, stream):
    client = openai.AsyncOpenAI(base_url=gateway + "/v1", api_key=default_key(), max_retries=0)
    producer = await start_producer()

    async def cut_when_started() -> None:
        [request] = await wait_for(
            lambda: [r for rid, r in pipeline.requests.items() if rid not in cut],
            30,
            "the request reaching the pipeline",
        )
        # cut once the worker double has written past the verdict's window (seq 0..3) and a few more
        await tokens.wait_for(
            lambda e: isinstance(e, TokenChunk) and e.request_id == request.request_id and e.seq >= 5,
            timeout=30,
        )
        cut.add(request.request_id)
        await publish(
            producer,
            TOKENS,
            SafetyVerdict(
                request_id=request.request_id,
                stage="output",
                blocked=True,
                categories=["violence"],
                policy_version="test",
                window_end_seq=3,
            ),
            partition=request.reply_partition,
        )

    cut: set[str] = set(pipeline.requests)
    async with Tap(TOKENS) as tokens:
        cutter = asyncio.create_task(cut_when_started())
        try:
            messages = [{"role": "user", "content": LONG}]
            if stream:
                text, reasons = "", []
                async for chunk in await client.chat.completions.create(
                    model=pipeline.model, messages=messages, stream=True
                ):
                    text += chunk.choices[0].delta.content or ""
                    if chunk.choices[0].finish_reason:
                        reasons.append(chunk.choices[0].finish_reason)
            else:
                answer = await client.chat.completions.create(model=pipeline.model, messages=messages)
                text, reasons = answer.choices[0].message.content, [answer.choices[0].finish_reason]
            await cutter
        finally:
            cutter.cancel()
            await producer.stop()
    assert reasons == ["content_filter"]
    assert 0 < len(text.split()) < 60 and LONG.startswith(text.strip())
