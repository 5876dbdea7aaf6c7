"""Crypto-shredding's parts on a real durable Redis: what is sealed, keys per conversation, erasure by
conversation and by tenant, and an unreachable keyring told apart from bad input."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import typing

import msgspec
import pytest

from common import sealing
from common import unblocked as unblocked_module
from common.sealing import Keyring, destroy
from schemas import ChatMessage, ChatRequest, Completion, DecodeError, Erased, TokenChunk, decode, encode
from schemas.codec import sealer, use_sealer
from schemas.events import ALL_EVENTS
from schemas.sealing import KeyNotHeld, SealingUnavailable
from schemas.sealing import seal as seal_event

# Text-bearing fields left in clear on purpose: ids, names, model and routing facts, verdicts, offsets.
METADATA = {
    "request_id",
    "conversation_id",
    "tenant",
    "model",
    "assistant",
    "gateway_id",
    "screening",
    "tier",
    "cache_key",
    "cached_from",
    "finish_reason",
    "error_code",
    "worker_id",
    "call_id",
    "name",
    "stage",
    "categories",
    "scores",
    "peak",
    "policy_version",
    "reason",
    "weights",
    "fallback",
    "candidate",
    "served",
    "figures",
    "require",
    "pending_request_id",
    "seen_request_ids",
    "error_type",
    "source_topic",
    "consumer_group",
    "payload",
    "key",
    "headers",
    "vector_store_id",
    "file_id",
    "action",
    "generation",
    "digest",
    "partitions",
    "topic",
    "offsets",
    "record_digests",
    "prev_head",
    "head",
    "key_id",
    "signature",
    "kind",
    "audio_key",
    "language",
    "shadow_of",
    "sampling",
    "usage",
    "timings",
    "region",
}


def _texty(annotation) -> bool:
    text = str(annotation)
    return any(t in text for t in ("str", "bytes", "list", "dict", "Struct", "Spec", "Message", "Params"))


def test_every_text_field_of_every_event_is_sealed_or_named_metadata():
    base = {"request_id", "conversation_id", "tenant", "created_at", "v"}
    for event in ALL_EVENTS:
        hints = typing.get_type_hints(event)
        assert event.content <= set(event.__struct_fields__), event.__name__
        unclassified = {
            f
            for f in event.__struct_fields__
            if f not in base and f not in event.content and f not in METADATA and _texty(hints[f])
        }
        assert not unclassified, f"{event.__name__}: seal these fields or name them metadata: {unclassified}"


@pytest.fixture
def keyring(stack):
    before = sealer()
    keys = Keyring(stack.redis.address, ttl_s=0.0, feed=False)  # no cache: an erasure shows at once
    use_sealer(keys)
    yield keys
    use_sealer(before)


def _request(tenant: str, conversation: str, words: str) -> ChatRequest:
    return ChatRequest(
        request_id=f"r-{conversation}",
        tenant=tenant,
        conversation_id=conversation,
        model="m",
        messages=[ChatMessage(role="user", content=words)],
    )


def test_content_is_sealed_per_conversation_and_erased_by_conversation_then_tenant(keyring, unique):
    tenant = f"t-{unique}"
    one, two = _request(tenant, "c1", "the quick zebra"), _request(tenant, "c2", "a slow tortoise")
    chunk = TokenChunk(
        request_id="r-c1", tenant=tenant, conversation_id="c1", seq=0, text="zebra!", token_ids=[7]
    )
    wire = [encode(e) for e in (one, two, chunk)]
    assert all(b"zebra" not in w and b"tortoise" not in w for w in wire)
    assert msgspec.json.decode(wire[0])["request_id"] == "r-c1"  # ids stay readable without a key
    assert [decode(w) for w in wire] == [one, two, chunk]
    assert decode(encode(Completion(request_id="x", tenant=tenant, seq=1, finish_reason="stop"))).seq == 1

    client = keyring.redis
    gone = destroy(client, tenant, "c1")
    assert [scope for _, scope in gone] == ["c1"]
    for w in (wire[0], wire[2]):
        with pytest.raises(Erased) as erased:
            decode(w)
        assert erased.value.clear["request_id"] == "r-c1" and erased.value.clear["tenant"] == tenant
    assert decode(wire[1]) == two  # the tenant's other conversation is untouched
    again = encode(_request(tenant, "c1", "new words"))  # the conversation goes on under a new key
    assert decode(again).messages[0].content == "new words"

    altered = wire[1].replace(wire[1][40:44], b"AAAA", 1)  # inside the sealed value
    with pytest.raises(DecodeError) as bad:  # dead-lettered, as any malformed record
        decode(altered)
    assert not isinstance(bad.value, Erased)

    destroy(client, tenant)
    for w in (wire[1], again):
        with pytest.raises(Erased):
            decode(w)


def test_an_unreachable_keyring_is_an_outage_not_bad_input():
    before = sealer()
    keys = Keyring("redis://127.0.0.1:1/0", timeout_s=0.5)
    use_sealer(keys)
    try:
        with pytest.raises(SealingUnavailable) as raised:
            encode(_request("t", "c", "words"))
        assert not isinstance(raised.value, DecodeError)
        assert (
            keys.feed.live_since() is None
        )  # its feed cannot be live either: keys held fall back to the TTL
    finally:
        use_sealer(before)
        keys.close()


def wait_for(condition, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


class Counting:
    """A keyring's store client with its key fetches counted."""

    def __init__(self, client) -> None:
        self.client, self.fetches = client, 0

    def hmget(self, *args):
        self.fetches += 1
        return self.client.hmget(*args)


def test_keys_reach_running_roles_when_made_and_leave_them_when_destroyed(stack, unique):
    """The feed: a reader holds a conversation's key before anything sealed with it arrives (no round trip
    on the first token's path), and drops it the moment it is destroyed, long before its TTL."""
    tenant = f"t-{unique}"
    writer = Keyring(stack.redis.address)  # the gateway, first writer of the conversation
    reader = Keyring(stack.redis.address, ttl_s=3600.0)  # a role downstream; its TTL never runs out here
    try:
        wait_for(lambda: writer.feed.live_since() is not None and reader.feed.live_since() is not None, 10)
        counted = reader.redis = Counting(reader.redis)
        token = writer.seal(tenant, "c1", b"the quick zebra")
        key_id = token.split(".")[1]
        wait_for(lambda: key_id in reader._reading, 5)
        assert reader.open(token) == b"the quick zebra" and counted.fetches == 0
        assert (
            reader.seal(tenant, "c1", b"an answer").split(".")[1] == key_id
        )  # its answer, same key, no fetch
        assert counted.fetches == 0

        destroy(writer.redis, tenant, "c1")
        wait_for(lambda: reader.open(token) is None, 5)  # pushed: the TTL of an hour does not matter
        wait_for(lambda: writer.open(token) is None, 5)  # the writer hears it on its own feed, maybe later
        assert counted.fetches == 0
        fresh = reader.seal(tenant, "c1", b"goes on")  # its write key left with it: a new key is made
        assert fresh.split(".")[1] != key_id and writer.open(fresh) == b"goes on"

        # The feed lost (its connection killed): keys held before fall back to the short TTL and are fetched
        reader.ttl_s = 0.0
        other = writer.seal(tenant, "c2", b"a slow tortoise")
        wait_for(lambda: other.split(".")[1] in reader._reading, 5)
        lost_at = reader.feed.live_since()
        counted.client.client_kill_filter(_type="pubsub")
        wait_for(lambda: (reader.feed.live_since() or 0) > lost_at, 10)
        before = counted.fetches
        assert reader.open(other) == b"a slow tortoise" and counted.fetches == before + 1
    finally:
        writer.close()
        reader.close()


class Record(typing.NamedTuple):
    key: bytes | None
    value: bytes | None


class Gated:
    """A keyring's store client whose key fetches wait for `gate` (set by a task on the loop) and note
    the thread they ran on."""

    def __init__(self, client) -> None:
        self.client, self.gate, self.threads = client, threading.Event(), []

    def hmget(self, *args):
        self.threads.append(threading.get_ident())
        assert self.gate.wait(5), "the loop did not run while a key was fetched"
        return self.client.hmget(*args)


async def test_on_a_loop_a_key_not_held_is_fetched_in_a_thread_while_the_loop_runs(stack, unique):
    tenant = f"t-{unique}"
    writer = Keyring(stack.redis.address, feed=False)
    reader = Keyring(stack.redis.address, ttl_s=0.0, feed=False)  # holds nothing: every open needs a fetch
    before = sealer()
    use_sealer(reader)
    try:
        token = await asyncio.to_thread(writer.seal, tenant, "c1", b"the quick zebra")
        gated = reader.redis = Gated(reader.redis)
        ticks = asyncio.Event()

        async def tick() -> None:  # runs only if the loop is free while the fetch waits
            ticks.set()
            gated.gate.set()

        ticking = asyncio.create_task(tick())
        assert await sealing.unblocked(reader.open, token) == b"the quick zebra"
        await ticking
        assert ticks.is_set() and gated.threads and threading.get_ident() not in gated.threads

        # an event sealed on the loop: its scope's key made in a thread too, then the decode of a batch
        # whose keys were held first (hold_keys) makes no fetch on the loop
        made = threading.get_ident(), []
        make = reader._make
        reader._make = lambda **kw: made[1].append(threading.get_ident()) or make(**kw)
        reader.ttl_s = 60.0
        wire = await sealing.unblocked(encode, _request(tenant, "c2", "a slow tortoise"))
        assert b"tortoise" not in wire and made[1] and made[0] not in made[1]
        other = await asyncio.to_thread(seal_event, _request(tenant, "c3", "x"), writer)
        reader._reading.clear()
        fetches = len(gated.threads)
        clear = Record(b"r-x", b'{"type":"x"}')
        batch = [Record(b"r-c2", wire), Record(b"r-c3", other), clear, Record(None, None)]
        await sealing.hold_keys(batch)  # one thread hop: the two keys missing
        assert len(gated.threads) == fetches + 2 and threading.get_ident() not in gated.threads
        assert decode(wire).messages[0].content == "a slow tortoise"  # held: no fetch on the loop
        assert len(gated.threads) == fetches + 2
    finally:
        use_sealer(before)


async def test_on_a_loop_an_unreachable_keyring_is_still_an_outage(caplog, monkeypatch):
    monkeypatch.setattr(unblocked_module, "_warned_on_loop", False)
    keys = Keyring("redis://127.0.0.1:1/0", timeout_s=0.5, feed=False)
    sealed = f"s1.{'0' * 16}.AAAA"
    with pytest.raises(SealingUnavailable) as raised:
        await sealing.unblocked(keys.open, sealed)
    assert not isinstance(raised.value, KeyNotHeld)
    # outside `unblocked` a fetch on a loop still happens (as off it), and is logged once
    with caplog.at_level(logging.WARNING, logger="common.unblocked"), pytest.raises(SealingUnavailable):
        keys.open(sealed)
    assert any("on an event loop" in r.getMessage() for r in caplog.records)


class Untouchable:
    """A store client no call may reach."""

    def __getattr__(self, name):
        raise AssertionError(f"the store was called ({name})")


async def test_a_key_not_held_never_reaches_the_store_on_the_loop_and_one_fetch_serves_all(
    stack, unique, caplog
):
    tenant = f"t-{unique}"
    writer = Keyring(stack.redis.address, feed=False)
    reader = Keyring(stack.redis.address, ttl_s=60.0, feed=False)
    token = await asyncio.to_thread(writer.seal, tenant, "c1", b"the quick zebra")
    store, reader.redis = reader.redis, Untouchable()
    with pytest.raises(KeyNotHeld):  # a hot path's first try: no round trip, no wait
        sealing.held_only(reader.open, token)

    reader.redis = Counting(store)
    opened = await asyncio.gather(*(sealing.unblocked(reader.open, token) for _ in range(20)))
    assert opened == [b"the quick zebra"] * 20 and reader.redis.fetches == 1  # twenty misses, one fetch

    # patiently: a key merely not held is fetched at once, without the outage's back-off or warning
    other = await asyncio.to_thread(writer.seal, tenant, "c2", b"a slow tortoise")
    with caplog.at_level(logging.WARNING, logger="common.sealing"):
        assert await sealing.patiently(lambda: reader.open(other), "test") == b"a slow tortoise"
    assert reader.redis.fetches == 2 and not [r for r in caplog.records if "unreachable" in r.getMessage()]
