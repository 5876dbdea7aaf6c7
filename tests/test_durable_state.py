"""Durable state never lives where it can be evicted: filling the cache store loses no key, file or
ledger entry.

API keys, usage, files, vector stores and the once-per-effect ledgers live in the durable Redis
(`noeviction`); the exact response cache alone lives in the cache Redis (`allkeys-lru` under
maxmemory, 32 MiB in the test stack). The test writes each kind of durable record through the
project's own code and a real gateway, then pushes the cache store far past its maxmemory, and
checks that the cache store did evict while every durable record is still there and served.
"""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import redis
import redis.asyncio as aioredis

from gateway.cache import Entry, ExactCache
from gateway.metrics import Metrics
from processors.effects import Ledger
from schemas import ToolResult
from schemas import keys as K
from tests.gateway_support import new_key, start_gateway
from tools.ledger import CallLedger
from topics.admin import apply
from topics.registry import all_topics


def _info(url: str, section: str) -> dict:
    client = redis.Redis.from_url(url)
    try:
        return client.info(section)
    finally:
        client.close()


def test_the_stores_have_the_eviction_rules_their_contents_need(stack):
    durable = redis.Redis.from_url(stack.redis.address)
    cache = redis.Redis.from_url(stack.cache.address)
    try:
        assert durable.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
        assert cache.config_get("maxmemory-policy")["maxmemory-policy"] == "allkeys-lru"
        assert int(cache.config_get("maxmemory")["maxmemory"]) == 32 * 1024 * 1024
    finally:
        durable.close()
        cache.close()


async def test_filling_the_cache_store_loses_no_key_file_or_ledger_entry(stack, roles, unique):
    """Keys, files, vector stores and ledgers survive 96 MiB written into the 32 MiB cache store."""
    durable_url, cache_url = stack.redis.address, stack.cache.address
    assert os.environ["TOKENSTREAM_CACHE_REDIS_URL"] == cache_url
    await apply(all_topics(["durable-model"]), stack.kafka.address)
    url, _ = start_gateway(roles, ["durable-model"])
    secret = new_key(f"durable-{unique}", tier="paid")
    auth = {"Authorization": f"Bearer {secret}"}
    body = b"tide tables and harbour notes\n" * 100

    async with httpx.AsyncClient(base_url=url, headers=auth, timeout=30) as http:
        uploaded = (
            await http.post(
                "/v1/files", data={"purpose": "assistants"}, files={"file": ("notes.txt", body, "text/plain")}
            )
        ).json()
        store = (await http.post("/v1/vector_stores", json={"name": f"store-{unique}"})).json()
    assert uploaded["id"].startswith("file-") and store["id"].startswith("vs_")

    effects = Ledger("conversation", durable_url)
    done = await effects.once("history", f"req-{unique}", emit=_nothing)
    calls = CallLedger(f"tools-{unique}", 30.0, durable_url)
    await calls.complete(
        ToolResult(
            call_id=f"call-{unique}", request_id=f"req-{unique}", name="code_interpreter", ok=True, output="4"
        )
    )
    await calls.mark_published(f"call-{unique}")
    assert done

    # Push the cache store past maxmemory through the gateway's own exact cache: 96 MiB into 32 MiB.
    before = _info(cache_url, "stats")["evicted_keys"]
    cache_client = aioredis.Redis.from_url(cache_url)
    cache = ExactCache(cache_client, 3600, 1 << 30, Metrics())
    chunk = "x" * (256 * 1024)
    for i in range(384):
        entry = Entry(
            chunks=[chunk],
            finish_reason="stop",
            prompt_tokens=1,
            completion_tokens=1,
            request_id=f"fill-{unique}-{i}",
        )
        assert await cache.put(K.exact_cache(f"{unique}-{i}"), "default", entry)
    await cache_client.aclose()
    memory = _info(cache_url, "memory")
    evicted = _info(cache_url, "stats")["evicted_keys"] - before
    assert evicted > 0 and memory["used_memory"] <= memory["maxmemory"] * 1.1, (evicted, memory)

    # Every durable record is intact, and the gateway still serves it.
    async with httpx.AsyncClient(base_url=url, headers=auth, timeout=30) as http:
        assert (await http.get("/v1/models")).status_code == 200  # the key still authenticates
        content = await http.get(f"/v1/files/{uploaded['id']}/content")
        assert content.status_code == 200 and content.content == body
        assert (await http.get(f"/v1/vector_stores/{store['id']}")).json()["name"] == f"store-{unique}"
    assert not await effects.once("history", f"req-{unique}", emit=_nothing)  # still recorded: not redone
    assert await calls.published(f"call-{unique}")
    assert (await calls.result(f"call-{unique}")).output == "4"
    await calls.close()
    durable = _info(durable_url, "stats")
    assert durable["evicted_keys"] == 0, durable


async def _nothing() -> None:
    return None


async def test_the_gateway_stays_ready_and_says_degraded_while_the_cache_store_is_away(stack, roles):
    """The cache store is optional: its outage makes exact-cache lookups misses, never a refused request."""
    await apply(all_topics(["durable-model"]), stack.kafka.address)
    url, _ = start_gateway(roles, ["durable-model"])
    await asyncio.to_thread(stack.cache.stop, lambda _m: None)
    try:
        deadline = time.monotonic() + 20
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            while True:
                answer = await http.get("/health/ready")
                body = answer.json()
                if not body["cache"]:
                    break
                assert time.monotonic() < deadline, body
                await asyncio.sleep(0.2)
        assert answer.status_code == 200 and body["ready"], body
        assert any(d.startswith("cache redis: no answer") for d in body["degraded"]), body
    finally:
        await asyncio.to_thread(stack.cache.start, lambda _m: None)
