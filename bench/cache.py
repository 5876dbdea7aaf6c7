"""`tokenstream bench cache`: what the response caches and the rate limiter cost and save.

One run against a throwaway Kafka, Redis and Weaviate and a real `tokenstream gateway` process,
with the synthetic worker of `bench gateway` answering at once (its own TTFT ~0):

(a) exact cache, through the gateway: client TTFT (request sent -> first content frame) of
    `--requests` deterministic requests answered live (misses, each a new question), then of the
    same requests again (hits). Target: hit TTFT p50 < 20 ms.
(b) rate limiter: the limiter's Redis round trip (one Lua script taking from four minute
    counters and one of the key's open-request slots), called directly `--limiter-calls` times
    (each slot released again after the timing, as when an answer ends); baseline in the same run:
    a Redis PING over the same connection pool just before each call (the least any Redis call
    costs). Target: p50/p99 < 2 ms.
(c) semantic cache lookup: the Weaviate query (near vector, scoped by tenant and model) over
    `--entries` stored answers, and the CPU embedding of the question before it, measured apart;
    baseline in the same run: the exact cache's Redis GET.

Results go to bench/results/cache.json.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer

from bench.gateway import MODEL, SyntheticWorker, synthetic_gateway
from bench.rawhttp import ID_RE
from bench.stats import nearest_rank as _pct

RESULTS = Path(__file__).parent / "results" / "cache.json"


def _stats(values: list[float]) -> dict:
    return {"n": len(values), "p50": round(_pct(values, 50), 3), "p99": round(_pct(values, 99), 3)}


def main(
    requests: int = typer.Option(100, help="deterministic requests in (a), each asked twice"),
    limiter_calls: int = typer.Option(2000, help="limiter round trips in (b)"),
    entries: int = typer.Option(200, help="answers stored in the semantic cache for (c)"),
    lookups: int = typer.Option(200, help="semantic lookups in (c)"),
    out: Path = typer.Option(RESULTS, help="where the JSON results go"),
) -> None:
    """Exact-cache hit vs miss TTFT through the gateway, limiter overhead, semantic lookup latency."""
    import asyncio
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # the Weaviate client logs every HTTP call
    result = asyncio.run(_run(requests, limiter_calls, entries, lookups))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    _table(result)
    print(f"written to {out}")


async def _run(requests: int, limiter_calls: int, entries: int, lookups: int) -> dict:
    import os
    import platform
    import tempfile

    from tokenstream.stack import Stack
    from tokenstream.stack.stack import use

    tmp = Path(tempfile.mkdtemp(prefix="bench-cache-"))
    stack = Stack.ephemeral(tmp)
    say = lambda m: print(m, flush=True)
    stack.up(say)
    use(stack.environment())
    try:
        async with synthetic_gateway(stack, tmp, "bench cache") as (_, port, key):
            worker = await SyntheticWorker(stack.kafka.address).start()
            try:
                say(f"(a) exact cache: {requests} misses, then the same {requests} as hits")
                exact = await _exact(port, key, worker, requests)
            finally:
                await worker.stop()
        say(f"(b) rate limiter: {limiter_calls} round trips")
        limiter = await _limiter(stack.redis.address, limiter_calls)
        limiter["load_average_1m"] = round(os.getloadavg()[0], 2)
        say(f"(c) semantic cache: {entries} entries, {lookups} lookups")
        semantic = await _semantic(stack, entries, lookups)
        return {
            "command": f"tokenstream bench cache --requests {requests} --limiter-calls {limiter_calls} "
            f"--entries {entries} --lookups {lookups}",
            "machine": {
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "load_average_1m_at_end": round(os.getloadavg()[0], 2),
                "note": "gateway, broker, Redis, Weaviate and load generator share this host",
            },
            "exact": exact,
            "limiter": limiter,
            "semantic": semantic,
            "targets": {"exact_hit_ttft_p50_ms": 20, "limiter_p50_ms": 2, "limiter_p99_ms": 2},
        }
    finally:
        stack.down(say)


def _request(port: int, key: str, prompt: str) -> bytes:
    body = json.dumps(
        {
            "model": MODEL,
            "stream": True,
            "max_tokens": 16,
            "temperature": 0,
            "messages": [{"role": "user", "content": prompt}],
        }
    ).encode()
    return (
        f"POST /v1/chat/completions HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {key}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


async def _ttft(port: int, key: str, prompt: str) -> tuple[float | None, bytes]:
    """Client TTFT in ms (None if no content frame came) and the response head."""
    import asyncio

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.perf_counter()
    writer.write(_request(port, key, prompt))
    buf, first = b"", None
    while first is None:
        data = await reader.read(65536)
        if not data:
            break
        buf += data
        if any(int(m.group(2)) >= 0 for m in ID_RE.finditer(buf)):
            first = (time.perf_counter() - t0) * 1000
    while await reader.read(65536):
        pass
    writer.close()
    return first, buf.split(b"\r\n\r\n", 1)[0].lower()


async def _exact(port: int, key: str, worker: SyntheticWorker, n: int) -> dict:
    import asyncio

    worker.auto_answer = True
    prompts = [f"cache bench question {i} {time.time_ns()}" for i in range(n + 5)]
    miss, hit, floor, wrong = [], [], [], 0
    for prompt in prompts:  # the first 5 warm up connections and code paths
        ttft, head = await _ttft(port, key, prompt)
        if ttft is not None and b"x-tokenstream-cache: miss" in head:
            miss.append(ttft)
    await asyncio.sleep(1.0)  # answers are stored in the background once delivered
    for prompt in prompts:
        ttft, head = await _ttft(port, key, prompt)
        if ttft is not None and b"x-tokenstream-cache: hit" in head:
            hit.append(ttft)
        else:
            wrong += 1
        floor.append(await _models(port, key))
    worker.auto_answer = False
    return {
        "miss_ttft_ms": _stats(miss[5:]),
        "hit_ttft_ms": _stats(hit[5:]),
        "not_hit_on_second_ask": wrong,
        "models_get_ms": _stats(floor[5:]),
    }


async def _models(port: int, key: str) -> float:
    """The floor of any API call here: GET /v1/models (connection, HTTP, key check), in ms."""
    import asyncio

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.perf_counter()
    writer.write(
        f"GET /v1/models HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {key}\r\n\r\n".encode()
    )
    while await reader.read(65536):
        pass
    writer.close()
    return (time.perf_counter() - t0) * 1000


async def _limiter(redis_url: str, n: int) -> dict:
    import redis.asyncio as aioredis

    from gateway.metrics import Metrics
    from gateway.ratelimit import RateLimiter
    from schemas.keys import ApiKey

    r = aioredis.from_url(redis_url)
    limiter = RateLimiter(r, Metrics())
    key = ApiKey(
        key_id="bench-limiter", tenant="bench", rpm=10**9, tpm=10**12, tenant_rpm=10**9, tenant_tpm=10**12
    )
    take, ping = [], []
    for i in range(n + 50):
        t0 = time.perf_counter()
        await r.ping()
        t1 = time.perf_counter()
        ticket = await limiter.take(key, 300, f"bench-{i}", max_streams=10**6, lease_s=30)
        t2 = time.perf_counter()
        await limiter.release(f"bench-{i}", ticket.note())  # when the answer ends (not on the request's path)
        if i >= 50:
            ping.append((t1 - t0) * 1000)
            take.append((t2 - t1) * 1000)
    await r.aclose()
    return {
        "take_ms": _stats(take),
        "redis_ping_ms": _stats(ping),
        "overhead_over_ping_ms": {
            "p50": round(_pct(take, 50) - _pct(ping, 50), 3),
            "p99": round(_pct(take, 99) - _pct(ping, 99), 3),
        },
        # the host's scheduling shows in both: the share of calls over the 2 ms target, each
        "share_over_2ms": {
            "take": round(sum(t > 2 for t in take) / len(take), 4),
            "redis_ping": round(sum(p > 2 for p in ping) / len(ping), 4),
        },
    }


async def _semantic(stack, entries: int, lookups: int) -> dict:
    import random

    import redis.asyncio as aioredis

    from gateway.cache import Entry
    from gateway.metrics import Metrics
    from gateway.semantic import SemanticCache

    cache = SemanticCache(
        "127.0.0.1", stack.weaviate.port, stack.weaviate.grpc_port, 0.9, 3600, 32768, Metrics()
    )
    topics = ["capital of", "population of", "weather in", "history of", "food in", "language of"]
    places = [f"place{i}" for i in range(max(1, entries // len(topics) + 1))]
    questions = [f"What is the {t} {p}?" for p in places for t in topics][:entries]
    vectors = {}
    for q in questions:
        vectors[q] = await cache.embed(q)
        await cache.store(
            "bench",
            MODEL,
            "",
            q,
            vectors[q],
            Entry(chunks=[q], finish_reason="stop", prompt_tokens=5, completion_tokens=5, request_id=q),
        )
    r = aioredis.from_url(stack.redis.address)
    await r.set("bench:exact", b"x" * 500)
    embed, query, get, hits = [], [], [], 0
    rng = random.Random(7)
    for i in range(lookups + 10):
        q = (
            rng.choice(questions).replace("What is", "Tell me")
            if i % 2
            else f"Unrelated question number {i}?"
        )
        t0 = time.perf_counter()
        vector = await cache.embed(q)
        t1 = time.perf_counter()
        hit = await cache.lookup("bench", MODEL, "", vector)
        t2 = time.perf_counter()
        await r.get("bench:exact")
        t3 = time.perf_counter()
        if i >= 10:
            embed.append((t1 - t0) * 1000)
            query.append((t2 - t1) * 1000)
            get.append((t3 - t2) * 1000)
            hits += hit is not None
    await r.aclose()
    await cache.close()
    return {
        "entries": len(questions),
        "lookups": lookups,
        "hits": hits,
        "query_ms": _stats(query),
        "embed_ms": _stats(embed),
        "exact_cache_get_ms": _stats(get),
    }


def _table(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    e, lim, s = r["exact"], r["limiter"], r["semantic"]

    def pair(d: dict) -> str:
        return f"{d['p50']:.2f} / {d['p99']:.2f} ms"

    ok_hit = e["hit_ttft_ms"]["p50"] < r["targets"]["exact_hit_ttft_p50_ms"]
    ok_lim = lim["take_ms"]["p99"] < r["targets"]["limiter_p99_ms"]
    t = Table(
        "measure (p50 / p99)", "value", "baseline (same run)", "target", title="tokenstream bench cache"
    )
    t.add_row(
        "(a) exact-cache hit: client TTFT",
        pair(e["hit_ttft_ms"]),
        f"miss (live): {pair(e['miss_ttft_ms'])}",
        f"p50 < 20 ms {'[green]ok' if ok_hit else '[red]missed'}",
    )
    t.add_row("(a) floor: GET /v1/models", pair(e["models_get_ms"]), "", "")
    over = lim["share_over_2ms"]
    t.add_row(
        "(b) rate limiter round trip",
        pair(lim["take_ms"]) + f" ({over['take']:.1%} over 2 ms)",
        f"Redis PING: {pair(lim['redis_ping_ms'])} ({over['redis_ping']:.1%} over 2 ms)",
        f"< 2 ms {'[green]ok' if ok_lim else '[red]missed'}",
    )
    t.add_row(
        "(c) semantic lookup: Weaviate query",
        pair(s["query_ms"]),
        f"exact-cache GET: {pair(s['exact_cache_get_ms'])}",
        "",
    )
    t.add_row("(c) semantic lookup: embedding (CPU)", pair(s["embed_ms"]), "", "")
    Console().print(t)
