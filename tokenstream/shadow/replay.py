"""What was served in a time range, replayed to a candidate model that answers no client.

`recorded` reads the InferenceRequests a model's worker group served between two times from its
inference topic (the prompt as it was rendered, with its sampling), and each one's Completion from
ts.tokens. `replay` writes a copy of each to the candidate's inference topic: a new request id,
`shadow_of` naming the served request, a priority below every tier (live requests on the same
workers go first), at most `rate` a second and `in_flight` unanswered at once; the candidate's
workers write only its Completion, to ts.shadow.answers, which `replay` reads back.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from aiokafka.structs import TopicPartition

from audit.scan import merged, spans_between
from common.unblocked import unblocked
from producers import decode_record, publish, start_consumer, start_producer
from schemas import Completion, DecodeError, InferenceRequest
from schemas.ids import new_request_id
from topics import SHADOW_ANSWERS, TOKENS, inference_topic

SHADOW_PRIORITY = -2  # below every tier and below flex (-1): live requests are admitted first
ANSWERED = ("stop", "length", "tool_calls")  # what counts as an answer to compare (not errors, cancels)


@dataclass
class Pair:
    """A served request, what it was answered, and the candidate's answer to its copy."""

    request: InferenceRequest
    served: Completion
    shadow_id: str = ""
    shadow: Completion | None = None


async def recorded(
    bootstrap: str,
    model: str,
    since_ms: int,
    until_ms: int,
    tenant: str | None = None,
    limit: int | None = None,
) -> list[Pair]:
    """The requests `model` served between the two times (of `tenant`, or every tenant) that ended
    with an answer, each with its Completion, in the order they were written (at most `limit`)."""
    consumer = await start_consumer(group=None, bootstrap=bootstrap, from_beginning=True)
    try:
        spec = inference_topic(model)
        requests: dict[str, InferenceRequest] = {}
        tps = [TopicPartition(spec.name, p) for p in range(spec.partitions)]
        async for batch in merged(consumer, await spans_between(consumer, tps, since_ms, until_ms), {}):
            for record in batch:
                try:
                    request = await unblocked(decode_record, record, spec)
                except DecodeError:
                    continue
                if request.shadow_of or (tenant and request.tenant != tenant):
                    continue  # another evaluation's replay, another tenant's
                requests.setdefault(request.request_id, request)  # a duplicate (at-least-once) once
        if limit is not None:
            requests = dict(list(requests.items())[:limit])
        answers: dict[str, Completion] = {}
        wanted = {rid.encode() for rid in requests}
        tps = sorted({TopicPartition(TOKENS.name, r.reply_partition) for r in requests.values()})
        spans = await spans_between(consumer, tps, since_ms, None)
        async for batch in merged(consumer, spans, {}, unpack=False):  # Completions only: never in a step
            for record in batch:
                if record.key not in wanted:
                    continue
                try:
                    event = await unblocked(decode_record, record, TOKENS)
                except DecodeError:
                    continue
                if isinstance(event, Completion):
                    answers.setdefault(event.request_id, event)
        return [
            Pair(r, answers[rid])
            for rid, r in requests.items()
            if rid in answers and answers[rid].finish_reason in ANSWERED
        ]
    finally:
        await consumer.stop()


def shadow_copy(request: InferenceRequest, candidate: str, partitions: int) -> InferenceRequest:
    """The copy of `request` the candidate answers: its own id (made now, so a replay never meets the
    served request's state anywhere), the candidate as its model, `shadow_of` the served id."""
    now = time.time()
    return msgspec.structs.replace(
        request,
        request_id=new_request_id(request.reply_partition % partitions, now),
        model=candidate,
        shadow_of=request.request_id,
        priority=SHADOW_PRIORITY,
        created_at=now,
        admitted_at=now,
    )


async def replay(
    bootstrap: str,
    candidate: str,
    pairs: list[Pair],
    *,
    rate: float = 2.0,
    in_flight: int = 4,
    timeout_s: float = 600.0,
    progress: Callable[[int, int], None] = lambda done, total: None,
) -> None:
    """Send each pair's copy to `candidate` and wait for its answers (fills `shadow_id`, `shadow`)."""
    spec = inference_topic(candidate)
    producer = await start_producer(bootstrap)
    consumer = await start_consumer(group=None, bootstrap=bootstrap)
    try:
        tps = [TopicPartition(SHADOW_ANSWERS.name, p) for p in range(SHADOW_ANSWERS.partitions)]
        consumer.assign(tps)
        await consumer.seek_to_end(*tps)
        for tp in tps:
            await consumer.position(tp)  # resolved now: no answer written after this is missed
        by_id = {}
        collecting = asyncio.create_task(_collect(consumer, by_id, pairs))
        deadline = time.monotonic() + timeout_s
        for pair in pairs:
            while sum(1 for p in by_id.values() if p.shadow is None) >= in_flight:
                _check(collecting, deadline, by_id)
                await asyncio.sleep(0.05)
            copy = shadow_copy(pair.request, candidate, TOKENS.partitions)
            pair.shadow_id = copy.request_id
            by_id[copy.request_id] = pair
            await publish(producer, spec, copy, key=copy.request_id)
            progress(sum(1 for p in by_id.values() if p.shadow is not None), len(pairs))
            await asyncio.sleep(1.0 / rate)
        while any(p.shadow is None for p in pairs):
            _check(collecting, deadline, by_id)
            progress(sum(1 for p in pairs if p.shadow is not None), len(pairs))
            await asyncio.sleep(0.2)
        collecting.cancel()
        await asyncio.gather(collecting, return_exceptions=True)
    finally:
        await consumer.stop()
        await producer.stop()


def _check(collecting: asyncio.Task, deadline: float, by_id: dict) -> None:
    if collecting.done():
        collecting.result()  # raises what ended it
    if time.monotonic() > deadline:
        missing = sum(1 for p in by_id.values() if p.shadow is None)
        raise TimeoutError(
            f"{missing} replayed requests unanswered: is a worker serving the candidate "
            f"(tokenstream worker --model CANDIDATE)?"
        )


async def _collect(consumer, by_id: dict[str, Pair], pairs: list[Pair]) -> None:
    """Every Completion on ts.shadow.answers of a copy sent here (the first of duplicates)."""
    while True:
        for records in (await consumer.getmany(timeout_ms=500)).values():
            for record in records:
                try:
                    event = await unblocked(decode_record, record, SHADOW_ANSWERS)
                except DecodeError:
                    continue
                pair = by_id.get(event.request_id)
                if pair is not None and pair.shadow is None:
                    pair.shadow = event
