"""Checking what clients received against what the log holds, and that the pipeline drained."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from tokenstream.chaos.clients import Outcome


@dataclass
class LogAnswer:
    """One request's answer as ts.tokens holds it (duplicates folded by seq)."""

    chunks: dict[int, str] = field(default_factory=dict)
    conflicts: int = 0  # the same seq written twice with different text
    completion_seq: int | None = None
    finish_reason: str | None = None

    def text(self) -> str | None:
        """The answer's text, or None when the chunks before the completion are not contiguous."""
        if self.completion_seq is None:
            return None
        if sorted(self.chunks) != list(range(self.completion_seq)):
            return None
        return "".join(self.chunks[s] for s in range(self.completion_seq))


async def read_answers(bootstrap: str, rids: set[str], since: float) -> dict[str, LogAnswer]:
    """Every answer of `rids` from ts.tokens, read from `since` (seconds) to the current end."""
    from aiokafka import AIOKafkaConsumer
    from aiokafka.structs import TopicPartition

    from schemas import Completion, DecodeError, TokenChunk, decode
    from topics import TOKENS

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                                auto_offset_reset="earliest")
    await consumer.start()
    answers = {rid: LogAnswer() for rid in rids}
    try:
        tps = [TopicPartition(TOKENS.name, p) for p in range(TOKENS.partitions)]
        consumer.assign(tps)
        ends = await consumer.end_offsets(tps)
        starts = await consumer.offsets_for_times({tp: int(since * 1000) for tp in tps})
        for tp in tps:
            consumer.seek(tp, starts[tp].offset if starts[tp] else ends[tp])
        remaining = {tp for tp in tps if await consumer.position(tp) < ends[tp]}
        while remaining:
            for tp, records in (await consumer.getmany(*remaining, timeout_ms=500)).items():
                for record in records:
                    answer = answers.get((record.key or b"").decode())
                    if answer is not None:
                        try:
                            event = decode(record.value or b"", *TOKENS.events)
                        except DecodeError:
                            continue
                        if isinstance(event, TokenChunk):
                            if event.seq in answer.chunks and answer.chunks[event.seq] != event.text:
                                answer.conflicts += 1
                            answer.chunks.setdefault(event.seq, event.text)
                        elif isinstance(event, Completion) and answer.completion_seq is None:
                            answer.completion_seq, answer.finish_reason = event.seq, event.finish_reason
                    if record.offset + 1 >= ends[tp]:
                        remaining.discard(tp)
    finally:
        await consumer.stop()
    return answers


@dataclass
class Verdict:
    admitted: int = 0
    completed: int = 0
    lost: list[str] = field(default_factory=list)        # the client's text differs from the log's
    unfinished: list[str] = field(default_factory=list)  # no [DONE] within the deadline
    duplicates: list[str] = field(default_factory=list)  # a frame delivered twice, or seq conflicts


def judge(outcomes: list[Outcome], answers: dict[str, LogAnswer]) -> Verdict:
    v = Verdict(admitted=len(outcomes))
    for o in outcomes:
        answer = answers.get(o.rid, LogAnswer())
        if any("delivered again" in e for e in o.errors) or answer.conflicts:
            v.duplicates.append(o.rid)
        if not o.done:
            v.unfinished.append(o.rid)
            continue
        v.completed += 1
        if answer.text() != o.text:
            v.lost.append(o.rid)
    return v


async def drained(bootstrap: str, groups: list[tuple[str, str]], timeout: float) -> dict[str, int]:
    """Wait until every (group, topic) has no lag; returns the lag left per "group topic" at the end."""
    from producers.lag import LagSampler

    sampler = LagSampler(bootstrap)
    deadline = time.monotonic() + timeout
    left: dict[str, int] = {}
    try:
        while True:
            left = {}
            for group, topic in groups:
                try:
                    left[f"{group} {topic}"] = (await sampler.sample(group, topic)).lag
                except Exception:  # noqa: BLE001 - the broker may still be settling
                    left[f"{group} {topic}"] = -1
            if not any(left.values()) or time.monotonic() > deadline:
                return left
            await asyncio.sleep(1.0)
    finally:
        await sampler.close()
