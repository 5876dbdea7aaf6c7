"""`tokenstream usage`: a tenant's tokens from the log (transcripts, cache hits), per day, model and tier,
reconciled with the live counters in Redis, a difference named with the request that causes it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from producers import publish, start_producer
from schemas import ChatMessage, Completion, Transcript
from schemas import keys as K
from schemas.tokens import Usage
from tokenstream.keys import KeyStore
from topics import TOKENS, TRANSCRIPTS
from topics.admin import apply
from topics.registry import all_topics


def _answer(
    rid: str, tenant: str, prompt: int, completion: int, cached: int = 0, worker: str = "w1"
) -> Completion:
    return Completion(
        request_id=rid,
        conversation_id=f"c-{rid}",
        tenant=tenant,
        seq=1,
        finish_reason="stop",
        text="four",
        usage=Usage(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached),
        worker_id=worker,
        model="usage-model",
        tier="paid",
    )


@pytest.mark.asyncio
async def test_usage_from_the_log_reconciles_with_the_live_counters(stack, bootstrap, unique):
    tenant = f"usage-{unique}"
    await apply(all_topics(["usage-model"]), bootstrap)
    answers = [
        _answer(f"u1-{unique}", tenant, 20, 5, cached=8),
        _answer(f"u2-{unique}", tenant, 30, 7),
        _answer(f"other-{unique}", f"other-{unique}", 99, 99),
    ]
    hit = _answer(f"u3-{unique}", tenant, 20, 5, worker=f"cache:u1-{unique}")
    producer = await start_producer(bootstrap)
    try:
        for done in answers:
            await publish(
                producer,
                TRANSCRIPTS,
                Transcript(
                    request_id=done.request_id,
                    conversation_id=done.conversation_id,
                    tenant=done.tenant,
                    question=[ChatMessage(role="user", content="2+2?")],
                    answer=done,
                ),
                key=done.conversation_id,
            )
        await publish(
            producer,
            TRANSCRIPTS,
            Transcript(  # the same transcript again (at-least-once)
                request_id=answers[0].request_id,
                conversation_id=answers[0].conversation_id,
                tenant=tenant,
                answer=answers[0],
            ),
            key=answers[0].conversation_id,
        )
        await publish(producer, TOKENS, hit, key=hit.request_id, partition=3)
    finally:
        await producer.stop()
    # The live counters as a gateway keeps them: u2 was never counted (Redis away at its completion).
    store = KeyStore(os.environ["TOKENSTREAM_REDIS_URL"])
    _, key = store.create(tenant, tier="paid")
    day = K.usage_day()
    store.r.hset(
        K.usage(key.key_id, day), mapping={"requests": 2, "prompt": 40, "completion": 10, "cached": 25}
    )
    for rid in (f"u1-{unique}", f"u3-{unique}"):
        store.r.set(K.usage_settled(rid), 1, ex=86400)

    out = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "tokenstream.cli", "usage", "--tenant", tenant, "--since", "1h"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **stack.environment(), "COLUMNS": "400"},
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    [logged] = [ln for ln in lines if "usage-model" in ln]
    cells = [c.strip() for c in logged.split("│") if c.strip()]
    # requests 3 (the repeated transcript once), prompt 70, prefix-cached 8, completion 17, 1 hit of 25 tokens
    assert cells[1:] == ["usage-model", "paid", "3", "70", "8", "17", "1", "25"], cells
    rows = {
        c[1]: c
        for c in (
            [x.strip() for x in ln.split("│") if x.strip()]
            for ln in lines
            if day in ln and any(f" {f} " in ln for f in ("requests", "prompt", "completion", "cached"))
        )
    }
    assert rows["requests"][2:5] == ["3", "2", "+1"]
    for name, missed in (("requests", "+1"), ("prompt", "+30"), ("completion", "+7")):
        why = rows[name][5]
        assert (
            f"u2-{unique}" in why and f"u1-{unique}" not in why and f"{missed} (all of the difference)" in why
        )
    assert rows["cached"][2:5] == ["25", "25", "+0"] and rows["cached"][5] == "equal"
