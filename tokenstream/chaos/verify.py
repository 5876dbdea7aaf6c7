"""Checking what clients received against what the log holds, and that the pipeline drained."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from common import kafka_auth
from common.unblocked import unblocked
from tokenstream.chaos.clients import Outcome


@dataclass
class LogAnswer:
    """One request's answer as ts.tokens holds it, in log order (duplicates folded by seq).

    The answer ends at the first Completion, or at a blocking output verdict (the gateway cuts the
    stream there, as `gateway.framing` does; the worker may write on until it is cancelled). It is
    consistent when the chunks before that end are exactly seq 0..n-1, no seq was written twice
    with different text, and, for a Completion with seq n, no chunk has a seq of n or more (before
    or after it) and the Completion's own text is theirs.
    """

    chunks: dict[int, str] = field(default_factory=dict)
    conflicts: int = 0  # the same seq written twice with different text
    ended: bool = False
    end_seq: int | None = None  # the Completion's seq, or one past the last chunk before a blocking verdict
    finish_reason: str | None = None
    completion_text: str | None = None

    def add(self, event) -> None:
        from schemas import Completion, SafetyVerdict, TokenChunk

        if isinstance(event, TokenChunk):
            if event.seq in self.chunks and self.chunks[event.seq] != event.text:
                self.conflicts += 1
            self.chunks.setdefault(event.seq, event.text)
        elif self.ended:
            return
        elif isinstance(event, Completion):
            self.ended, self.end_seq, self.finish_reason = True, event.seq, event.finish_reason
            self.completion_text = event.text
        elif isinstance(event, SafetyVerdict) and event.blocked:  # a blocked input (screened in parallel):
            cut = max(self.chunks, default=-1) + 1 if event.stage == "output" else 0  # nothing was released
            self.ended, self.end_seq, self.finish_reason = True, cut, "content_filter"

    def text(self) -> str | None:
        """The answer's text, or None when it has not ended or is not consistent (see the class)."""
        if not self.ended or self.end_seq is None or self.conflicts:
            return None
        held = (
            sorted(self.chunks)
            if self.completion_text is not None
            else sorted(s for s in self.chunks if s < self.end_seq)
        )
        if held != list(range(self.end_seq)):
            return None
        text = "".join(self.chunks[s] for s in range(self.end_seq))
        if self.completion_text is not None and self.completion_text != text:
            return None
        return text


async def read_answers(bootstrap: str, rids: set[str], since: float) -> dict[str, LogAnswer]:
    """Every answer of `rids` from ts.tokens, read from `since` (seconds) to the current end."""
    from aiokafka import AIOKafkaConsumer
    from aiokafka.structs import TopicPartition

    from schemas import DecodeError, decode
    from schemas.steps import unpack_all
    from topics import TOKENS

    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        **kafka_auth.client_options(),
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
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
                for record in unpack_all(records):  # a step record: its chunks, in order
                    answer = answers.get((record.key or b"").decode())
                    if answer is not None:
                        try:
                            answer.add(await unblocked(decode, record.value or b"", *TOKENS.events))
                        except DecodeError:
                            pass
                if records and records[-1].offset + 1 >= ends[tp]:
                    remaining.discard(tp)
    finally:
        await consumer.stop()
    return answers


@dataclass
class Verdict:
    """The guarantee, request by request: every admitted request ends, for a client that resumes
    (Last-Event-ID, on any gateway) after a dropped connection or an error event, with [DONE] and
    exactly the text the log holds for it, each position once; what the client held at any error
    event was a prefix of that text; and the log holds one consistent answer (see LogAnswer)."""

    admitted: int = 0
    completed: int = 0
    lost: list[str] = field(default_factory=list)  # the client's text is short of the log's
    differs: list[str] = field(default_factory=list)  # the client's text is not the log's, nor a prefix of it
    inconsistent: list[str] = field(default_factory=list)  # the log does not hold one consistent answer
    unfinished: list[str] = field(default_factory=list)  # no [DONE] within the deadline
    duplicates: list[str] = field(default_factory=list)  # a position delivered twice, or seq conflicts
    interrupted: int = 0  # requests whose client got an error event or lost its connection, and resumed

    @property
    def broken(self) -> bool:
        return bool(self.lost or self.differs or self.inconsistent or self.unfinished or self.duplicates)


def judge(outcomes: list[Outcome], answers: dict[str, LogAnswer]) -> Verdict:
    v = Verdict(admitted=len(outcomes))
    for o in outcomes:
        answer = answers.get(o.rid, LogAnswer())
        logged = answer.text()
        if o.error_texts:
            v.interrupted += 1
        if any("delivered again" in e for e in o.errors) or answer.conflicts:
            v.duplicates.append(o.rid)
        if (answer.ended and logged is None) or (o.done and not answer.ended):
            v.inconsistent.append(o.rid)  # (a [DONE] with no end in the log is as wrong)
        if not o.done:
            v.unfinished.append(o.rid)
            continue
        v.completed += 1
        if logged is None or o.text == logged:
            continue
        if logged.startswith(o.text):
            v.lost.append(o.rid)
        else:
            v.differs.append(o.rid)
    for o in outcomes:  # at an error event the client held part of the answer, never something else
        logged = answers.get(o.rid, LogAnswer()).text()
        if (
            logged is not None
            and o.rid not in v.differs
            and any(not logged.startswith(t) for t in o.error_texts)
        ):
            v.differs.append(o.rid)
    return v


async def drained(
    bootstrap: str, groups: list[tuple[str, str]], timeout: float, behind: list[str] | None = None
) -> dict[str, int]:
    """Wait until every (group, topic) has no lag; returns the lag left per "group topic" at the end, and
    adds each partition still behind to `behind` ("group topic[p] committed/end"), when given."""
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
                break
            await asyncio.sleep(1.0)
    finally:
        await sampler.close()
    if behind is not None:
        behind += [
            f"{load.group} {load.topic}[{p}] {at}/{end}"
            for load in sampler.loads.values()
            for p, (at, end) in sorted(load.behind.items())
        ]
    return left
