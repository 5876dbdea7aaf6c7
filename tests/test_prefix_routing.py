"""Prefix-aware routing: the router's placement (pure) and, through the whole chain with two real
workers, a conversation's turns following the worker that holds their prefix."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from processors.router.prefixes import Placement, PrefixMap, by_cache_key
from schemas import ChatMessage, Completion, InferenceRequest, PrefixHeld, WorkerLoad, conversation_digest
from tokenstream.stack.roles import shared_host_worker_args

HISTORY = [
    ChatMessage(role="system", content="Be brief."),
    ChatMessage(role="user", content="Hi"),
    ChatMessage(role="assistant", content="Hello!"),
]


def turn(messages, rid: str = "r-1", tenant: str = "acme") -> InferenceRequest:
    return InferenceRequest(request_id=rid, model="m", tenant=tenant, messages=messages)


def held(digest: str, worker: str = "w1") -> PrefixHeld:
    return PrefixHeld(request_id="r-0", model="m", worker_id=worker, digest=digest)


def load(worker: str = "w1", partitions=(2, 5), waiting: int = 0) -> WorkerLoad:
    return WorkerLoad(
        request_id=f"load-{worker}",
        model="m",
        worker_id=worker,
        partitions=list(partitions),
        running=1,
        waiting=waiting,
        max_running=4,
    )


def test_the_next_turn_goes_to_a_partition_of_the_holder_and_stays_there():
    prefixes = PrefixMap()
    prefixes.apply(held(conversation_digest("acme", "m", HISTORY)), now=100.0)
    prefixes.apply(load(), now=100.0)
    nxt = turn([*HISTORY, ChatMessage(role="user", content="And you?")])
    place = prefixes.place(nxt, "m", now=101.0)
    assert place.reason == "prefix" and place.worker_id == "w1" and place.partition in (2, 5)
    assert prefixes.place(nxt, "m", now=101.5) == place  # fixed by the request id


def test_no_prefix_routing_without_a_fresh_unloaded_holder_of_this_tenant_and_model():
    prefixes = PrefixMap(stale_s=5.0)
    prefixes.apply(held(conversation_digest("acme", "m", HISTORY)), now=100.0)
    nxt = [*HISTORY, ChatMessage(role="user", content="And you?")]
    assert prefixes.place(turn(nxt), "m", now=100.0).reason == "holder-silent"  # no heartbeat yet
    prefixes.apply(load(waiting=4), now=100.0)
    assert prefixes.place(turn(nxt), "m", now=101.0).reason == "holder-overloaded"
    prefixes.apply(load(waiting=0), now=100.0)
    assert prefixes.place(turn(nxt), "m", now=106.0).reason == "holder-silent"  # stale
    assert (
        prefixes.place(turn(nxt, tenant="other"), "m", now=101.0).reason == "no-prefix"
    )  # never across tenants
    assert prefixes.place(turn(nxt), "m-v2", now=101.0).reason == "no-prefix"  # another served model
    assert prefixes.place(turn(HISTORY[:2]), "m", now=101.0).reason == "first-turn"
    assert prefixes.place(turn(nxt), "m", now=101.0).partition in (2, 5)


def test_a_cache_key_places_what_no_prefix_does_by_tenant_model_and_key():
    def keyed(rid: str, key: str, tenant: str = "acme") -> InferenceRequest:
        return InferenceRequest(request_id=rid, model="m", tenant=tenant, messages=HISTORY[:2], cache_key=key)

    unplaced = Placement(None, "first-turn")
    spots = {by_cache_key(unplaced, keyed(f"r-{i}", "kb"), "m", 8).partition for i in range(20)}
    assert len(spots) == 1 and spots <= set(range(8))  # every request id: one partition
    elsewhere = {by_cache_key(unplaced, keyed("r-1", f"kb-{i}"), "m", 8).partition for i in range(40)}
    assert len(elsewhere) > 4  # other keys spread over the topic
    tenants = {by_cache_key(unplaced, keyed("r-1", "kb", f"t-{i}"), "m", 8).partition for i in range(40)}
    assert len(tenants) > 4  # the same key of other tenants too
    assert by_cache_key(unplaced, keyed("r-1", ""), "m", 8) == unplaced  # no key: the request id decides
    prefix = Placement(3, "prefix", "w1")
    assert by_cache_key(prefix, keyed("r-1", "kb"), "m", 8) == prefix  # a held prefix comes first
    assert by_cache_key(unplaced, keyed("r-1", "kb"), "m", 8).reason == "cache-key"


def test_the_latest_holder_wins_and_the_map_is_bounded():
    prefixes = PrefixMap(max_prefixes=2)
    digest = conversation_digest("acme", "m", HISTORY)
    prefixes.apply(held(digest, "w1"))
    prefixes.apply(held(digest, "w2"))
    assert prefixes.holders[digest] == ("m", "w2")
    prefixes.apply(held("b" * 32))
    prefixes.apply(held("c" * 32))
    assert digest not in prefixes.holders and len(prefixes.holders) == 2


@pytest.mark.heavy  # the whole chain, five turns (40 s); the placement logic is tested above
@pytest.mark.slow
async def test_each_turn_of_a_conversation_is_served_where_its_prefix_is(stack, tmp_path):
    """Two workers, one gateway, the processors; five turns of one conversation by conversation id:
    from the second turn on, every turn is answered by the worker that answered the one before,
    with its earlier turns' tokens read from the cache."""
    from gpu_workers.model_loader import smollm2_dir
    from tests.conftest import Roles
    from tests.gateway_support import api_client, start_gateway
    from tests.kafka_support import Tap
    from tests.test_worker_kafka import wait_for_log
    from topics import TOKENS
    from topics.admin import apply
    from topics.registry import all_topics

    model = f"smollm2-prefix-{uuid.uuid4().hex[:6]}"
    await apply(all_topics([model]), stack.kafka.address)
    roles = Roles(stack, tmp_path)
    try:
        roles.start_processors()
        # two workers on this host: each its share of the cores, threads that sleep rather than spin (as
        # `system up` gives them, tokenstream.stack.roles.shared_host_worker_args)
        workers = [
            roles.start(
                "worker",
                "--model",
                model,
                "--model-path",
                str(smollm2_dir()),
                "--worker-id",
                w,
                *shared_host_worker_args(2),
                name=f"worker-{w}",
            )
            for w in ("A", "B")
        ]
        for w in workers:
            await asyncio.to_thread(wait_for_log, roles, w, "worker ready", 300)
            threads = shared_host_worker_args(2)[1]  # the torch thread's team, as torch reports it there
            assert f" threads={threads} spin_wait=False " in roles.log(w), roles.log(w)[-2000:]
        url, _ = await asyncio.to_thread(start_gateway, roles, [model], timeout=120)
        client = api_client(url, timeout=120)
        conversation = f"conv-{uuid.uuid4().hex[:8]}"
        served: list[tuple[str, int, int]] = []  # (worker, cached tokens, prompt tokens) per turn
        async with Tap(TOKENS) as tap:
            for i, question in enumerate(
                ["Name a colour.", "Name a fruit.", "Name a city.", "Name a river.", "Name a tree."]
            ):
                done = await client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": question}],
                    max_tokens=12,
                    temperature=0,
                    extra_body={"conversation_id": conversation},
                )
                rid = done.id.removeprefix("chatcmpl-")
                end = (await tap.wait_for(lambda e, r=rid: isinstance(e, Completion) and e.request_id == r))[
                    0
                ]
                served.append(
                    (end.worker_id, done.usage.prompt_tokens_details.cached_tokens, done.usage.prompt_tokens)
                )
        workers_seen = [w for w, _, _ in served]
        assert len(set(workers_seen)) == 1, served
        assert all(cached >= prompt // 2 for _, cached, prompt in served[1:]), served
    finally:
        roles.stop_all()
