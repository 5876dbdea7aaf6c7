"""`tokenstream audit` against the real broker.

The run is written with the real event types through `producers` (what each role writes, where
it writes it); one test drives the real conversation processor, the writer of the transcripts
topic. A corrupted run (a token seq missing) must fail the gap check with a clear report.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid

import pytest

from audit.run import Auditor, Options
from producers import publish, start_producer
from schemas import (
    REFUSAL,
    Cancel,
    ChatMessage,
    ChatRequest,
    Completion,
    InferenceRequest,
    SafetyVerdict,
    TokenChunk,
    ToolCall,
    ToolResult,
    Usage,
    encode,
)
from schemas.ids import new_request_id
from schemas.keys import conversation_key
from schemas.steps import STEP_HEADERS, entry, step_value
from tests.kafka_support import Tap
from topics import (
    CHAT_REQUESTS,
    CONTROL,
    PREPARED,
    SCREENED,
    TOKENS,
    TOOL_CALLS,
    TOOL_RESULTS,
    TRANSCRIPTS,
    VERDICTS,
    inference_topic,
)
from topics.admin import apply
from topics.registry import all_topics

MODEL = "audit-model"
WORDS = ["The ", "sky ", "is ", "blue ", "today."]


@pytest.fixture(scope="module")
def topics_ready(stack):
    asyncio.run(apply(all_topics([MODEL]), stack.kafka.address))
    return stack


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tokenstream.cli", "audit", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "220", **(env or {})},
        check=False,
    )


async def play(
    producer,
    *,
    conversation: str,
    tenant: str,
    kind: str = "ok",
    partition: int = 3,
    missing_seq: int | None = None,
) -> str:
    """Write one request's events as the roles do; `kind`: ok | input_blocked | output_blocked | tool |
    parallel_ok | parallel_blocked (screened in parallel: generation starts before the input verdict) |
    steps (as ok, its chunks two to a step record, as a worker with step_records writes them)."""
    rid = new_request_id(partition, time.time())
    ids = dict(request_id=rid, conversation_id=conversation, tenant=tenant)
    question = [ChatMessage(role="user", content=f"What colour is the sky? ({kind})")]
    screening = "parallel" if kind.startswith("parallel") else "serial"
    await publish(
        producer,
        CHAT_REQUESTS,
        ChatRequest(**ids, model=MODEL, messages=question, screening=screening, reply_partition=partition),
        key=conversation_key(tenant, conversation),
    )  # as the gateway keys it
    prepared = InferenceRequest(
        **ids, model=MODEL, messages=question, reply_partition=partition, screening=screening
    )
    await publish(producer, PREPARED, prepared)
    if screening == "parallel":
        return await play_parallel(producer, prepared, blocked=kind == "parallel_blocked")
    blocked = kind == "input_blocked"
    await publish(
        producer,
        VERDICTS,
        SafetyVerdict(
            **ids,
            stage="input",
            blocked=blocked,
            categories=["violence"] if blocked else [],
            policy_version="test-1",
        ),
    )
    on_tokens = dict(partition=partition)
    if blocked:
        await publish(
            producer, TOKENS, TokenChunk(**ids, seq=0, text="I can't help with that request."), **on_tokens
        )
        await publish(
            producer,
            TOKENS,
            Completion(**ids, seq=1, finish_reason="content_filter", text="I can't help with that request."),
            **on_tokens,
        )
        return rid
    await publish(producer, SCREENED, prepared)
    await publish(producer, inference_topic(MODEL), prepared)
    seq, step = 0, []
    for i, word in enumerate(WORDS):
        if kind == "tool" and i == 2:
            await publish(
                producer,
                TOOL_CALLS,
                ToolCall(**ids, call_id="call-1", name="weather", arguments='{"city":"Oslo"}'),
            )
            await publish(
                producer,
                TOOL_RESULTS,
                ToolResult(**ids, call_id="call-1", name="weather", ok=True, output="sunny"),
            )
        if kind == "output_blocked" and i == 3:
            await publish(
                producer,
                TOKENS,
                SafetyVerdict(
                    **ids,
                    stage="output",
                    blocked=True,
                    categories=["violence"],
                    window_end_seq=2,
                    policy_version="test-1",
                ),
                **on_tokens,
            )
            await publish(producer, CONTROL, Cancel(**ids, reason="content_filter"))
        if kind == "steps":
            step.append(entry(rid, encode(TokenChunk(**ids, seq=seq, text=word, worker_id="w1"))))
            if len(step) == 2 or i == len(WORDS) - 1:
                await producer.send_and_wait(
                    TOKENS.name, step_value(step), partition=partition, headers=STEP_HEADERS
                )
                step = []
        elif seq != missing_seq:
            await publish(
                producer, TOKENS, TokenChunk(**ids, seq=seq, text=word, worker_id="w1"), **on_tokens
            )
        seq += 1
    reason = "cancelled" if kind == "output_blocked" else "stop"
    await publish(
        producer,
        TOKENS,
        Completion(
            **ids,
            seq=seq,
            finish_reason=reason,
            text="".join(WORDS),
            usage=Usage(prompt_tokens=7, completion_tokens=seq),
            worker_id="w1",
        ),
        **on_tokens,
    )
    return rid


async def play_parallel(producer, prepared: InferenceRequest, *, blocked: bool) -> str:
    """The router forwards at once; the input verdict lands in band after two chunks; a block cancels."""
    ids = dict(
        request_id=prepared.request_id, conversation_id=prepared.conversation_id, tenant=prepared.tenant
    )
    where = dict(partition=prepared.reply_partition)
    await publish(producer, inference_topic(MODEL), prepared)
    for seq in (0, 1):
        await publish(producer, TOKENS, TokenChunk(**ids, seq=seq, text=WORDS[seq], worker_id="w1"), **where)
    verdict = SafetyVerdict(
        **ids,
        stage="input",
        blocked=blocked,
        categories=["violence"] if blocked else [],
        policy_version="test-1",
    )
    await publish(producer, VERDICTS, verdict)
    await publish(producer, TOKENS, verdict, **where)
    seq = 2
    if blocked:
        await publish(producer, CONTROL, Cancel(**ids, reason="content_filter"))
        await publish(producer, TOKENS, TokenChunk(**ids, seq=2, text=WORDS[2], worker_id="w1"), **where)
        seq = 3
    else:
        for seq in range(2, len(WORDS)):
            await publish(
                producer, TOKENS, TokenChunk(**ids, seq=seq, text=WORDS[seq], worker_id="w1"), **where
            )
        seq = len(WORDS)
    await publish(
        producer,
        TOKENS,
        Completion(
            **ids,
            seq=seq,
            finish_reason="cancelled" if blocked else "stop",
            text="".join(WORDS[:seq]),
            worker_id="w1",
        ),
        **where,
    )
    return prepared.request_id


async def audit_of(bootstrap: str, rid: str):
    async with Auditor(Options(bootstrap, horizon_s=30)) as auditor:
        [audit] = (await auditor.request(rid)).audits
    return audit


async def test_each_kind_of_request_replays_with_the_text_its_client_saw(topics_ready, bootstrap):
    producer = await start_producer(bootstrap)
    try:
        conv, tenant = f"conv-{uuid.uuid4().hex[:8]}", "t-" + uuid.uuid4().hex[:6]
        rids = {
            kind: await play(producer, conversation=conv, tenant=tenant, kind=kind)
            for kind in (
                "ok",
                "input_blocked",
                "output_blocked",
                "tool",
                "parallel_ok",
                "parallel_blocked",
                "steps",
            )
        }
    finally:
        await producer.stop()
    ok = await audit_of(bootstrap, rids["ok"])
    assert ok.text == "".join(WORDS) and ok.finish_reason == "stop" and ok.problems() == []
    assert [r.topic for r in ok.rows][:5] == [
        CHAT_REQUESTS.name,
        PREPARED.name,
        VERDICTS.name,
        SCREENED.name,
        inference_topic(MODEL).name,
    ]
    refused = await audit_of(bootstrap, rids["input_blocked"])
    assert refused.text == "I can't help with that request." and refused.finish_reason == "content_filter"
    assert refused.problems() == [] and not refused.reached_worker
    cut = await audit_of(bootstrap, rids["output_blocked"])
    assert cut.text == "The sky is " and cut.finish_reason == "content_filter"
    assert cut.withheld == 2 and cut.problems() == []
    tool = await audit_of(bootstrap, rids["tool"])
    assert tool.tool_calls == {"call-1": "weather"} and tool.problems() == []
    assert tool.text == "".join(WORDS)
    released = await audit_of(bootstrap, rids["parallel_ok"])
    assert released.text == "".join(WORDS) and released.problems() == [] and released.parallel
    held = await audit_of(bootstrap, rids["parallel_blocked"])
    assert held.text == REFUSAL and held.finish_reason == "content_filter"
    assert held.problems() == [] and held.withheld == 3  # two chunks held, one after the verdict
    stepped = await audit_of(bootstrap, rids["steps"])  # chunks unpacked from their step records
    assert stepped.text == "".join(WORDS) and stepped.finish_reason == "stop" and stepped.problems() == []
    # the chaos drill's reader of the log takes the same answer out of the step records
    from tokenstream.chaos.verify import read_answers

    answers = await read_answers(bootstrap, {rids["steps"]}, time.time() - 120)
    assert answers[rids["steps"]].text() == "".join(WORDS)


async def test_the_time_in_each_hop_comes_from_the_broker_timestamps_and_the_worker_timings(
    topics_ready, bootstrap
):
    """Records written with known timestamps (ms after admission) and a Completion with known Timings;
    ts.tokens stamps its records with the broker's append time, read back from the acknowledgements."""
    from schemas import Timings, encode

    t0 = int(time.time() * 1000)
    rid = new_request_id(5, t0 / 1000)
    ids = dict(request_id=rid, conversation_id=rid, tenant="t-hops")
    question = [ChatMessage(role="user", content="How long did each hop take?")]
    prepared = InferenceRequest(**ids, model=MODEL, messages=question, reply_partition=5)
    done = Completion(
        **ids,
        seq=1,
        finish_reason="stop",
        text="Fast.",
        worker_id="w1",
        timings=Timings(pipeline_s=0.060, queue_s=0.010, prefill_s=0.100, decode_s=0.2),
    )
    written = [
        (
            CHAT_REQUESTS,
            ChatRequest(**ids, model=MODEL, messages=question, reply_partition=5, created_at=t0 / 1000),
            3,
            None,
        ),
        (PREPARED, prepared, 13, None),
        (SCREENED, prepared, 53, None),
        (inference_topic(MODEL), prepared, 58, None),
        (TOKENS, TokenChunk(**ids, seq=0, text="Fast.", worker_id="w1"), 175, 5),
        (TOKENS, done, 400, 5),
    ]
    producer = await start_producer(bootstrap)
    try:
        stamped = [
            (
                await producer.send_and_wait(
                    spec.name,
                    encode(event),
                    key=rid.encode(),
                    partition=partition,
                    timestamp_ms=t0 + after_ms,
                )
            ).timestamp
            for spec, event, after_ms, partition in written
        ]
    finally:
        await producer.stop()
    first_token, completion = stamped[-2:]  # the broker's append times
    audit = await audit_of(bootstrap, rid)
    assert [(hop, round(s * 1000)) for hop, s in audit.hops] == [
        ("gateway", 3),
        ("conversation", 10),
        ("safety", 40),
        ("router", 5),
        ("fetch", 2),
        ("engine", 110),
        ("publish", first_token - (t0 + 170)),
        ("decode", completion - first_token),
    ]
    out = cli("request", rid, "--horizon", "30")
    assert out.returncode == 0, out.stdout + out.stderr
    table = out.stdout[out.stdout.index("time in each hop") :]
    for hop in (
        "gateway",
        "conversation",
        "safety",
        "router",
        "fetch",
        "engine",
        "publish",
        "decode",
        str(completion - t0),
    ):
        assert hop in table


async def test_the_conversation_audit_finds_every_request_and_exports_json_lines(
    topics_ready, bootstrap, tmp_path
):
    producer = await start_producer(bootstrap)
    try:
        tenant = "t-" + uuid.uuid4().hex[:6]
        conv = new_request_id(0, time.time())  # the gateway names a new conversation after its first request
        rids = [
            await play(producer, conversation=conv, tenant=tenant, kind=k) for k in ("ok", "output_blocked")
        ]
    finally:
        await producer.stop()
    export = tmp_path / "conv.jsonl"
    out = cli("conversation", conv, "--export", str(export), "--horizon", "30")
    assert out.returncode == 0, out.stdout + out.stderr
    for rid in rids:
        assert rid in out.stdout
    assert "The sky is" in out.stdout and "2 request(s), 0 failing" in out.stdout
    lines = [json.loads(line) for line in export.read_text().splitlines()]
    assert {line["event"]["request_id"] for line in lines} == set(rids)
    assert all({"topic", "partition", "offset", "timestamp", "event"} <= line.keys() for line in lines)
    assert sum(line["event"]["type"] == "completion" and line["topic"] == TOKENS.name for line in lines) == 2


async def test_a_missing_seq_fails_the_gap_check_with_a_clear_report(topics_ready, bootstrap):
    producer = await start_producer(bootstrap)
    try:
        rid = await play(producer, conversation=f"conv-{uuid.uuid4().hex[:8]}", tenant="t", missing_seq=2)
    finally:
        await producer.stop()
    out = cli("request", rid, "--horizon", "30")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "token seq gap: missing 2" in out.stdout and "FAIL" in out.stdout


async def test_range_finds_exactly_the_requests_admitted_in_the_window(topics_ready, bootstrap):
    tenant = "t-" + uuid.uuid4().hex[:6]
    producer = await start_producer(bootstrap)
    try:
        before = [await play(producer, conversation=f"c-{i}", tenant=tenant) for i in range(2)]
        since = int(time.time() * 1000) + 1
        while time.time() * 1000 <= since:
            await asyncio.sleep(0.001)
        inside = [
            await play(producer, conversation=f"c-{i}", tenant=tenant, kind=k)
            for i, k in enumerate(("ok", "input_blocked", "tool"))
        ]
        until = int(time.time() * 1000) + 1
        while time.time() * 1000 <= until:
            await asyncio.sleep(0.001)
        after = [await play(producer, conversation="c-9", tenant=tenant)]
    finally:
        await producer.stop()
    found = []
    async with Auditor(Options(bootstrap, tenant=tenant, horizon_s=30)) as auditor:
        outcome = await auditor.range(since, until, found.append)
    assert sorted(a.request_id for a in found) == sorted(inside)
    assert outcome.failed == 0 and not set(before + after) & {a.request_id for a in found}
    iso = lambda ms: time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms / 1000)) + f".{ms % 1000:03d}"
    out = cli("range", "--since", iso(since), "--until", iso(until), "--tenant", tenant, "--horizon", "30")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3 request(s), 0 failing" in out.stdout


async def test_the_conversation_processor_writes_each_answers_final_record(topics_ready, bootstrap, roles):
    """The transcripts topic (long retention) is written by the real conversation processor."""
    roles.start("processor", "conversation", name="processor-conversation")
    conv = new_request_id(1, time.time())
    producer = await start_producer(bootstrap)
    try:
        async with Tap(PREPARED) as prepared, Tap(TRANSCRIPTS) as transcripts:
            rid = new_request_id(4, time.time())
            ids = dict(request_id=rid, conversation_id=conv, tenant="t-proc")
            await publish(
                producer,
                CHAT_REQUESTS,
                ChatRequest(
                    **ids,
                    model="smollm2",
                    reply_partition=4,
                    messages=[ChatMessage(role="user", content="Name a colour.")],
                ),
                key=conv,
            )
            await prepared.wait_for(lambda e: e.request_id == rid, timeout=300)
            await publish(producer, TOKENS, TokenChunk(**ids, seq=0, text="Blue."), partition=4)
            await publish(
                producer, TOKENS, Completion(**ids, seq=1, finish_reason="stop", text="Blue."), partition=4
            )
            [record] = await transcripts.wait_for(lambda e: e.request_id == rid, timeout=180)
    finally:
        await producer.stop()
    assert [m.content for m in record.question] == ["Name a colour."]
    assert record.answer.text == "Blue." and record.conversation_id == conv
    # the answer was written once the processor had started, maybe minutes after admission
    out = cli("request", rid, "--horizon", "900")
    assert out.returncode == 0, out.stdout + out.stderr
    assert TRANSCRIPTS.name in out.stdout and "final record: stop" in out.stdout
