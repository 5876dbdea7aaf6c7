"""Publishing: a step's outputs -> the tokens topic; an acknowledged Completion -> its offset committed.

Rule: a request's offset is committed only after its Completion is acknowledged by the broker
(acks=all), and only up to the lowest offset still in flight on that partition (gpu_workers/offsets.py).
A request's first record on the tokens topic has its offset noted in the durable Redis once acknowledged
(`note_first`, common/first_records.py): resumes and takeovers seek there.
Outputs of a request its worker no longer owns (given up, or taken over afresh) are dropped; those of a
held partition wait for the next assignment (gpu_workers/rebalance.py). A shadow replay's answer is its
Completion alone, on the shadow answers topic. Events are queued for the producer under `publish_lock`,
so that a revocation can flush everything a publish under way queued.
A step's chunks go out as one step record per reply partition (schemas/steps.py, `Steps`), written
before any Completion on that partition, so a request's Completion follows its last chunk.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from aiokafka.errors import KafkaError
from aiokafka.structs import TopicPartition

from common import tracing
from common.first_records import starts_stream, verdict_in_band
from common.unblocked import unblocked
from gpu_workers.logits import TokenTexts
from gpu_workers.sequence import Output
from producers import publish
from schemas import Completion, Timings, TokenChunk, ToolCall, Usage, encode
from schemas.headers import EVENT_TYPE
from schemas.steps import STEP_HEADERS, STEP_MAX_BYTES, StepEntry, entry, step_value
from topics import SHADOW_ANSWERS, TOKENS, TOOL_CALLS

COMPLETED_KEPT = 10_000  # request ids remembered as done, to drop a duplicate of one

log = logging.getLogger(__name__)


class Publisher:
    """Outputs -> Kafka, and the commits, for `worker` (a gpu_workers.service.Worker, its state)."""

    def __init__(self, worker) -> None:
        self.worker = worker
        self.token_texts = TokenTexts(worker.engine.tokenizer)  # for reported log probabilities
        self.commit_lock = asyncio.Lock()

    async def publish(self, outputs: list[Output]) -> None:
        async with self.worker.publish_lock:
            await self.publish_locked(outputs)

    async def publish_locked(self, outputs: list[Output]) -> None:
        w = self.worker
        steps = Steps(self, w.producer) if w.cfg.step_records and outputs else None
        for out in outputs:
            rid = out.seq.request_id
            owned = w.owned.get(rid)
            if owned is None or owned[3] is not out.seq:
                continue  # aborted: its partition belongs to another worker now (or it was taken over afresh)
            tp, offset, request, _ = owned
            if w.handover.holds(tp):
                w.handover.wait(tp, out)  # revoked: written only if the next assignment keeps it
                continue
            parser = w.parsers.get(rid)
            span = w.spans.get(rid)
            trace = span.trace if span is not None else None
            # every chunk names the span only while spans are exported (its children are the output
            # checks): otherwise the header would add about 70 bytes to each record of ts.tokens
            chunk_trace = trace if span is not None and span.span is not None else None
            if out.chunk_seq is not None:
                text, calls, raw = out.text, [], None
                if parser is not None:  # the model's text -> content and call deltas
                    (text, calls), raw = parser.feed(out.text), out.text
                chunk = TokenChunk(
                    request_id=rid,
                    conversation_id=request.conversation_id,
                    tenant=request.tenant,
                    seq=out.chunk_seq,
                    text=text,
                    token_ids=out.token_ids,
                    tool_calls=calls,
                    raw=raw,
                    worker_id=w.worker_id,
                    logprobs=self.token_texts.report(out.logprobs) if out.logprobs else [],
                )
                if request.shadow_of:  # a shadow replay's answer is its Completion alone
                    pass
                elif steps is not None:
                    value = await unblocked(encode, chunk)  # a key not held: fetched in a thread
                    headers = chunk_trace.headers() if chunk_trace is not None else None
                    await steps.add(request, out.chunk_seq, entry(rid, value, headers), len(value))
                else:
                    ack = await publish(
                        w.producer,
                        TOKENS,
                        chunk,
                        partition=request.reply_partition,
                        wait=False,
                        trace=chunk_trace,
                    )
                    self.note_first(request, out.chunk_seq, ack)
                w.chunks_written[rid] = out.chunk_seq + 1
                if rid in w.resuming:  # where a takeover's time goes: taken in -> its next token out
                    log.info(
                        "worker %s resumed %s at chunk %d, %.2f s after taking it over",
                        w.worker_id,
                        rid,
                        out.chunk_seq,
                        time.monotonic() - w.resuming.pop(rid),
                    )
            if out.finish_reason is not None and w.owned.get(rid) is owned:  # not given up meanwhile
                seq = out.seq
                reason, error = out.finish_reason, out.error
                if seq.grammar is not None and seq.grammar.error is not None and reason == "stop":
                    reason, error = "error", seq.grammar.error
                if parser is not None:
                    w.parsers.pop(rid, None)
                    if parser.calls and reason == "stop":
                        reason = "tool_calls"
                    for call in [] if request.shadow_of else parser.calls:  # the audit trail (by call_id)
                        await publish(
                            w.producer,
                            TOOL_CALLS,
                            ToolCall(
                                request_id=rid,
                                conversation_id=request.conversation_id,
                                tenant=request.tenant,
                                call_id=call.id,
                                name=call.function.name,
                                arguments=call.function.arguments,
                            ),
                            wait=False,
                            trace=trace,
                        )
                queue, prefill, decode = seq.timings()
                done = Completion(
                    request_id=rid,
                    conversation_id=request.conversation_id,
                    tenant=request.tenant,
                    seq=out.completion_seq,
                    finish_reason=reason,
                    error=error,
                    text=seq.emitted_text if parser is None else parser.text,
                    tool_calls=[] if parser is None else parser.calls,
                    usage=Usage(
                        prompt_tokens=len(seq.prompt_ids),
                        completion_tokens=len(seq.generated),
                        cached_tokens=seq.cached_tokens,
                        cache_write_tokens=seq.cache_written,
                    ),
                    timings=Timings(
                        queue_s=queue,
                        prefill_s=prefill,
                        decode_s=decode,
                        pipeline_s=max(0.0, seq.arrival - (request.admitted_at or request.created_at)),
                    ),
                    dropped_messages=request.dropped_messages,
                    worker_id=w.worker_id,
                    model=w.cfg.model,
                    tier=request.tier,
                    moderated=request.output.moderated,
                )
                if steps is not None:  # its last chunk first
                    await steps.flush(request.reply_partition)
                headers = [(EVENT_TYPE, b"completion"), *(trace.headers() if trace else ())]
                value = await unblocked(encode, done)  # a key not held: fetched in a thread, not on the loop
                if request.shadow_of:  # never a client's: apart from ts.tokens, for `tokenstream shadow`
                    future = await w.producer.send(
                        SHADOW_ANSWERS.name, value, key=rid.encode(), headers=headers
                    )
                else:
                    future = await w.producer.send(
                        TOKENS.name,
                        value,
                        key=rid.encode(),
                        partition=request.reply_partition,
                        headers=headers,
                    )
                    self.note_first(request, out.completion_seq, future)
                if span is not None and span.span is not None:
                    span.set(tracing.completion_attributes(done, request.model))
                    if reason == "error":
                        span.fail(error or "error")
                self.end_span(rid)
                if (
                    reason in ("stop", "length") and not request.shadow_of
                ):  # its messages and answer: in the KV cache
                    await w.announcer.held(request, done.text)
                w.owned.pop(rid, None)
                w.chunks_written.pop(rid, None)
                w.resuming.pop(rid, None)
                w.completed[rid] = None
                while len(w.completed) > COMPLETED_KEPT:
                    w.completed.popitem(last=False)
                task = asyncio.create_task(self._after_delivery(future, tp, offset))
                w.pending_completions.add(task)
                task.add_done_callback(w.pending_completions.discard)
        if steps is not None:
            await steps.flush_all()

    def note_first(self, request, seq: int | None, ack) -> None:
        """The request's first record of this worker's (its chunk 0, or a Completion at seq 0): where it
        lies goes to the durable Redis on its ack, for resumes and takeovers (common/first_records.py)."""
        first = getattr(getattr(self.worker, "tokens", None), "first", None)
        if first is not None and starts_stream(seq):
            verdict_first = verdict_in_band(request.screening, request.output.moderated)
            first.note(request.request_id, ack, verdict_first=verdict_first)

    def end_span(self, rid: str, attributes: dict | None = None) -> None:
        span = self.worker.spans.pop(rid, None)
        if span is not None:
            span.set(attributes or {})
            span.end()

    async def _after_delivery(self, future, tp: TopicPartition, offset: int) -> None:
        await future  # acknowledged by the broker (acks=all): now the request may be committed
        await self.done(tp, offset)

    async def done(self, tp: TopicPartition, offset: int) -> None:
        self.worker.tracker.done(tp, offset)
        await self.commit()

    async def commit(self) -> None:
        w = self.worker
        async with self.commit_lock:
            assignment = w.consumer.assignment()
            offsets = {tp: off for tp, off in w.tracker.committable().items() if tp in assignment}
            if not offsets:
                return
            try:
                await w.consumer.commit(offsets)
            except (KafkaError, AssertionError) as exc:  # rebalancing: the new owner redoes the rest
                log.warning("commit of %s failed: %s", offsets, exc)
                return
            w.tracker.mark_committed(offsets)
            w.metrics.commits.labels(w.cfg.model).inc()


@dataclass(slots=True)
class _Step:
    """One reply partition's step record in the making."""

    entries: list[StepEntry] = field(default_factory=list)
    firsts: list[tuple[object, int]] = field(default_factory=list)  # (request, seq) of chunks that start
    size: int = 0  # bytes of the entries' values


class Steps:
    """The step records of one publish: per reply partition, the entries of its chunks, sent as one
    record when flushed (or sooner, past STEP_MAX_BYTES), each chunk 0's place then noted."""

    def __init__(self, publisher: Publisher, producer) -> None:
        self.publisher, self.producer = publisher, producer
        self.pending: dict[int, _Step] = {}

    async def add(self, request, seq: int, item: StepEntry, size: int) -> None:
        step = self.pending.setdefault(request.reply_partition, _Step())
        step.entries.append(item)
        if starts_stream(seq):
            step.firsts.append((request, seq))
        step.size += size
        if step.size >= STEP_MAX_BYTES:
            await self.flush(request.reply_partition)

    async def flush(self, partition: int) -> None:
        step = self.pending.pop(partition, None)
        if step is None:
            return
        ack = await self.producer.send(
            TOKENS.name, step_value(step.entries), partition=partition, headers=STEP_HEADERS
        )
        for request, seq in step.firsts:
            self.publisher.note_first(request, seq, ack)

    async def flush_all(self) -> None:
        for partition in list(self.pending):
            await self.flush(partition)
