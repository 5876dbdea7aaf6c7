"""API keys, tenant isolation, rate limits and usage, against two real gateway processes, the real
Redis of the test stack and the `tokenstream keys` commands."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
import uuid

import httpx
import pytest
import redis

from schemas import keys as K
from tests.conftest import Roles
from tests.gateway_support import FakePipeline, auth_headers, new_key, sse, start_gateway
from tests.kafka_support import wait_for
from tokenstream.keys import KeyStore

LONG = " ".join(f"w{i}" for i in range(60))


@pytest.fixture(scope="module")
async def pipeline(stack, bootstrap):
    p = await FakePipeline(bootstrap, f"echo-{uuid.uuid4().hex[:6]}", token_delay=0.05, slots=32).start()
    yield p
    await p.stop()


@pytest.fixture(scope="module")
def gateways(stack, pipeline, tmp_path_factory):
    roles = Roles(stack, tmp_path_factory.mktemp("gateway-keys"))
    # bursts here are meant for the rate limiter: the lag-based overload check stays out of the way
    env = {"TOKENSTREAM_GATEWAY_CANCEL_GRACE_S": "30", "TOKENSTREAM_GATEWAY_ADMISSION_BUDGET_S": "1000"}
    a = start_gateway(roles, [pipeline.model], index=0, count=2, env=env)
    b = start_gateway(roles, [pipeline.model], index=1, count=2, env=env)
    yield a[0], b[0]
    roles.stop_all()


def ask(model: str, text: str = "hello there", **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], **extra}


def cli(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "tokenstream.cli", "keys", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "250"},
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def assert_invalid_key(r: httpx.Response) -> None:
    assert r.status_code == 401, r.text
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["message"]


async def test_every_api_route_needs_a_valid_key(gateways, pipeline):
    a, _ = gateways
    store = KeyStore(os.environ["TOKENSTREAM_REDIS_URL"])
    revoked = new_key("acme")
    store.revoke(revoked)
    expired = new_key("acme", expires="2001-01-01")
    user = new_key("acme")  # not an admin
    async with httpx.AsyncClient(base_url=a, timeout=30) as http:
        for headers in (
            {},
            {"Authorization": "Bearer sk-ts-not-a-key"},
            {"Authorization": "Basic abc"},
            auth_headers(revoked),
            auth_headers(expired),
        ):
            assert_invalid_key(
                await http.post("/v1/chat/completions", json=ask(pipeline.model), headers=headers)
            )
            assert_invalid_key(await http.get("/v1/models", headers=headers))
            assert_invalid_key(await http.get("/v1/chat/completions/chatcmpl-x/stream", headers=headers))
            assert_invalid_key(await http.post("/v1/chat/completions/chatcmpl-x/cancel", headers=headers))
            assert_invalid_key(await http.get("/metrics", headers=headers))
        assert (
            "revoked"
            in (await http.get("/v1/models", headers=auth_headers(revoked))).json()["error"]["message"]
        )
        # the chat page and health stay open; /metrics wants an admin key
        assert (await http.get("/")).status_code == 200
        assert (await http.get("/health/live")).status_code == 200
        assert (await http.get("/metrics", headers=auth_headers(user))).status_code == 403
        assert "gateway_requests_total" in (await http.get("/metrics", headers=auth_headers())).text
        r = await http.post("/v1/chat/completions", json=ask(pipeline.model), headers=auth_headers(user))
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "hello there"
        rid = r.json()["id"].removeprefix("chatcmpl-")
    assert pipeline.requests[rid].tenant == "acme"


async def test_keys_commands_create_list_revoke_and_count_usage(gateways, pipeline):
    a, _ = gateways
    out = cli("create", "--tenant", "cli-tenant", "--tier", "paid", "--rpm", "50", "--name", "from-cli")
    secret = out.strip().splitlines()[-1]
    assert secret.startswith("sk-ts-")
    h = K.digest(secret)
    stored = redis.Redis.from_url(os.environ["TOKENSTREAM_REDIS_URL"]).hgetall(K.api_key(h))
    assert secret.encode() not in b"".join(stored.values())  # stored hashed only
    key_id = h[:16]
    listing = cli("list")
    assert key_id in listing and "cli-tenant" in listing and "active" in listing
    async with httpx.AsyncClient(base_url=a, timeout=30) as http:
        r = await http.post(
            "/v1/chat/completions", json=ask(pipeline.model, "one two three"), headers=auth_headers(secret)
        )
        assert r.status_code == 200
        usage = r.json()["usage"]
        deadline = time.monotonic() + 20
        while key_id not in cli("usage"):  # counted in the background once the answer is out
            assert time.monotonic() < deadline, "usage never recorded"
            await asyncio.sleep(0.2)
        row = next(line for line in cli("usage").splitlines() if key_id in line)
        cells = [c.strip() for c in row.split("│") if c.strip()]
        assert cells[3:7] == ["1", str(usage["prompt_tokens"]), "0", str(usage["completion_tokens"])]
        assert "revoked" in cli("revoke", key_id)
        assert "revoked" in next(line for line in cli("list").splitlines() if key_id in line)
        assert_invalid_key(
            await http.post("/v1/chat/completions", json=ask(pipeline.model), headers=auth_headers(secret))
        )


async def test_another_tenant_cannot_resume_or_cancel_a_stream(gateways, pipeline):
    a, b = gateways
    owner, other_tenant, same_tenant = new_key("alpha"), new_key("beta"), new_key("alpha")
    async with httpx.AsyncClient(timeout=30) as http:
        async with http.stream(
            "POST",
            f"{a}/v1/chat/completions",
            headers=auth_headers(owner),
            json=ask(pipeline.model, LONG, stream=True),
        ) as r:
            assert r.status_code == 200
            seen = []
            async for event_id, data in sse(r):
                seen.append(event_id)
                if len(seen) >= 3:
                    break
        cid = "chatcmpl-" + seen[-1].split(":")[0]
        for url in (a, b):
            resume = await http.get(
                f"{url}/v1/chat/completions/{cid}/stream",
                headers={**auth_headers(other_tenant), "Last-Event-ID": seen[-1]},
            )
            assert resume.status_code == 404 and resume.json()["error"]["code"] == "not_found"
            cancel = await http.post(
                f"{url}/v1/chat/completions/{cid}/cancel", headers=auth_headers(other_tenant)
            )
            assert cancel.status_code == 404
        # an id that never existed gets the very same answer
        missing = await http.get(
            f"{b}/v1/chat/completions/chatcmpl-{'0' * 16}p0t1/stream", headers=auth_headers(other_tenant)
        )
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
        # the owner's tenant (any of its keys) resumes on the other instance; nothing was cancelled
        async with http.stream(
            "GET",
            f"{b}/v1/chat/completions/{cid}/stream",
            headers={**auth_headers(same_tenant), "Last-Event-ID": seen[-1]},
        ) as r:
            assert r.status_code == 200
            rest = [data async for _, data in sse(r)]
        assert rest[-1] == "[DONE]"
    # the refused cancels stopped nothing: the answer ran to its end
    rid = cid.removeprefix("chatcmpl-")
    await wait_for(lambda: pipeline.served[rid].finish_reason, 10, "the answer's end at the worker double")
    assert pipeline.served[rid].finish_reason == "stop" and rid not in pipeline.cancels


async def wait_for_fresh_minute(r: redis.Redis, margin_s: int = 20) -> None:
    """Limits count per minute of the Redis clock: start where the minute has room left."""
    while int(r.time()[0]) % 60 > 60 - margin_s:
        await asyncio.sleep(0.5)


async def test_requests_per_minute_hold_across_two_gateways(gateways, pipeline):
    n = 7
    key = new_key("rpm-tenant", rpm=n)
    await wait_for_fresh_minute(redis.Redis.from_url(os.environ["TOKENSTREAM_REDIS_URL"]))
    async with httpx.AsyncClient(timeout=60) as http:
        # one on each instance first, then a concurrent burst over both
        answers = [
            await http.post(
                f"{g}/v1/chat/completions", json=ask(pipeline.model, "first"), headers=auth_headers(key)
            )
            for g in gateways
        ]
        answers += await asyncio.gather(
            *(
                http.post(
                    f"{gateways[i % 2]}/v1/chat/completions",
                    json=ask(pipeline.model, f"r{i}"),
                    headers=auth_headers(key),
                )
                for i in range(3 * n - 2)
            )
        )
    assert [r.status_code for r in answers[:2]] == [200, 200]
    ok = [r for r in answers if r.status_code == 200]
    limited = [r for r in answers if r.status_code == 429]
    assert len(ok) == n and len(limited) == 2 * n, [r.status_code for r in answers]
    for r in limited:
        err = r.json()["error"]
        assert err["type"] == "rate_limit_exceeded" and err["code"] == "rate_limit_exceeded"
        assert 1 <= int(r.headers["retry-after"]) <= 60
        assert r.headers["x-ratelimit-remaining-requests"] == "0"
    for r in answers:
        assert r.headers["x-ratelimit-limit-requests"] == str(n)
        assert r.headers["x-ratelimit-reset-requests"].endswith("s")
    # every admitted request saw one fewer left: n-1, ..., 0 across both instances
    assert sorted(int(r.headers["x-ratelimit-remaining-requests"]) for r in ok) == list(range(n))
    assert [int(r.headers["x-ratelimit-remaining-requests"]) for r in answers[:2]] == [n - 1, n - 2]


async def test_tokens_per_minute_reserve_up_front_and_reconcile_at_completion(gateways, pipeline):
    tpm, max_tokens, n = 2400, 100, 30
    key = new_key("tpm-tenant", tpm=tpm, max_streams=-1)  # all n at once: the open-requests limit stays out
    await wait_for_fresh_minute(redis.Redis.from_url(os.environ["TOKENSTREAM_REDIS_URL"]))
    text = "[[repeat 10]] x y"  # 20 words at 50 ms: every answer is still running while the others arrive
    async with httpx.AsyncClient(timeout=60) as http:
        answers = await asyncio.gather(
            *(
                http.post(
                    f"{gateways[i % 2]}/v1/chat/completions",
                    headers=auth_headers(key),
                    json=ask(pipeline.model, text, max_tokens=max_tokens),
                )
                for i in range(n)
            )
        )
        ok = [r for r in answers if r.status_code == 200]
        refused = [r for r in answers if r.status_code == 429]
        cost = tpm - int(
            max(ok, key=lambda r: int(r.headers["x-ratelimit-remaining-tokens"])).headers[
                "x-ratelimit-remaining-tokens"
            ]
        )  # what the first admitted one took
        assert cost > max_tokens
        assert len(ok) == tpm // cost and len(refused) == n - tpm // cost
        reserved = len(ok) * cost
        assert 0.95 * tpm <= reserved <= tpm  # within 5% of the limit, never above it
        assert refused[0].json()["error"]["type"] == "rate_limit_exceeded"
        # at completion the unused reservation comes back: the same request fits again
        used = ok[0].json()["usage"]["total_tokens"]
        assert used < cost
        deadline = time.monotonic() + 20
        while True:
            again = await http.post(
                f"{gateways[0]}/v1/chat/completions",
                headers=auth_headers(key),
                json=ask(pipeline.model, text, max_tokens=max_tokens),
            )
            if again.status_code == 200:
                break
            assert time.monotonic() < deadline, "reservations were never given back"
            await asyncio.sleep(0.3)
    # once every answer is settled, the minute holds exactly the tokens really used
    r = redis.Redis.from_url(os.environ["TOKENSTREAM_REDIS_URL"])
    [bucket] = r.keys(K.rate_bucket("key", K.digest(key)[:16], "tokens") + ":*")
    deadline = time.monotonic() + 20
    while int(r.get(bucket)) != (len(ok) + 1) * used:
        assert time.monotonic() < deadline, (int(r.get(bucket)), len(ok), used)
        await asyncio.sleep(0.2)


async def open_stream(
    stack: contextlib.AsyncExitStack, http: httpx.AsyncClient, url: str, key: str, model: str, text: str
) -> tuple[httpx.Response, str]:
    """A streamed request read by a client until `stack` closes: its response and its request id."""
    r = await stack.enter_async_context(
        http.stream(
            "POST",
            f"{url}/v1/chat/completions",
            headers=auth_headers(key),
            json=ask(model, text, stream=True),
        )
    )
    assert r.status_code == 200, await r.aread()
    events = sse(r)
    event_id, _ = await anext(events)
    reader = asyncio.ensure_future(_read_all(events))
    stack.callback(reader.cancel)
    return r, event_id.split(":")[0]


async def _read_all(events) -> None:
    async for _ in events:
        pass


async def admitted_within(http: httpx.AsyncClient, url: str, key: str, model: str, seconds: float) -> float:
    """Ask until a request is admitted (not a 429 for open requests); seconds it took."""
    started = time.monotonic()
    while True:
        r = await http.post(f"{url}/v1/chat/completions", headers=auth_headers(key), json=ask(model, "short"))
        if r.status_code == 200:
            return time.monotonic() - started
        assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_concurrent_requests", r.text
        assert time.monotonic() - started < seconds, "the slot was never freed"
        await asyncio.sleep(0.2)


async def started_on_pipeline(pipeline: FakePipeline, tenant: str, known: set[str]) -> str:
    """The id of a request of `tenant`, not in `known`, once the pipeline has sent its first token."""
    deadline = time.monotonic() + 15
    while True:
        for rid, s in list(pipeline.served.items()):
            if s.request.tenant == tenant and rid not in known and s.first_token_at:
                return rid
        assert time.monotonic() < deadline, "the request never started"
        await asyncio.sleep(0.1)


async def test_open_requests_per_key_hold_across_two_gateways(gateways, pipeline):
    a, b = gateways
    key = new_key("streams-tenant", max_streams=2)
    long = "[[repeat 200]] s t"  # 400 words at 50 ms: open for 20 s unless ended
    async with httpx.AsyncClient(timeout=60) as http, contextlib.AsyncExitStack() as streams:
        first, first_rid = await open_stream(streams, http, a, key, pipeline.model, long)
        assert first.headers["x-tokenstream-limit-streams"] == "2"
        _, second_rid = await open_stream(streams, http, b, key, pipeline.model, long)
        for url in (a, b):  # a third at once is refused on either instance
            r = await http.post(
                f"{url}/v1/chat/completions", headers=auth_headers(key), json=ask(pipeline.model)
            )
            assert r.status_code == 429, r.text
            err = r.json()["error"]
            assert (err["type"], err["code"]) == ("rate_limit_exceeded", "too_many_concurrent_requests")
            assert r.headers["retry-after"] == "1" and r.headers["x-tokenstream-open-streams"] == "2"
            assert "2 requests open" in err["message"]
        # a cancel on the other instance frees the slot at once; the short requests that take it complete
        # and free it again
        cancel = await http.post(
            f"{b}/v1/chat/completions/chatcmpl-{first_rid}/cancel", headers=auth_headers(key)
        )
        assert cancel.status_code == 200
        await admitted_within(http, b, key, pipeline.model, 10)
        await admitted_within(http, a, key, pipeline.model, 10)
        # a non-streamed client that leaves: its request is cancelled (no resume is possible), its slot freed
        gone = asyncio.create_task(
            http.post(f"{a}/v1/chat/completions", headers=auth_headers(key), json=ask(pipeline.model, long))
        )
        gone_rid = await started_on_pipeline(
            pipeline,
            "streams-tenant",
            {first_rid, second_rid}
            | {rid for rid, s in pipeline.served.items() if s.request.messages[-1].content != long},
        )
        r = await http.post(f"{b}/v1/chat/completions", headers=auth_headers(key), json=ask(pipeline.model))
        assert r.status_code == 429  # both slots held again
        gone.cancel()
        await admitted_within(http, b, key, pipeline.model, 15)
        deadline = time.monotonic() + 10
        while pipeline.served[gone_rid].finish_reason is None:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        assert pipeline.served[gone_rid].finish_reason == "cancelled"
        assert pipeline.served[second_rid].finish_reason is None  # still streaming, still holding its slot


async def test_a_dead_gateways_slots_lapse_with_their_lease(stack, gateways, pipeline, tmp_path):
    a, _ = gateways
    roles = Roles(stack, tmp_path)
    try:
        c, proc = start_gateway(
            roles,
            [pipeline.model],
            index=0,
            count=2,
            env={"TOKENSTREAM_GATEWAY_STREAM_LEASE_S": "3", "TOKENSTREAM_GATEWAY_ADMISSION_BUDGET_S": "1000"},
        )
        key = new_key("lease-tenant", max_streams=1)
        async with httpx.AsyncClient(timeout=60) as http, contextlib.AsyncExitStack() as streams:
            await open_stream(streams, http, c, key, pipeline.model, "[[repeat 200]] s t")
            held_until = time.monotonic() + 8  # more than two leases: renewed while the request is open
            while time.monotonic() < held_until:
                r = await http.post(
                    f"{a}/v1/chat/completions", headers=auth_headers(key), json=ask(pipeline.model)
                )
                assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_concurrent_requests"
                await asyncio.sleep(1.0)  # the other client asks once a second while the lease is renewed
            proc.kill()  # kill -9: nobody renews or releases its slot now
            proc.wait()
            took = await admitted_within(http, a, key, pipeline.model, 15)
            assert took < 3 + 5
    finally:
        roles.stop_all()


async def test_usage_of_a_request_whose_client_left_is_counted_at_its_completion(gateways, pipeline):
    a, b = gateways
    tpm = 100_000
    key = new_key("left-tenant", tpm=tpm)
    key_id = K.digest(key)[:16]
    r = redis.Redis.from_url(os.environ["TOKENSTREAM_REDIS_URL"])
    await wait_for_fresh_minute(r, margin_s=15)
    text = "[[repeat 20]] u v"  # 40 words at 50 ms
    async with httpx.AsyncClient(timeout=60) as http:
        # a stream whose client leaves after two chunks: nobody resumes it within the grace period (30 s
        # here), so the pipeline finishes it with no client attached
        async with http.stream(
            "POST",
            f"{a}/v1/chat/completions",
            headers=auth_headers(key),
            json=ask(pipeline.model, text, stream=True, max_tokens=30),
        ) as resp:
            assert resp.status_code == 200
            events = sse(resp)
            rid = (await anext(events))[0].split(":")[0]
            await anext(events)
        # a non-streamed request whose client leaves: cancelled at once, the worker's partial usage counted
        gone = asyncio.create_task(
            http.post(
                f"{b}/v1/chat/completions",
                headers=auth_headers(key),
                json=ask(pipeline.model, text, max_tokens=30),
            )
        )
        deadline = time.monotonic() + 10
        while not [
            s
            for s in pipeline.served.values()
            if s.request.tenant == "left-tenant" and s.request.request_id != rid and s.first_token_at
        ]:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        gone.cancel()
    deadline = time.monotonic() + 30
    while (
        not all(s.finish_reason for s in pipeline.served.values() if s.request.tenant == "left-tenant")
        or int(r.hget(K.usage(key_id, K.usage_day()), "requests") or b"0") < 2
    ):
        assert time.monotonic() < deadline, r.hgetall(K.usage(key_id, K.usage_day()))
        await asyncio.sleep(0.2)
    served = [s for s in pipeline.served.values() if s.request.tenant == "left-tenant"]
    assert sorted(s.finish_reason for s in served) == ["cancelled", "length"]
    assert pipeline.served[rid].finish_reason == "length"  # finished for nobody, 30 chunks
    usage = {k.decode(): int(v) for k, v in r.hgetall(K.usage(key_id, K.usage_day())).items()}
    prompt = len(text.split())  # the pipeline double counts words
    cancelled = next(s for s in served if s.finish_reason == "cancelled")
    assert usage["requests"] == 2 and usage["prompt"] == 2 * prompt
    partial = usage["completion"] - 30
    assert 0 < partial < 30  # the cancelled one's real output, not its reservation
    # the minute's token bucket holds the real usage of both, their reservations given back
    [bucket] = r.keys(K.rate_bucket("key", key_id, "tokens") + ":*")
    assert int(r.get(bucket)) == usage["prompt"] + usage["completion"], (cancelled.request.request_id, usage)


def test_the_local_key_of_make_run_is_kept_and_replaced_when_revoked(stack, tmp_path):
    from common.config import settings
    from tokenstream.keys_cli import local_key

    settings.cache_clear()
    path = tmp_path / "local-api-key"
    first = local_key(path)
    assert first.startswith(K.KEY_PREFIX) and path.stat().st_mode & 0o777 == 0o600
    assert local_key(path) == first  # reused while valid
    store = KeyStore(os.environ["TOKENSTREAM_REDIS_URL"])
    record = store.get(first)
    assert (record.tenant, record.tier, record.admin) == ("local", "paid", True)
    store.revoke(first)
    second = local_key(path)
    assert second != first and store.get(second).problem() is None
