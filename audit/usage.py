"""Usage an invoice can stand on: a tenant's tokens as the log recorded them (`tokenstream usage`).

Every answered request leaves its Transcript on ts.audit.transcripts (kept a year), whose Completion
says the model that answered, the request's tier and its usage: prompt tokens, the prompt tokens
the worker's prefix cache served, completion tokens. An answer served from the gateway's exact cache
has no transcript; its Completion (worker "cache:<the request it repeats>") is on ts.tokens, which
keeps a day. Both are summed per UTC day (the Completion's time), model and tier.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from aiokafka.structs import TopicPartition

from audit.scan import merged, spans_between
from common import sealing
from producers import decode_record, start_consumer
from schemas import Completion, DecodeError, Transcript
from topics import TOKENS, TRANSCRIPTS

CACHE_WORKER = "cache:"


@dataclass
class Tally:
    requests: int = 0
    prompt: int = 0
    prefix_cached: int = 0  # prompt tokens the worker's prefix cache served
    completion: int = 0
    cache_hits: int = 0  # answers served from the exact cache
    cache_hit_tokens: int = 0  # their prompt + completion tokens (what the live counters call cached)
    #: each request's share: {"requests": 1, "prompt": .., "completion": .., "cache_hit_tokens": ..}
    shares: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def request_ids(self) -> set[str]:
        return set(self.shares)

    def add(self, done: Completion) -> None:
        if done.request_id in self.shares:
            return  # a transcript read twice (at-least-once) counts once
        hit = done.worker_id.startswith(CACHE_WORKER)
        self.shares[done.request_id] = {
            "requests": 1,
            "prompt": done.usage.prompt_tokens,
            "completion": done.usage.completion_tokens,
            "cache_hit_tokens": done.usage.prompt_tokens + done.usage.completion_tokens if hit else 0,
        }
        self.requests += 1
        self.prompt += done.usage.prompt_tokens
        self.completion += done.usage.completion_tokens
        if done.worker_id.startswith(CACHE_WORKER):
            self.cache_hits += 1
            self.cache_hit_tokens += done.usage.prompt_tokens + done.usage.completion_tokens
        else:
            self.prefix_cached += done.usage.cached_tokens


def day_of(seconds: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(seconds))


async def from_log(
    bootstrap: str, tenant: str, since_ms: int, until_ms: int
) -> dict[tuple[str, str, str], Tally]:
    """(day, model, tier) -> Tally of `tenant`'s answers between since and until (by record time)."""
    out: dict[tuple[str, str, str], Tally] = {}
    consumer = await start_consumer(group=None, bootstrap=bootstrap, from_beginning=True)
    try:
        tps = [TopicPartition(s.name, p) for s in (TRANSCRIPTS, TOKENS) for p in range(s.partitions)]
        spans = await spans_between(consumer, tps, since_ms, until_ms)
        specs = {TRANSCRIPTS.name: TRANSCRIPTS, TOKENS.name: TOKENS}
        async for batch in merged(consumer, spans, {TRANSCRIPTS.name: 0, TOKENS.name: 1}):
            await sealing.hold_keys(batch)  # the keys it lacks fetched off the loop
            for record in batch:
                try:
                    event = decode_record(record, specs[record.topic])
                except DecodeError:
                    continue
                done = event.answer if isinstance(event, Transcript) else event
                if not isinstance(done, Completion) or done.tenant != tenant:
                    continue
                if isinstance(event, Completion) and not done.worker_id.startswith(CACHE_WORKER):
                    continue  # a worker's answer: counted from its transcript
                key = (day_of(done.created_at), done.model or "(none)", done.tier or "(none)")
                out.setdefault(key, Tally()).add(done)
    finally:
        await consumer.stop()
    return out


def by_day(tallies: dict[tuple[str, str, str], Tally]) -> dict[str, Tally]:
    days: dict[str, Tally] = {}
    for (day, _, _), t in tallies.items():
        d = days.setdefault(day, Tally())
        for name in ("requests", "prompt", "prefix_cached", "completion", "cache_hits", "cache_hit_tokens"):
            setattr(d, name, getattr(d, name) + getattr(t, name))
        d.shares.update(t.shares)
    return days
