"""Tool calls through real worker processes and the real broker: a worker killed (kill -9) in the
middle of a call is replaced, and the calls streamed across both workers are exactly the calls of
the whole generated text: no character of the arguments missing or repeated, the same call ids, and
a ToolCall event per call. The tiny random-weight model is used (the grammar bounds every argument,
so each call completes), as in test_worker_kafka's failover test."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest

from gpu_workers.startup import needed_topics
from gpu_workers.tool_calls import ToolCallParser
from producers import publish, start_producer
from schemas import OutputSpec, call_id
from tests import test_worker_kafka
from tests.kafka_support import Tap
from tests.test_worker_kafka import TokenReader, assert_gap_free, request, wait_for_log
from topics import TOOL_CALLS, inference_topic
from topics.admin import apply

pytestmark = pytest.mark.slow
# test_worker_kafka's fixtures, used here too
tiny_dir, tiny_loaded = test_worker_kafka.tiny_dir, test_worker_kafka.tiny_loaded
TOOL = {
    "type": "function",
    "function": {
        "name": "book",
        "parameters": {
            "type": "object",
            "required": ["city", "nights", "rooms"],
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "nights": {"type": "integer", "minimum": 1, "maximum": 9},
                "rooms": {
                    "type": "array",
                    "items": {"enum": ["single", "double"]},
                    "minItems": 1,
                    "maxItems": 3,
                },
            },
        },
    },
}


def spec() -> OutputSpec:
    from gateway.tool_params import Tool, output_spec

    return output_spec([Tool(**TOOL)], "required", None, None)


@pytest.mark.heavy  # a kill -9 / scale drill: make test-all, beside the chaos drill (test_chaos.py)
async def test_kill9_mid_call_second_worker_finishes_the_same_calls(
    bootstrap, unique, roles, tiny_dir, tiny_loaded
):
    tokenizer = tiny_loaded.tokenizer
    model = f"tiny-tools-{unique}"
    await apply(needed_topics(model), bootstrap)
    args = ["worker", "--model", model, "--model-path", str(tiny_dir), "--step-delay", "0.1"]
    a = roles.start(*args, "--worker-id", "A", name="worker-A")
    b = roles.start(*args, "--worker-id", "B", name="worker-B")
    await asyncio.to_thread(wait_for_log, roles, a, "worker ready")
    await asyncio.to_thread(wait_for_log, roles, b, "worker ready")
    await asyncio.sleep(3)  # both joined: the group settles with partitions split over A and B
    producer = await start_producer(bootstrap)
    try:
        async with TokenReader(bootstrap) as reader, Tap(TOOL_CALLS) as audit:
            reqs = [request(model, f"book a hotel, request {i}", 150) for i in range(8)]
            for r in reqs:
                r.output = spec()
                await publish(producer, inference_topic(model), r)
            rids = [r.request_id for r in reqs]

            def inside_a_call(rd) -> bool:
                return all(any(d.arguments for c in rd.chunks(x) for d in c.tool_calls) for x in rids)

            await reader.until(inside_a_call, timeout=120)
            on_a = [x for x in rids if reader.chunks(x)[-1].worker_id == "A" and reader.completion(x) is None]
            assert on_a, "worker A is in the middle of none of the calls"
            os.killpg(a.pid, signal.SIGKILL)
            await reader.until(lambda rd: rd.all_complete(rids), timeout=180)
            calls = {}
            for x in rids:
                parser = ToolCallParser(x)
                parser.feed("".join(c.raw for c in reader.chunks(x)))
                calls.update({c.id: c.function.arguments for c in parser.calls})
            await audit.wait_for(lambda e: e.call_id in calls, count=len(calls), timeout=60)
        for x in rids:
            assert_gap_free(reader, x)
            chunks, done = reader.chunks(x), reader.completion(x)
            raw = tokenizer.decode([t for c in chunks for t in c.token_ids], skip_special_tokens=True)
            assert "".join(c.raw for c in chunks) == raw
            whole = ToolCallParser(x)
            whole.feed(raw)  # the calls of the whole text, parsed at once
            streamed: dict[int, dict] = {}
            for d in (d for c in chunks for d in c.tool_calls):
                if d.id:
                    streamed[d.index] = {"id": d.id, "name": d.name, "arguments": ""}
                streamed[d.index]["arguments"] += d.arguments
            expected = [
                {"id": call_id(x, i), "name": c.function.name, "arguments": c.function.arguments}
                for i, c in enumerate(whole.calls)
            ]
            assert list(streamed.values()) == expected
            assert [(c.id, c.function.arguments) for c in done.tool_calls] == [
                (e["id"], e["arguments"]) for e in expected
            ]
            if done.finish_reason == "tool_calls":
                for call in expected:
                    json.loads(call["arguments"])
            events = {e.call_id: e for e in audit.matching(lambda e, x=x: e.request_id == x)}
            assert [events[e["id"]].arguments for e in expected] == [e["arguments"] for e in expected]
            assert [calls[e["id"]] for e in expected] == [e["arguments"] for e in expected]
        for x in on_a:  # A began the call, B finished it
            workers = [c.worker_id for c in reader.chunks(x)]
            assert workers[0] == "A" and reader.completion(x).worker_id == "B" and workers == sorted(workers)
        assert "takeover" in roles.log(b)
    finally:
        await producer.stop()
