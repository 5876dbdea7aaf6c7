"""Intake: requests fetched from the inference topic, checked, and started in the engine.

Rule: every fetched request's offset is tracked from the moment it is taken (so commits stop below it
until it is done), and each request is generated once. A duplicate of one this worker runs or has
completed, or a record that does not decode (dead-lettered), is done at once; one a previous owner
may have started (its partition not settled yet, or below the end offset read when it was assigned)
resumes from the tokens already on the tokens topic, or is done if its Completion is there. The
consumer is paused while the engine's waiting queue is full.
"""

from __future__ import annotations

import asyncio
import time
from functools import partial

from aiokafka.structs import TopicPartition

from common import sealing, tracing
from gpu_workers.grammar import GrammarError
from gpu_workers.sequence import Output, Sequence
from gpu_workers.tool_calls import ToolCallParser
from producers import dead_letter, decode_record
from schemas import DecodeError, InferenceRequest, TraceContext
from schemas.prompt import prompt_ids


class Intake:
    """The inference topic -> `worker.engine` (`worker`: a gpu_workers.service.Worker, its state)."""

    def __init__(self, worker) -> None:
        self.worker = worker

    async def consume(self, stop: asyncio.Event) -> None:
        w = self.worker
        paused = False
        while not stop.is_set():
            room = w.cfg.max_waiting - w.engine.queued
            if room <= 0:
                if not paused:
                    w.consumer.pause(*w.consumer.assignment())
                    paused = True
                await asyncio.sleep(0.02)
                continue
            if paused:
                w.consumer.resume(*w.consumer.assignment())
                paused = False
            batches = await w.consumer.getmany(timeout_ms=100, max_records=room)
            # The epochs as of these records, taken after the fetch: getmany waits out a rebalance
            # and returns records of the assignment it ends with, from positions already moved past
            # them; dropped here as "revoked meanwhile", those of a partition this worker got back
            # were never read again (its requests stalled until the next rebalance).
            epochs = dict(w.epoch)
            assignment = w.consumer.assignment()
            fetched = [(tp, rec) for tp, records in batches.items() if tp in assignment for rec in records]
            if fetched:
                await self.accept(fetched, epochs)
            w.work.set()

    async def accept(self, fetched: list, epochs: dict[TopicPartition, int]) -> None:
        """Start the fetched requests; those a previous owner may have started resume where it stopped,
        all looked up in one read of the tokens topic (a takeover of a whole batch costs one scan)."""
        w = self.worker
        taken: list[tuple[TopicPartition, int, InferenceRequest]] = []
        parents: dict[str, TraceContext | None] = {}
        seen: set[str] = set()
        for tp, rec in fetched:
            if w.epoch.get(tp, 0) != epochs.get(tp, 0):
                continue  # revoked meanwhile
            if w.tracker.tracks(tp, rec.offset):
                continue  # read again from the commit after a rebalance that kept its partition: running
            w.tracker.add(tp, rec.offset)
            try:  # (the keyring's store away: held here, up to the Redis outage budget)
                request = await sealing.patiently(partial(decode_record, rec, w.spec), "worker")
            except DecodeError as exc:
                await dead_letter(w.producer, rec, exc, group=w.group)
                await w.publisher.done(tp, rec.offset)
                continue
            rid = request.request_id
            if rid in w.owned or rid in w.completed or rid in seen:
                # a duplicate of a request this worker runs or has completed: done at once (a running
                # original's offset holds the partition's commits back until it completes)
                await w.publisher.done(tp, rec.offset)
                continue
            seen.add(rid)
            parents[rid] = TraceContext.from_headers(rec.headers)
            taken.append((tp, rec.offset, request))
        resumed = [
            (r.request_id, r.reply_partition, r.created_at - w.cfg.takeover_margin_s)
            for tp, offset, r in taken
            if tp not in w.settled or offset < w.takeover_below.get(tp, -1)
        ]
        emitted = await w.tokens.emitted(resumed) if resumed else {}
        for tp, offset, request in taken:
            if not w.tracker.tracks(tp, offset):
                # its partition was given up during the read: the new owner takes it from the commit. (One
                # revoked meanwhile but held, or kept by the assignment, goes on: a kept partition is not
                # read again from its commit for what this worker tracks, so skipping would lose it.)
                continue
            s = request.sampling
            ids = prompt_ids(w.engine.tokenizer, request.messages, request.output)
            seq = Sequence(
                request.request_id,
                ids,
                max_tokens=s.max_tokens,
                temperature=s.temperature,
                top_p=s.top_p,
                seed=s.seed,
                stop=list(s.stop),
                presence_penalty=s.presence_penalty,
                frequency_penalty=s.frequency_penalty,
                logit_bias=dict(s.logit_bias),
                logprobs=s.logprobs,
                arrival=time.time(),
                tag=(tp, offset),
                priority=request.priority,
                tenant=request.tenant,
                # the request's own stream interval, else the deployment's (gpu_workers/streaming.py)
                stream_interval=s.stream_interval or w.cfg.stream_interval,
                stream_interval_ms=w.cfg.stream_interval_ms
                if s.stream_interval_ms is None
                else s.stream_interval_ms,
            )
            before = emitted.get(request.request_id)
            if before is not None and before.completion is not None:
                await w.publisher.done(tp, offset)
                continue
            if before is not None and before.chunks:
                w.metrics.takeovers.labels(w.cfg.model).inc()
                w.resuming[request.request_id] = time.monotonic()
                seq.generated = before.token_ids
                seq.resumed = len(seq.generated)
                seq.emitted_text = before.text
                seq.next_seq = len(before.chunks)
            w.owned[request.request_id] = (tp, offset, request, seq)
            w.chunks_written[request.request_id] = seq.next_seq  # a takeover's: what the log holds
            w.spans[request.request_id] = tracing.hop(
                f"chat {request.model}",
                parents.get(request.request_id),
                role="worker",
                kind="internal",
                attributes={
                    **tracing.request_attributes(request),
                    **tracing.record_attributes(tp.topic, tp.partition, offset, w.group),
                    "tokenstream.worker_id": w.worker_id,
                    "tokenstream.resumed_tokens": seq.resumed,
                },
            )
            if request.output.callable_tools:
                parser = w.parsers[request.request_id] = ToolCallParser(request.request_id)
                parser.feed(seq.emitted_text)  # a request taken over: the calls emitted so far
            if request.output.constrained:  # compiled off the step loop; meanwhile other requests run
                task = asyncio.create_task(self._constrain(request, seq))
                w.pending_completions.add(task)
                task.add_done_callback(w.pending_completions.discard)
                continue
            w.engine.add(seq)

    async def _constrain(self, request: InferenceRequest, seq: Sequence) -> None:
        """Give `seq` its grammar state, then to the engine; a grammar that fails ends it with an error."""
        w = self.worker
        try:
            seq.grammar = await w.grammars.state_for(request.output, seq.generated)
        except GrammarError as exc:
            async with w.step_lock:
                if w.owned.get(request.request_id, (None,) * 4)[3] is seq:
                    seq.finished_at = time.time()
                    await w.publisher.publish(
                        [
                            Output(
                                seq,
                                finish_reason="error",
                                completion_seq=seq.next_seq,
                                error=f"output grammar: {exc}",
                            )
                        ]
                    )
            return
        if w.owned.get(request.request_id, (None,) * 4)[3] is seq:  # not revoked meanwhile
            w.engine.add(seq)
            w.work.set()
