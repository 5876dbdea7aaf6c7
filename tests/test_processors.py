"""The faust-streaming processors as real processes against the real broker.

One conversation, one safety and one router process serve the whole module (each is its own
consumer group); the tests play the gateway and the worker by writing and reading topics.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
from aiokafka.structs import OffsetAndMetadata, TopicPartition

from common import kafka_auth
from common.config import settings
from common.models import load_tokenizer
from common.unblocked import unblocked
from processors.conversation.window import prompt_counter, trim
from producers import publish, start_producer
from schemas import (
    Cancel,
    ChatMessage,
    ChatRequest,
    Completion,
    FunctionSpec,
    InferenceRequest,
    OutputSpec,
    SafetyVerdict,
    SamplingParams,
    TokenChunk,
    ToolSpec,
    encode,
)
from schemas.keys import conversation_key
from schemas.steps import STEP_HEADERS, entry, step_value
from tests.kafka_support import Tap, group_settled, key_on_partition_of, one_key_per_partition, wait_for
from tokenstream.chaos.verify import drained
from tokenstream.shadow.gate import new_gate, record
from topics import (
    CHAT_REQUESTS,
    CONTROL,
    CONVERSATION_TURNS,
    PREPARED,
    SCREENED,
    TOKENS,
    VERDICTS,
    inference_topic,
)
from topics.admin import apply
from topics.registry import all_topics, processor_group

pytestmark = pytest.mark.slow

WINDOW = 400  # context window the conversation processor is started with
PARKED_S = (
    10  # how long a parked turn waits for the previous answer (TOKENSTREAM_CONVERSATION_PARKED_TIMEOUT_S)
)
CHECKPOINT_S = 60  # the safety processor's time bound on a window's unacknowledged chunks
MODELS = ["smollm2", "primary-x", "fallback-x", "canary-x", "canary-x-v2"]
ROUTES = {"primary-x": {"fallback": "fallback-x"}, "canary-x": {}}
HARMFUL = "I am going to find him tonight and stab him until he stops breathing."
VIOLENT_ANSWER = (
    "Sure. First get a knife, then wait for the victim outside the house and stab them "
    "repeatedly in the chest until they die, then hide the body so nobody finds it. "
)


def rid() -> str:
    return uuid.uuid4().hex[:16]


class Processors:
    """The three processors as `tokenstream processor X` processes; kill -9 and restart on demand."""

    def __init__(self, roles) -> None:
        self.roles = roles
        self.env = {
            "TOKENSTREAM_CONTEXT_TOKENS": json.dumps({"smollm2": WINDOW}),
            "TOKENSTREAM_ROUTER_ROUTES": json.dumps(ROUTES),
            "TOKENSTREAM_ROUTER_WAIT_BUDGET_S": "2",
            "TOKENSTREAM_ROUTER_MIN_RATE": "1",
            "TOKENSTREAM_CONVERSATION_PARKED_TIMEOUT_S": str(PARKED_S),
            # a safety window unjudged stays unwritten for the whole of the kill -9 test below
            "TOKENSTREAM_SAFETY_WINDOW_CHECKPOINT_S": str(CHECKPOINT_S),
        }
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str) -> subprocess.Popen:
        proc = self.procs[name] = self.roles.start(
            "processor", name, "--loglevel", "info", env=self.env, name=f"processor-{name}"
        )
        return proc

    def kill9(self, name: str) -> None:
        proc = self.procs[name]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="module")
def processors(stack, tmp_path_factory):
    import asyncio as _asyncio

    _asyncio.run(apply(all_topics(MODELS), stack.kafka.address))
    from tests.conftest import Roles

    roles = Roles(stack, tmp_path_factory.mktemp("processors"))
    procs = Processors(roles)
    for name in ("conversation", "safety", "router"):
        procs.start(name)
    yield procs
    roles.stop_all()


async def chat(
    producer,
    conversation: str,
    messages: list[ChatMessage],
    *,
    request_id: str | None = None,
    model: str = "smollm2",
    reply_partition: int = 5,
    **kw,
) -> ChatRequest:
    request = ChatRequest(
        request_id=request_id or rid(),
        conversation_id=conversation,
        model=model,
        messages=messages,
        reply_partition=reply_partition,
        **kw,
    )
    await publish(producer, CHAT_REQUESTS, request, key=conversation_key(request.tenant, conversation))
    return request


async def answer(producer, request: InferenceRequest, text: str) -> None:
    """Play the worker: the completion of `request` with `text`."""
    await publish(
        producer,
        TOKENS,
        Completion(
            request_id=request.request_id,
            conversation_id=request.conversation_id,
            tenant=request.tenant,
            seq=1,
            finish_reason="stop",
            text=text,
        ),
        partition=request.reply_partition,
    )


def by_id(request_id: str):
    return lambda e: e.request_id == request_id


# the tests that play the worker write its chunks as it would: as step records where it writes them
STEP_RECORDS = os.environ.get("TOKENSTREAM_WORKER_STEP_RECORDS", "").lower() in ("1", "true", "yes", "on")


async def write_chunks(producer, partition: int, *chunks: TokenChunk, steps: bool = STEP_RECORDS, wait=True):
    """Play the worker's engine step: `chunks` on `partition`, as one step record (schemas/steps.py) or
    each a record of its own; the first record's metadata (with wait=False, its future)."""
    if not steps:
        sent = [await publish(producer, TOKENS, c, partition=partition, wait=wait) for c in chunks]
        return sent[0]
    entries = [entry(c.request_id, await unblocked(encode, c)) for c in chunks]
    future = await producer.send(TOKENS.name, step_value(entries), partition=partition, headers=STEP_HEADERS)
    return await future if wait else future


async def test_third_turn_with_only_the_new_message_gets_the_full_history(processors):
    conv = f"conv-{rid()}"
    system = ChatMessage(role="system", content="You are terse.")
    async with Tap(PREPARED) as prepared:
        producer = await start_producer()
        try:
            first = await chat(producer, conv, [system, ChatMessage(role="user", content="Name a colour.")])
            [p1] = await prepared.wait_for(by_id(first.request_id), timeout=90)
            assert [m.content for m in p1.messages] == ["You are terse.", "Name a colour."]
            await answer(producer, p1, "Blue.")

            second = await chat(producer, conv, [ChatMessage(role="user", content="Another one?")])
            [p2] = await prepared.wait_for(by_id(second.request_id))
            # the third turn arrives before the second answer has landed: it must wait for it
            third = await chat(producer, conv, [ChatMessage(role="user", content="And a third?")])
            # a new conversation on the same partition, sent after it, is prepared once the third is parked
            marker = await chat(
                producer,
                key_on_partition_of(
                    conv, CHAT_REQUESTS.partitions, as_key=lambda c: conversation_key("default", c)
                ),
                [ChatMessage(role="user", content="Name a fruit.")],
            )
            await prepared.wait_for(by_id(marker.request_id))
            await prepared.caught_up()
            assert prepared.matching(by_id(third.request_id)) == []
            await answer(producer, p2, "Green.")
            [p3] = await prepared.wait_for(by_id(third.request_id))
        finally:
            await producer.stop()
    assert [(m.role, m.content) for m in p3.messages] == [
        ("system", "You are terse."),
        ("user", "Name a colour."),
        ("assistant", "Blue."),
        ("user", "Another one?"),
        ("assistant", "Green."),
        ("user", "And a third?"),
    ]
    assert p3.dropped_messages == 0 and p3.conversation_id == conv and p3.reply_partition == 5


async def test_a_turn_parked_for_an_answer_that_never_comes_is_refused_at_its_deadline(processors):
    """The first answer is lost; the next turn (only its new message) waits for it, then ends with a clear
    error instead of waiting until its client gives up; sent again, it is served at once."""
    conv = f"conv-{rid()}"
    async with Tap(PREPARED) as prepared, Tap(TOKENS) as tokens:
        producer = await start_producer()
        try:
            first = await chat(producer, conv, [ChatMessage(role="user", content="Name a colour.")])
            [p1] = await prepared.wait_for(by_id(first.request_id), timeout=90)
            second = await chat(producer, conv, [ChatMessage(role="user", content="Another one?")])
            [done] = await tokens.wait_for(
                lambda e: isinstance(e, Completion) and e.request_id == second.request_id,
                timeout=PARKED_S + 40,
            )
            waited = time.time() - second.created_at
            assert done.finish_reason == "error" and done.error_code == "previous_turn_unanswered", done
            assert first.request_id in done.error and waited >= PARKED_S
            await prepared.caught_up()  # (had it been prepared, that was before its refusal)
            assert prepared.matching(by_id(second.request_id)) == []  # never started without its history

            again = await chat(producer, conv, [ChatMessage(role="user", content="Another one?")])
            [p3] = await prepared.wait_for(by_id(again.request_id), timeout=30)
            await answer(producer, p1, "Blue.")  # the lost answer, late: no longer joins the history
            await answer(producer, p3, "Green.")
            fourth = await chat(producer, conv, [ChatMessage(role="user", content="And a third?")])
            [p4] = await prepared.wait_for(by_id(fourth.request_id), timeout=30)
        finally:
            await producer.stop()
    assert [(m.role, m.content) for m in p3.messages] == [("user", "Another one?")]
    assert [(m.role, m.content) for m in p4.messages] == [
        ("user", "Another one?"),
        ("assistant", "Green."),
        ("user", "And a third?"),
    ]
    assert len(tokens.matching(lambda e: e.request_id == second.request_id)) == 1  # refused once


async def test_a_conversation_id_of_another_tenant_reaches_none_of_its_history(processors):
    """Tenant B sending tenant A's conversation id starts a conversation of its own."""
    conv = f"conv-{rid()}"
    async with Tap(PREPARED) as prepared:
        producer = await start_producer()
        try:
            a1 = await chat(
                producer, conv, [ChatMessage(role="user", content="My PIN is 4711.")], tenant="acme"
            )
            [p1] = await prepared.wait_for(by_id(a1.request_id), timeout=90)
            await answer(producer, p1, "Noted.")
            b1 = await chat(
                producer,
                conv,
                [ChatMessage(role="user", content="What is my PIN?")],
                tenant="mallory",
                tier="free",
                priority=0,
            )
            a2 = await chat(
                producer,
                conv,
                [ChatMessage(role="user", content="And again?")],
                tenant="acme",
                tier="paid",
                priority=1,
            )
            [pb] = await prepared.wait_for(by_id(b1.request_id))
            [pa] = await prepared.wait_for(by_id(a2.request_id))
        finally:
            await producer.stop()
    assert [m.content for m in pb.messages] == ["What is my PIN?"] and pb.tenant == "mallory"
    assert [m.content for m in pa.messages] == ["My PIN is 4711.", "Noted.", "And again?"]
    assert (pa.tier, pa.priority, pb.tier) == ("paid", 1, "free")  # the key's tier travels to the worker


def numbered_turns(n: int) -> list[ChatMessage]:
    """n questions and answers of a long conversation."""
    return [
        m
        for i in range(n)
        for m in (
            ChatMessage(role="user", content=f"Question {i}: tell me something about the number {i}."),
            ChatMessage(role="assistant", content=f"The number {i} is a fine number, " * 2),
        )
    ]


async def test_history_longer_than_the_window_is_trimmed_oldest_first(processors):
    system = ChatMessage(role="system", content="Answer briefly.")
    turns = [*numbered_turns(30), ChatMessage(role="user", content="Final question: what did I ask first?")]
    async with Tap(PREPARED) as prepared:
        producer = await start_producer()
        try:
            request = await chat(
                producer, f"conv-{rid()}", [system, *turns], sampling=SamplingParams(max_tokens=64)
            )
            [p] = await prepared.wait_for(by_id(request.request_id))
        finally:
            await producer.stop()
    count = prompt_counter(load_tokenizer("smollm2"), OutputSpec())
    assert count(p.messages) <= WINDOW - 64
    assert p.dropped_messages > 0 and len(p.messages) == 1 + len(turns) - p.dropped_messages
    assert p.messages[0] == system and p.messages[-1] == turns[-1]
    assert p.messages[1].role == "user"
    assert p.messages[1:] == turns[p.dropped_messages :]  # what is kept is the newest, unchanged
    # and nothing newer could have been kept: one more turn would not fit
    assert count([system, *turns[p.dropped_messages - 2 :]]) > WINDOW - 64


async def test_the_tools_rendered_into_the_prompt_count_against_the_window(processors):
    """The worker writes the tools into the system message: the trimmed prompt, tools included, fits."""
    tool = ToolSpec(
        function=FunctionSpec(
            name="look_up_order",
            description="Find an order by its number and "
            "return its state, items, prices and delivery address. " * 3,
            parameters={
                "type": "object",
                "properties": {"order": {"type": "string", "description": "the order number"}},
            },
        )
    )
    output = OutputSpec(tools=[tool], tool_choice="auto")
    system = ChatMessage(role="system", content="Answer briefly.")
    turns = [*numbered_turns(12), ChatMessage(role="user", content="Where is order 42?")]
    tok = load_tokenizer("smollm2")
    with_tools, plain = prompt_counter(tok, output), prompt_counter(tok, OutputSpec())
    budget = WINDOW - 64
    assert with_tools([system, *turns]) > budget  # the tools take about 150 tokens of the window
    _, dropped_if_uncounted = trim([system, *turns], plain, budget)
    async with Tap(PREPARED) as prepared:
        producer = await start_producer()
        try:
            request = await chat(
                producer,
                f"conv-{rid()}",
                [system, *turns],
                output=output,
                sampling=SamplingParams(max_tokens=64),
            )
            [p] = await prepared.wait_for(by_id(request.request_id))
        finally:
            await producer.stop()
    assert p.output == output and p.messages[-1] == turns[-1]
    assert with_tools(p.messages) <= budget  # exactly what the worker will feed the model
    assert p.dropped_messages > dropped_if_uncounted
    assert with_tools([system, *turns[p.dropped_messages - 2 :]]) > budget  # and not a turn more than needed


async def test_what_cannot_fit_the_window_is_refused_as_the_clients_fault(processors):
    """Refusals name their reason (error_code) so that the gateway answers 4xx, not a retryable 5xx."""
    too_long = ChatMessage(role="user", content=" ".join(f"w{i}" for i in range(WINDOW)))
    cases = {
        "context_length_exceeded": [
            dict(messages=[too_long]),
            dict(
                messages=[ChatMessage(role="user", content="hi")],
                sampling=SamplingParams(max_tokens=WINDOW + 1),
            ),
        ],
        "preset_not_found": [
            dict(messages=[ChatMessage(role="user", content="hi")], assistant="no-such-preset")
        ],
    }
    async with Tap(TOKENS) as tokens, Tap(PREPARED) as prepared:
        producer = await start_producer()
        try:
            sent = {
                code: [await chat(producer, f"conv-{rid()}", **kw) for kw in kws]
                for code, kws in cases.items()
            }
            fine = await chat(producer, f"conv-{rid()}", [ChatMessage(role="user", content="hi")])
            for code, requests in sent.items():
                for request in requests:
                    [done] = await tokens.wait_for(by_id(request.request_id), timeout=90)
                    assert (done.finish_reason, done.error_code) == ("error", code), done
                    assert tokens.matching(by_id(request.request_id)) == [done]
            await prepared.wait_for(by_id(fine.request_id))  # the next request is served
            await (
                prepared.caught_up()
            )  # (a refused request prepared anyway would have been before its refusal)
        finally:
            await producer.stop()
    refused = {r.request_id for rs in sent.values() for r in rs}
    assert not prepared.matching(lambda e: e.request_id in refused)


async def test_blocked_input_never_reaches_the_worker_topic(processors):
    worker_topic = inference_topic("smollm2")
    bad = InferenceRequest(
        request_id=rid(),
        conversation_id="c-bad",
        model="smollm2",
        reply_partition=7,
        messages=[ChatMessage(role="user", content=HARMFUL)],
    )
    good = InferenceRequest(
        request_id=rid(),
        conversation_id="c-good",
        model="smollm2",
        reply_partition=7,
        messages=[ChatMessage(role="user", content="What is the capital of France?")],
    )
    async with Tap(worker_topic) as inference, Tap(VERDICTS) as verdicts, Tap(TOKENS) as tokens:
        producer = await start_producer()
        try:
            await publish(producer, PREPARED, bad)
            await publish(producer, PREPARED, good)
            # a harmless request on bad's partition of every topic on the way, sent after it: once it is
            # routed, the safety processor and the router have both handled bad
            marker = InferenceRequest(
                request_id=key_on_partition_of(bad.request_id, PREPARED.partitions),
                conversation_id="c-marker",
                model="smollm2",
                reply_partition=7,
                messages=[ChatMessage(role="user", content="Name a fruit.")],
            )
            await publish(producer, PREPARED, marker)
            [routed] = await inference.wait_for(by_id(good.request_id), timeout=90)
            [done] = await tokens.wait_for(
                lambda e: e.request_id == bad.request_id and isinstance(e, Completion)
            )
            [verdict] = await verdicts.wait_for(
                lambda e: e.request_id == bad.request_id and e.stage == "input"
            )
            await inference.wait_for(by_id(marker.request_id))
        finally:
            await producer.stop()
        await inference.caught_up()
        assert inference.matching(by_id(bad.request_id)) == []
    assert routed.messages == good.messages
    assert verdict.blocked and verdict.stage == "input" and verdict.categories and verdict.policy_version
    assert done.finish_reason == "content_filter" and done.seq == 1
    refusal = [e for e, p in tokens.events if e.request_id == bad.request_id and isinstance(e, TokenChunk)]
    assert [c.seq for c in refusal] == [0] and refusal[0].text
    assert {p for e, p in tokens.events if e.request_id == bad.request_id} == {7}
    [allowed] = verdicts.matching(lambda e: e.request_id == good.request_id and e.stage == "input")
    assert not allowed.blocked


async def test_streamed_output_is_cut_with_a_verdict_in_band_and_a_cancel(processors):
    bad, good, marker = rid(), rid(), rid()
    async with Tap(TOKENS) as tokens, Tap(CONTROL) as control, Tap(VERDICTS) as verdicts:
        producer = await start_producer()
        try:
            words = VIOLENT_ANSWER.split(" ")
            calm = (
                "Paris is the capital of France and is known for its museums, cafes and parks. " * 2
            ).split(" ")
            for seq in range(40):  # one engine step: a chunk of each answer
                await write_chunks(
                    producer,
                    4,
                    TokenChunk(request_id=bad, seq=seq, text=words[seq % len(words)] + " ", token_ids=[1]),
                    TokenChunk(request_id=good, seq=seq, text=calm[seq % len(calm)] + " ", token_ids=[1]),
                    wait=False,
                )
            await producer.flush()
            [cut] = await tokens.wait_for(
                lambda e: isinstance(e, SafetyVerdict) and e.request_id == bad, timeout=90
            )
            [cancel] = await control.wait_for(by_id(bad))
            await publish(
                producer, TOKENS, Completion(request_id=good, seq=40, finish_reason="stop"), partition=4
            )
            # a short answer after it on the same partition: once it is judged, good's end was too
            await write_chunks(producer, 4, TokenChunk(request_id=marker, seq=0, text="Fine.", token_ids=[1]))
            await publish(
                producer, TOKENS, Completion(request_id=marker, seq=1, finish_reason="stop"), partition=4
            )
            await verdicts.wait_for(lambda e: e.request_id == marker and e.stage == "output")
            await tokens.caught_up()
        finally:
            await producer.stop()
    assert cut.blocked and cut.stage == "output" and cut.window_end_seq >= 0 and "violence" in cut.categories
    assert [p for e, p in tokens.events if isinstance(e, SafetyVerdict) and e.request_id == bad] == [4]
    assert isinstance(cancel, Cancel) and cancel.reason == "content_filter"
    assert not any(isinstance(e, SafetyVerdict) and e.request_id == good for e, _ in tokens.events)
    [judged] = verdicts.matching(lambda e: e.request_id == good and e.window_end_seq == 39)  # its last window
    assert not judged.blocked


async def test_the_safety_processor_notes_its_input_verdict_in_band_and_a_resume_seeks_to_it(
    processors, bootstrap
):
    """Parallel screening (the gateway's default): the input verdict may lie before the worker's first
    record. The safety processor notes where it lies (common/first_records.py), so a resume starts at
    the lower of the two notes instead of scanning from the request's admission."""
    import redis.asyncio as aioredis

    from common.first_records import FirstRecords
    from gateway import replays
    from gateway.resume import read_so_far
    from schemas import keys as K
    from schemas.ids import new_request_id

    partition = 9
    request = InferenceRequest(
        request_id=new_request_id(partition, time.time()),
        conversation_id="c-parallel",
        model="smollm2",
        reply_partition=partition,
        screening="parallel",
        messages=[ChatMessage(role="user", content="What is the capital of France?")],
    )
    ids = dict(request_id=request.request_id, conversation_id=request.conversation_id, tenant=request.tenant)
    redis = aioredis.from_url(settings().redis_url)
    worker = FirstRecords(settings().redis_url)  # the worker's notes, as gpu_workers/publisher.py writes them
    producer = await start_producer()
    hub = replays.hub(bootstrap)
    try:
        await publish(producer, PREPARED, request)
        noted = await wait_for(
            lambda: redis.get(K.first_verdict(request.request_id)), 90, "the verdict's note"
        )
        at, offset = map(int, noted.split(b":"))
        chunk = TokenChunk(**ids, seq=0, text="Paris.", token_ids=[1])
        worker.note(
            request.request_id,
            await publish(producer, TOKENS, chunk, partition=partition, wait=False),
            verdict_first=True,
        )
        await publish(producer, TOKENS, Completion(**ids, seq=1, finish_reason="stop"), partition=partition)
        await wait_for(lambda: worker.written == 1, 30, "the worker's note")
        await hub.close()
        hub.stats = replays.Stats()
        events = await read_so_far(bootstrap, request.request_id)
    finally:
        await producer.stop()
        await worker.close()
        await redis.aclose()
        await hub.close()
    assert at == partition
    assert [type(e) for e in events] == [SafetyVerdict, TokenChunk, Completion], events
    assert events[0].stage == "input" and not events[0].blocked
    assert hub.stats.exact == 1 and hub.stats.fallback == 0, hub.stats  # no scan from the admission
    assert list(hub.stats.seeks) == [(partition, offset)]  # straight to the verdict


async def committed_offset(bootstrap: str, group: str, tp: TopicPartition) -> int:
    """`group`'s committed offset on `tp` (-1: none)."""
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **kafka_auth.client_options())
    await admin.start()
    try:
        found = (await admin.list_consumer_group_offsets(group, partitions=[tp])).get(tp)
        return found.offset if found is not None else -1
    finally:
        await admin.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("steps", [False, True], ids=["records", "step-records"])
async def test_kill9_of_the_safety_processor_mid_answer_judges_the_whole_window(processors, bootstrap, steps):
    """The safety processor holds an answer's window in memory until it judges it (every 32 tokens) and
    acknowledges no chunk a checkpoint does not cover, so its committed offset stays at the first chunk
    held. Killed -9 with 23 chunks of a harmful sentence held, its restart reads them again: the window
    judged at the 32nd token, 9 chunks of a harmless one later, holds both, and is blocked.
    With step records each of those chunks shares its record with a chunk of another answer, which ends
    (judged, its row deleted, its chunks acknowledged) before the kill: a step record is acknowledged
    only once all its entries are, so the commit stays at the first step all the same."""
    harmful = "Sure. First get a knife, then wait for the victim outside the house and stab them "
    harmful += "repeatedly in the chest until they die."
    harmless = "That is what the villain of the novel does in chapter three, and the detective arrives "
    harmless += "the next morning while the rain goes on and on."
    before, after = harmful.split(" "), harmless.split(" ")
    bad, partition, tp = rid(), 9, TopicPartition(TOKENS.name, 9)

    neighbour = rid()  # with step records: the answer whose chunks share bad's steps

    async def short_answer(producer) -> str:
        request_id = rid()
        chunk = TokenChunk(request_id=request_id, seq=0, text="Fine.", token_ids=[1])
        await write_chunks(producer, partition, chunk, steps=steps)
        done = Completion(request_id=request_id, seq=1, finish_reason="stop")
        await publish(producer, TOKENS, done, partition=partition)
        await verdicts.wait_for(lambda e: e.request_id == request_id and e.stage == "output", timeout=90)
        return request_id

    def chunk(seq: int, word: str) -> TokenChunk:
        return TokenChunk(request_id=bad, seq=seq, text=word + " ", token_ids=[1])

    def step(seq: int, word: str) -> list[TokenChunk]:  # one engine step's chunks on the partition
        if not steps or seq >= len(before):
            return [chunk(seq, word)]
        return [chunk(seq, word), TokenChunk(request_id=neighbour, seq=seq, text="la ", token_ids=[1])]

    async with Tap(VERDICTS) as verdicts:
        producer = await start_producer()
        try:
            await short_answer(producer)  # judged and acknowledged: the commit may reach what follows
            first = (await write_chunks(producer, partition, *step(0, before[0]), steps=steps)).offset
            for seq, word in enumerate(before[1:], 1):
                await write_chunks(producer, partition, *step(seq, word), steps=steps, wait=False)
            if steps:  # the neighbour ends: judged, and each of its chunks acknowledged
                done = Completion(request_id=neighbour, seq=len(before), finish_reason="stop")
                await publish(producer, TOKENS, done, partition=partition)
                await verdicts.wait_for(lambda e: e.request_id == neighbour, timeout=90)
            await short_answer(producer)  # judged: the chunks before it were read

            async def reached() -> bool:  # an older window held on the partition holds it up to CHECKPOINT_S
                return await committed_offset(bootstrap, "ts-safety", tp) >= first

            await wait_for(reached, CHECKPOINT_S + 30, "the commit up to the chunks held", interval=0.5)
            assert await committed_offset(bootstrap, "ts-safety", tp) == first  # and not past them
            processors.kill9("safety")
            processors.start("safety")
            for seq, word in enumerate(after, len(before)):
                await write_chunks(producer, partition, *step(seq, word), steps=steps, wait=False)
            done = Completion(request_id=bad, seq=len(before) + len(after), finish_reason="stop")
            await publish(producer, TOKENS, done, partition=partition)
            await verdicts.wait_for(lambda e: e.request_id == bad, timeout=150)
            await short_answer(producer)  # judged after bad's end: bad was judged all it will be
        finally:
            await producer.stop()
    # judged once; or again, the same window, where the restart's group rebalanced once more (the dead
    # member's session ending) between a judgement and its checkpoint
    cuts = verdicts.matching(lambda e: e.request_id == bad)
    assert {(c.blocked, c.window_end_seq, tuple(c.categories)) for c in cuts} == {(True, 31, ("violence",))}


async def test_router_overflows_to_the_fallback_while_the_primary_lags(processors, bootstrap):
    primary = inference_topic("primary-x")
    producer = await start_producer()
    try:
        # a backlog on the primary: 40 requests its (absent) workers have not taken
        ends = {}
        for i in range(40):
            meta = await publish(
                producer, primary, InferenceRequest(request_id=rid(), model="primary-x", messages=[])
            )
            ends.setdefault(meta.partition, meta.offset)
        await commit_offsets(
            bootstrap, "worker.primary-x", {TopicPartition(primary.name, p): o for p, o in ends.items()}
        )
        fallback_topic = inference_topic("fallback-x").name
        async with Tap(inference_topic("fallback-x")) as fallback, Tap(primary) as direct:
            await first_routed(producer, fallback, "primary-x")  # the router has sampled the backlog
            # the fallback's workers take what it was sent (its own wait stays within the budget: 2 s
            # at 1 request/s, so at most two requests the router may not have seen taken yet)
            await commit_offsets(bootstrap, "worker.fallback-x", None, topic=fallback_topic)
            request = InferenceRequest(
                request_id=rid(),
                model="primary-x",
                reply_partition=1,
                priority=2,
                messages=[ChatMessage(role="user", content="hello")],
            )
            await publish(producer, SCREENED, request)
            [moved] = await fallback.wait_for(by_id(request.request_id), timeout=30)
            await commit_offsets(bootstrap, "worker.fallback-x", None, topic=fallback_topic)
            # the next request on its partition is routed too: nothing of it went to the primary before
            marker = InferenceRequest(
                request_id=key_on_partition_of(request.request_id, SCREENED.partitions),
                model="primary-x",
                messages=[],
                priority=2,
            )
            await publish(producer, SCREENED, marker)
            # wherever it went (a loaded suite has taken over 30 s here once): then it must be the fallback
            deadline = time.monotonic() + 90
            while not (
                fallback.matching(by_id(marker.request_id)) or direct.matching(by_id(marker.request_id))
            ):
                assert time.monotonic() < deadline, "the marker was routed nowhere within 90 s"
                await asyncio.sleep(0.1)
            assert fallback.matching(by_id(marker.request_id)), "the marker went to the primary"
            await direct.caught_up()
            assert direct.matching(by_id(request.request_id)) == []
        assert moved.model == "fallback-x"
        # once the primary has caught up, requests go to it again (as soon as the router samples that)
        await commit_offsets(bootstrap, "worker.primary-x", None, topic=primary.name)
        async with Tap(primary) as direct:
            await first_routed(producer, direct, "primary-x")
    finally:
        await producer.stop()


async def first_routed(producer, to: Tap, model: str, timeout: float = 30) -> InferenceRequest:
    """Send requests for `model` to the router one at a time until one is routed to `to`'s topic:
    the router decides on the lag it samples every 0.5 s, so the first may still go elsewhere."""
    deadline = time.monotonic() + timeout
    while True:
        probe = InferenceRequest(request_id=rid(), model=model, messages=[])
        await publish(producer, SCREENED, probe)
        try:
            [routed] = await to.wait_for(by_id(probe.request_id), timeout=1.0)
            return routed
        except AssertionError:
            assert time.monotonic() < deadline, (
                f"no request for {model} routed to {to.spec.name} in {timeout} s"
            )


async def commit_offsets(
    bootstrap: str, group: str, offsets: dict[TopicPartition, int] | None, topic: str | None = None
) -> None:
    """Commit `offsets` for `group` (None: the end of every partition of `topic`), as its workers would."""
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, **kafka_auth.client_options(), group_id=group, enable_auto_commit=False
    )
    await consumer.start()
    try:
        if offsets is None:
            tps = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or range(12)]
            offsets = await consumer.end_offsets(tps)
        consumer.assign(list(offsets))
        await consumer.commit({tp: OffsetAndMetadata(o, "") for tp, o in offsets.items()})
    finally:
        await consumer.stop()


async def where_is(request_ids: set[str]) -> dict[str, list[str]]:
    """For a failure message: the pipeline topics each request reached."""

    async def read(spec):
        async with Tap(spec, from_beginning=True) as tap:
            await tap.caught_up(timeout=60)
            return [(spec, event, partition) for event, partition in tap.events]

    found: dict[str, list[str]] = {r: [] for r in request_ids}
    topics = (CHAT_REQUESTS, PREPARED, VERDICTS, SCREENED, TOKENS)
    for events in await asyncio.gather(*(read(spec) for spec in topics)):  # in pipeline order
        for spec, event, partition in events:
            if event.request_id in found:
                found[event.request_id].append(f"{spec.name}[{partition}] {event!r:.300}")
    return found


async def flushed(producer, prepared: Tap, screened: Tap | None = None, routed: Tap | None = None) -> None:
    """Push a marker through every partition of each processor's input, a stage at a time: the
    conversation processor's (ts.chat.requests -> `prepared`), then the safety processor's
    (ts.requests.prepared -> `screened`), then the router's (ts.requests.screened -> `routed`).
    Each keeps its partitions' order, so whatever one wrote again after a restart (a replayed
    record) was written before its markers came out: when this returns, the taps hold it."""
    tag = rid()
    hello = [ChatMessage(role="user", content="Name a fruit.")]
    convs = one_key_per_partition(
        CHAT_REQUESTS.partitions, f"conv-flush-{tag}-", as_key=lambda c: conversation_key("default", c)
    )
    sent = [await chat(producer, conv, hello) for conv in convs]
    await prepared.wait_for(
        lambda e: e.request_id in {r.request_id for r in sent}, count=len(sent), timeout=90
    )
    await prepared.caught_up()
    for spec, tap in ((PREPARED, screened), (SCREENED, routed)):
        if tap is None:
            return
        ids = one_key_per_partition(spec.partitions, f"flush-{spec.name}-{tag}-")
        for request_id in ids:
            await publish(
                producer,
                spec,
                InferenceRequest(
                    request_id=request_id, conversation_id="c-flush", model="smollm2", messages=hello
                ),
            )
        await tap.wait_for(lambda e, ids=frozenset(ids): e.request_id in ids, count=len(ids), timeout=90)
        await tap.caught_up()


def route_cli(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "tokenstream.cli", "route", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


async def test_canary_weights_change_at_run_time_and_roll_back(processors):
    stable, canary = inference_topic("canary-x"), inference_topic("canary-x-v2")
    router = processors.procs["router"]

    def updates() -> int:  # the router logs each route update it applies
        return processors.roles.log(router).count("route canary-x: weights")

    canary_route = ("set", "canary-x", "-w", "canary-x=0.9", "-w", "canary-x-v2=0.1")
    # a canary needs a passed shadow gate (`tokenstream shadow`, tests/test_shadow.py): refused without one,
    # then set once the gate an evaluation records is on ts.shadow.gates
    refused = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "tokenstream.cli", "route", *canary_route],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
        check=False,
    )
    assert refused.returncode == 1 and "canary-x-v2 has no shadow evaluation" in refused.stdout, (
        refused.stdout
    )
    await record(
        settings().kafka_bootstrap,
        new_gate(
            candidate="canary-x-v2",
            served="canary-x",
            since=0.0,
            until=1.0,
            requests=1,
            figures={"agreement": 1.0},
            require=["agreement>=0.9"],
            passed=True,
        ),
    )
    applied = updates()
    assert "canary-x-v2 10%" in route_cli(*canary_route)
    await wait_for(lambda: updates() > applied, 30, "the router applying the canary weights")
    n = 300
    producer = await start_producer()
    try:
        async with Tap(stable) as to_stable, Tap(canary) as to_canary:
            ids = {rid() for _ in range(n)}
            for request_id in ids:
                await publish(
                    producer,
                    SCREENED,
                    InferenceRequest(request_id=request_id, model="canary-x", messages=[]),
                    wait=False,
                )
            await producer.flush()
            deadline = time.monotonic() + 60
            while len(to_stable.events) + len(to_canary.events) < n and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            share = len(to_canary.events) / n
            assert {e.request_id for e, _ in to_stable.events + to_canary.events} == ids
            assert 0.04 <= share <= 0.17, f"canary share {share:.2%}"
            assert all(e.model == "canary-x-v2" for e, _ in to_canary.events)

        applied = updates()
        assert "canary-x 100%" in route_cli("rollback", "canary-x")
        await wait_for(lambda: updates() > applied, 30, "the router applying the rollback")
        async with Tap(stable) as to_stable, Tap(canary) as to_canary:
            later = {rid() for _ in range(50)}
            for request_id in later:
                await publish(
                    producer,
                    SCREENED,
                    InferenceRequest(request_id=request_id, model="canary-x", messages=[]),
                    wait=False,
                )
            await producer.flush()
            await to_stable.wait_for(lambda e: e.request_id in later, count=50)
            await to_canary.caught_up()
            assert to_canary.events == []
    finally:
        await producer.stop()
    assert "canary-x" in route_cli("show")


# A drill (about 40 s): make test-all runs it; make test keeps the conversation processor's kill -9 test.
@pytest.mark.heavy
async def test_a_member_joining_and_one_leaving_under_load_loses_and_repeats_nothing(processors, bootstrap):
    """Scale-out then scale-in of the conversation processor, whose table rows move with its partitions,
    while requests and their answers stream: every request is prepared exactly once, and the group's lag
    on each of its topics returns to 0."""
    ids: list[str] = []
    stop = asyncio.Event()
    first = processors.procs["conversation"]
    group_topics = [("ts-conversation", spec.name) for spec in (CHAT_REQUESTS, CONVERSATION_TURNS, TOKENS)]

    async def load(producer) -> None:  # a request every 0.2 s, and the "worker" answering each prepared one
        answered: set[str] = set()
        while not stop.is_set():
            request_id = rid()
            ids.append(request_id)
            await chat(
                producer,
                f"conv-scale-{request_id}",
                [ChatMessage(role="user", content="Hi.")],
                request_id=request_id,
            )
            for p in prepared.matching(lambda e: e.request_id in set(ids) and e.request_id not in answered):
                answered.add(p.request_id)
                await answer(producer, p, "Hello.")
            await asyncio.sleep(0.2)  # the load's pace

    async def published(more: int) -> None:
        target = len(ids) + more
        while len(ids) < target:
            await asyncio.sleep(0.1)

    async with Tap(PREPARED) as prepared:
        producer = await start_producer()
        loader = asyncio.create_task(load(producer))
        try:
            await published(10)
            second = processors.start("conversation")  # scale out: a second member joins
            await group_settled(bootstrap, "ts-conversation", 2)
            await published(10)
            os.killpg(first.pid, signal.SIGTERM)  # scale in: the first leaves
            await asyncio.to_thread(first.wait, 60)
            await published(10)
            stop.set()
            await loader
            try:
                await prepared.wait_for(lambda e: e.request_id in set(ids), count=len(ids), timeout=120)
            except AssertionError:
                missing = set(ids) - {e.request_id for e, _ in prepared.events}
                raise AssertionError(f"lost {missing}: {await where_is(missing)}") from None
            await flushed(producer, prepared)  # anything prepared twice is in the tap now
        finally:
            stop.set()
            await asyncio.gather(loader, return_exceptions=True)
            await producer.stop()
        seen = [e.request_id for e, _ in prepared.events if e.request_id in set(ids)]
    assert sorted(seen) == sorted(ids)  # every request exactly once
    assert second.poll() is None, processors.roles.log(second)[-3000:]
    behind: list[str] = []
    lag = await drained(bootstrap, group_topics, timeout=60, behind=behind)
    assert not any(lag.values()), (lag, behind)


async def kill_drill(processors, n: int, kills: dict[int, str]) -> None:
    """`n` requests of new conversations, one every 0.05 s, each processor in `kills` killed -9 (and
    restarted at once) after the request of that index: every request reaches the worker topic once.
    (A stage killed between an output's acknowledgement and its ledger record may write that output
    twice, processors.effects; the next stage's ledger drops it, so only the end is checked.)"""
    ids = [rid() for _ in range(n)]
    async with (
        Tap(inference_topic("smollm2")) as inference,
        Tap(PREPARED) as prepared,
        Tap(SCREENED) as screened,
    ):
        producer = await start_producer()
        try:
            for i, request_id in enumerate(ids):
                await chat(
                    producer,
                    f"conv-kill-{request_id}",
                    [ChatMessage(role="user", content=f"Say {i}.")],
                    request_id=request_id,
                )
                if i in kills:
                    processors.kill9(kills[i])
                    processors.start(kills[i])
                await asyncio.sleep(0.05)  # a steady stream: the kills land mid-stream
            try:
                await inference.wait_for(lambda e: e.request_id in set(ids), count=n, timeout=120)
            except AssertionError:
                missing = set(ids) - {e.request_id for e, _ in inference.events}
                raise AssertionError(f"lost {missing}: {await where_is(missing)}") from None
            await flushed(
                producer, prepared, screened, inference
            )  # anything written twice is in the taps now
        finally:
            await producer.stop()
        seen = [e.request_id for e, _ in inference.events if e.request_id in set(ids)]
    assert sorted(seen) == sorted(ids)  # every request exactly once where the workers read it


@pytest.mark.timeout(180)
async def test_kill9_of_the_conversation_processor_mid_stream_loses_and_duplicates_nothing(processors):
    """The reduced form of the drill below, for make test: one kill -9 amid 20 requests. Its restart
    recovers the history table and resumes from the last committed offsets (processors.delivery)."""
    await kill_drill(processors, 20, {8: "conversation"})


async def test_a_processor_at_its_default_log_level_writes_plain_text(processors, bootstrap):
    """faust's start-up spinner wrote cursor escapes into the log at the default level (warning). A
    second router is started as an operator starts one and stopped once it has joined its group."""
    proc = processors.roles.start("processor", "router", env=processors.env, name="processor-router-default")
    try:
        await group_settled(bootstrap, processor_group("router"), 2)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    text = processors.roles.log(proc)
    assert "\x1b" not in text, text[:300]


@pytest.mark.heavy  # a kill -9 drill of each processor in turn: make test-all
async def test_kill9_of_each_processor_loses_and_duplicates_nothing(processors):
    await kill_drill(processors, 60, {15: "conversation", 30: "safety", 45: "router"})
