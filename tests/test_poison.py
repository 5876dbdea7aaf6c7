"""Poison events written straight to every input topic of every role are dead-lettered, and the next
event behind them is processed: a valid request still travels conversation -> safety -> router ->
worker and ends with its answer.

The three real processors (processes) and a real worker (in this process, a tiny random Llama with
SmolLM2's tokenizer), against the test stack's Kafka and Redis.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from gpu_workers.config import WorkerConfig
from gpu_workers.model_loader import load
from gpu_workers.random_model import build
from gpu_workers.startup import run_worker
from producers import publish, start_producer
from schemas import ChatMessage, ChatRequest, Completion, DeadLetter, SamplingParams
from tests.kafka_support import Tap, caught_up
from topics import CHAT_REQUESTS, CONVERSATION_TURNS, DEAD_LETTER, PREPARED, SCREENED, TOKENS, inference_topic
from topics.admin import apply
from topics.registry import all_topics

pytestmark = pytest.mark.slow
REPLY = 4
POISONS = [
    b"\xff\xfe not even text",
    b'{"type": "chat_request", "request_id": ',
    b'{"type": "no_such_event"}',
]


@pytest.mark.heavy  # every role started, about 35 s: make test-all; make test keeps the dead-letter tests of
# tests/test_broker.py and tests/test_tools_processor.py
async def test_poison_on_every_input_topic_is_dead_lettered_and_the_next_event_served(stack, roles, tmp_path):
    model = f"tiny-{uuid.uuid4().hex[:6]}"
    await apply(all_topics([model]), stack.kafka.address)
    # the two groups that read ts.tokens start at its end: the session's earlier tests left thousands
    # of token events there, and the safety processor's output checks of those held its screening of
    # the requests here back by a minute
    for group in ("ts-conversation", "ts-safety"):
        await caught_up(group, TOKENS, stack.kafka.address)
    roles.start_processors()
    loaded = await asyncio.to_thread(load, "tiny", build(tmp_path / "tiny"))
    stop, ready = asyncio.Event(), asyncio.Event()
    worker = asyncio.create_task(
        run_worker(
            WorkerConfig(model=model, worker_id="poisoned"),
            stop,
            loaded=loaded,
            bootstrap=stack.kafka.address,
            on_ready=lambda w: ready.set(),
        )
    )
    producer = await start_producer()
    try:
        await asyncio.wait_for(ready.wait(), 120)
        # the roles are up when a first request makes it through
        async with Tap(TOKENS) as tokens:
            first = request(model)
            await publish(producer, CHAT_REQUESTS, first, key=first.conversation_id)
            [warm] = await tokens.wait_for(completion_of(first), timeout=240)
            assert warm.finish_reason in ("stop", "length"), warm

        # who reads each input topic, and where the request behind the poison will pass on it
        def targets(valid: ChatRequest, tokens_topic: bool) -> list:
            key, rkey = valid.conversation_id.encode(), valid.request_id.encode()
            if tokens_topic:
                return [(TOKENS, rkey, REPLY, "ts-conversation"), (TOKENS, rkey, REPLY, "ts-safety")]
            return [
                (CHAT_REQUESTS, key, None, "ts-conversation"),
                (CONVERSATION_TURNS, key, None, "ts-conversation"),
                (PREPARED, rkey, None, "ts-safety"),
                (SCREENED, rkey, None, "ts-router"),
                (inference_topic(model), rkey, None, f"worker.{model}"),
            ]

        for tokens_topic in (False, True):  # the tokens topic apart: two processors read it
            valid = request(model)
            aimed = targets(valid, tokens_topic)
            async with (
                Tap(DEAD_LETTER) as letters,
                Tap(TOKENS) as tokens,
                Tap(PREPARED) as prepared,
                Tap(SCREENED) as screened,
                Tap(inference_topic(model)) as routed,
            ):
                for name, k, partition in {(s.name, k, p) for s, k, p, _ in aimed}:
                    for poison in POISONS:
                        await (await producer.send(name, poison, key=k, partition=partition))
                await publish(producer, CHAT_REQUESTS, valid, key=valid.conversation_id)
                try:
                    [done] = await tokens.wait_for(completion_of(valid), timeout=120)
                except AssertionError:
                    seen = {
                        t.spec.name: bool(t.matching(lambda e, rid=valid.request_id: e.request_id == rid))
                        for t in (prepared, screened, routed, tokens)
                    }
                    raise AssertionError(
                        f"the request behind the poison never ended; seen on {seen}"
                    ) from None
                assert done.finish_reason in ("stop", "length") and done.worker_id == "poisoned"
                for spec, _, _, group in aimed:
                    await letters.wait_for(
                        lambda e, s=spec, g=group: (
                            isinstance(e, DeadLetter)
                            and e.source_topic == s.name
                            and e.consumer_group == g
                            and e.payload in POISONS
                        ),
                        count=len(POISONS),
                        timeout=60,
                    )
    finally:
        stop.set()
        await worker
        await producer.stop()


def request(model: str) -> ChatRequest:
    rid = uuid.uuid4().hex[:16]
    return ChatRequest(
        request_id=rid,
        conversation_id=f"conv-{rid}",
        model=model,
        reply_partition=REPLY,
        messages=[ChatMessage(role="user", content="What is the capital of France?")],
        sampling=SamplingParams(max_tokens=8, temperature=0),
    )


def completion_of(req: ChatRequest):
    return lambda e: isinstance(e, Completion) and e.request_id == req.request_id
