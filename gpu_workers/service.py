"""The Kafka side of a worker: consume requests, feed the engine, publish tokens, commit, cancel, take over.

    inference topic (group worker.<model>) -> Engine -> tokens topic, partition reply_partition
    control topic (group-less, latest)      -> Engine.cancel

Guarantee: a request's offset is committed only after its Completion is acknowledged by the
broker (acks=all), and only up to the lowest offset still in flight on that partition. A
request re-delivered after a rebalance is resumed from the tokens already on the tokens topic.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections import OrderedDict, deque

from aiokafka import ConsumerRebalanceListener
from aiokafka.errors import KafkaError
from aiokafka.structs import TopicPartition

from common import sealing, tracing
from gpu_workers.announce import Announcer
from gpu_workers.backend import Backend
from gpu_workers.config import WorkerConfig
from gpu_workers.grammar import GrammarError, Grammars
from gpu_workers.handover import Handover
from gpu_workers.health import WorkerHealth
from gpu_workers.logits import TokenTexts
from gpu_workers.metrics import WorkerMetrics
from gpu_workers.offsets import OffsetTracker
from gpu_workers.recovery import TokenLog
from gpu_workers.sequence import Output, Sequence
from gpu_workers.tool_calls import ToolCallParser
from gpu_workers.torch_thread import torch_thread
from producers import dead_letter, decode_record, publish, start_consumer, start_producer
from producers.membership import GroupWatch, member_client_id
from producers.sticky import StickyAssignor, assignor_strategy, generation_of
from schemas import (
    Cancel,
    Completion,
    DecodeError,
    InferenceRequest,
    Timings,
    TokenChunk,
    ToolCall,
    TraceContext,
    Usage,
    encode,
)
from schemas.headers import EVENT_TYPE
from schemas.prompt import prompt_ids
from topics import CONTROL, SHADOW_ANSWERS, TOKENS, TOOL_CALLS, inference_topic

COMPLETED_KEPT = 10_000  # request ids remembered as done, to drop a duplicate of one
CANCELS_KEPT_S = 600.0  # a starting worker reads the cancels of this long ago (a request's whole life)

log = logging.getLogger(__name__)


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    async def on_partitions_revoked(self, revoked) -> None:
        await self.worker.revoked(set(revoked))

    async def on_partitions_assigned(self, assigned) -> None:
        await self.worker.assigned(set(assigned))


class Worker:
    def __init__(
        self,
        cfg: WorkerConfig,
        engine: Backend,
        metrics: WorkerMetrics,
        bootstrap: str,
        health: WorkerHealth | None = None,
    ) -> None:
        self.cfg = cfg
        self.health = health or WorkerHealth(cfg)
        self.health.engine = engine
        self.watch: GroupWatch | None = None  # the group's standing for /health/ready, set by run()
        self.announcer = Announcer(None, cfg.model, "", bootstrap, enabled=False)  # run() makes the real one
        self.engine = engine
        self.metrics = metrics
        self.bootstrap = bootstrap
        self.worker_id = cfg.worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self.spec = inference_topic(cfg.model)
        self.group = f"worker.{cfg.model}"
        self.tracker = OffsetTracker()
        self.takeover_below: dict[TopicPartition, int] = {}
        # partitions of the current assignment whose takeover point assigned() has settled: aiokafka
        # fetches a newly assigned partition before that callback has run, and a request fetched from
        # one that is not settled yet may have been started by the previous owner (it is looked up)
        self.settled: set[TopicPartition] = set()
        self.owned: dict[str, tuple[TopicPartition, int, InferenceRequest, Sequence]] = {}
        # Request ids this worker completed lately: an upstream processor that re-emits a request
        # after a crash (see processors/effects.py) must not have it generated twice.
        self.completed: OrderedDict[str, None] = OrderedDict()
        self.epoch: dict[TopicPartition, int] = {}  # bumped when a partition is revoked
        self.token_texts = TokenTexts(engine.tokenizer)  # for reported log probabilities
        self.handover = Handover()
        self.chunks_written: dict[str, int] = {}  # request id -> chunks written for it (handover checks)
        self.resuming: dict[
            str, float
        ] = {}  # request id -> when it was taken over (its first chunk is logged)
        self.assignor = StickyAssignor()
        self.step_lock = asyncio.Lock()
        self.commit_lock = asyncio.Lock()
        self.publish_lock = asyncio.Lock()  # held while events are queued for the producer
        self.work = asyncio.Event()
        self.ready = asyncio.Event()
        self.pending_completions: set[asyncio.Task] = set()
        self.parsers: dict[str, ToolCallParser] = {}  # requests with tools: their calls so far
        self.spans: dict[str, tracing.Hop] = {}  # each owned request's span (common.tracing)
        self.grammars: Grammars | None = None
        # Every step on the process's torch thread, where the model was loaded and the engine built:
        # one OpenMP team in the process (gpu_workers/torch_thread.py). Steps sent to asyncio's default
        # executor ran on whichever of its threads was free, each with a team of its own.
        self.stepper = torch_thread()

    # ---- lifecycle ----
    async def run(self, stop: asyncio.Event) -> None:
        self.grammars = await asyncio.to_thread(
            Grammars,
            self.engine.tokenizer,
            self.engine.eos_ids,
            timeout_s=self.cfg.grammar_timeout_s,
            max_calls=self.cfg.max_parallel_calls,
        )
        # no linger (producers/settings.py): a step's tokens go into one batch anyway, appended without
        # yielding to the sender
        self.producer = await start_producer(self.bootstrap)
        self.tokens = TokenLog(self.bootstrap)
        await self.tokens.start()
        self.control = await start_consumer(group=None, bootstrap=self.bootstrap)
        await self._cancels_since(time.time() - CANCELS_KEPT_S)
        client_id = member_client_id("worker")
        self.consumer = await start_consumer(
            group=self.group,
            bootstrap=self.bootstrap,
            from_beginning=True,
            max_poll_interval_ms=600_000,
            client_id=client_id,
            partition_assignment_strategy=assignor_strategy(self.assignor),
        )
        self.consumer.subscribe([self.spec.name], listener=_Rebalance(self))
        # the group's standing as the broker sees it, for /health/ready (gpu_workers/health.py)
        self.watch = GroupWatch(
            self.bootstrap,
            self.group,
            client_id,
            interval_s=self.cfg.health_interval_s,
            topic_partitions=lambda: len(self.consumer.partitions_for_topic(self.spec.name) or ()),
        )
        self.announcer = Announcer(
            self.producer, self.cfg.model, self.worker_id, self.bootstrap, self.cfg.announce_prefixes
        )
        await self.announcer.start()
        tasks = [
            asyncio.create_task(self._consume(stop)),
            asyncio.create_task(self._steps(stop)),
            asyncio.create_task(self._cancels(stop)),
        ]
        watching = asyncio.gather(self.watch.run(), self.announcer.heartbeat(self, stop))
        try:
            done, _ = await asyncio.wait(
                [*tasks, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED
            )
            for t in done:
                if t in tasks and t.exception():
                    raise t.exception()
        finally:
            for t in (*tasks, watching):
                t.cancel()
            await asyncio.gather(*tasks, watching, return_exceptions=True)
            await asyncio.gather(*self.pending_completions, return_exceptions=True)
            await self._commit()
            for rid in list(self.spans):
                self._end_span(rid, {"tokenstream.unfinished": True})
            await self.consumer.stop()
            await self.control.stop()
            await self.tokens.stop()
            await self.producer.stop()
            log.info("worker %s stopped", self.worker_id)

    async def assigned(self, tps: set[TopicPartition]) -> None:
        """Settle the held partitions (gpu_workers/handover.py): write what the kept ones waited to
        write, give up the requests of those that moved; read the end of each partition new here."""
        generation = generation_of(self.consumer)
        self.assignor.remember_generation(generation)
        async with self.publish_lock:
            kept, check = self.handover.sort(tps, generation)
            if check:
                kept |= await self._untouched(check)
            settled = self.handover.settle(tps, generation, kept)
            self._give_up(settled.lost)
            await self._publish_locked(settled.waiting)
            # Given up but still ours: their records may have been fetched (and passed over as running)
            # while this settled, so they are read again from the commit and taken over from the log.
            for tp in settled.lost & tps:
                committed = await self.consumer.committed(tp)
                if committed is None:
                    await self.consumer.seek_to_beginning(tp)
                else:
                    self.consumer.seek(tp, committed)
        fresh = tps - settled.kept
        if fresh:
            ends = await self.consumer.end_offsets(list(fresh))
            self.takeover_below.update(ends)  # anything below may have been started by a previous owner
        self.settled = set(tps)
        log.info(
            "worker %s assigned %d partitions of %s (generation %d, %d kept through the rebalance)",
            self.worker_id,
            len(tps),
            self.spec.name,
            generation,
            len(settled.kept),
        )
        if not self.ready.is_set():
            log.info("worker ready: %s in group %s", self.worker_id, self.group)
            if self.watch is not None:
                self.health.standing = self.watch.standing
            self.ready.set()

    async def revoked(self, tps: set[TopicPartition]) -> None:
        """Hold the partitions' requests until the new assignment: nothing more is written for them.

        They stop writing before anything is awaited, not even what the step running now produces: a
        revocation that outlasts the group's rebalance timeout (a slow step on a loaded host) gets
        this member expelled and the partitions handed to another worker meanwhile; a token written
        after that came behind the new owner's takeover read, which had started the request afresh,
        and the log held two versions of its answer (the chaos drill saw a chunk "A" and then a
        Completion with seq 0 from the new owner). The assignment then keeps them or gives them up.
        """
        for tp in tps:
            self.epoch[tp] = self.epoch.get(tp, 0) + 1
        self.settled -= tps
        self.handover.hold(tps)
        # Not waiting for the running step (seconds on a loaded host, which made the member miss the
        # rebalance timeout): only for a publish under way, so that what it queued is flushed too.
        async with self.publish_lock:
            await self.producer.flush()

    async def _untouched(self, tps: set[TopicPartition]) -> set[TopicPartition]:
        """Of held partitions assigned back after a skipped generation, those whose requests nobody else
        continued: the tokens topic holds exactly the chunks this worker wrote for each, and no end."""
        held = [(rid, tp, request) for rid, (tp, _, request, _) in self.owned.items() if tp in tps]
        emitted = (
            await self.tokens.emitted(
                [
                    (rid, request.reply_partition, request.created_at - self.cfg.takeover_margin_s)
                    for rid, _, request in held
                ]
            )
            if held
            else {}
        )
        moved = {
            tp
            for rid, tp, _ in held
            if emitted[rid].completion is not None
            or len(emitted[rid].chunks) != self.chunks_written.get(rid, 0)
        }
        return tps - moved

    def _give_up(self, tps: set[TopicPartition]) -> None:
        """Abort the requests of partitions that moved: their new owner takes them over."""
        lost = [rid for rid, (tp, *_) in self.owned.items() if tp in tps]
        for rid in lost:
            self.engine.abort(self.owned.pop(rid)[3])
            self.chunks_written.pop(rid, None)
            self.resuming.pop(rid, None)
            self.parsers.pop(rid, None)
            self._end_span(rid, {"tokenstream.handed_over": True})
        for tp in tps:
            self.tracker.drop(tp)
            self.takeover_below.pop(tp, None)
        if lost:
            log.info("worker %s gave up %d in-flight requests on rebalance", self.worker_id, len(lost))

    # ---- consuming requests ----
    async def _consume(self, stop: asyncio.Event) -> None:
        paused = False
        while not stop.is_set():
            room = self.cfg.max_waiting - self.engine.queued
            if room <= 0:
                if not paused:
                    self.consumer.pause(*self.consumer.assignment())
                    paused = True
                await asyncio.sleep(0.02)
                continue
            if paused:
                self.consumer.resume(*self.consumer.assignment())
                paused = False
            batches = await self.consumer.getmany(timeout_ms=100, max_records=room)
            # The epochs as of these records, taken after the fetch: getmany waits out a rebalance
            # and returns records of the assignment it ends with, from positions already moved past
            # them; dropped here as "revoked meanwhile", those of a partition this worker got back
            # were never read again (its requests stalled until the next rebalance).
            epochs = dict(self.epoch)
            assignment = self.consumer.assignment()
            fetched = [(tp, rec) for tp, records in batches.items() if tp in assignment for rec in records]
            if fetched:
                await self._accept(fetched, epochs)
            self.work.set()

    async def _accept(self, fetched: list, epochs: dict[TopicPartition, int]) -> None:
        """Start the fetched requests; those a previous owner may have started resume where it stopped,
        all looked up in one read of the tokens topic (a takeover of a whole batch costs one scan)."""
        taken: list[tuple[TopicPartition, int, InferenceRequest]] = []
        parents: dict[str, TraceContext | None] = {}
        seen: set[str] = set()
        for tp, rec in fetched:
            if self.epoch.get(tp, 0) != epochs.get(tp, 0):
                continue  # revoked meanwhile
            if self.tracker.tracks(tp, rec.offset):
                continue  # read again from the commit after a rebalance that kept its partition: running
            self.tracker.add(tp, rec.offset)
            try:  # (the keyring's store away: held here, up to the Redis outage budget)
                request = await sealing.patiently(lambda: decode_record(rec, self.spec), "worker")
            except DecodeError as exc:
                await dead_letter(self.producer, rec, exc, group=self.group)
                await self._done(tp, rec.offset)
                continue
            rid = request.request_id
            if rid in self.owned or rid in self.completed or rid in seen:
                # a duplicate of a request this worker runs or has completed: done at once (a running
                # original's offset holds the partition's commits back until it completes)
                await self._done(tp, rec.offset)
                continue
            seen.add(rid)
            parents[rid] = TraceContext.from_headers(rec.headers)
            taken.append((tp, rec.offset, request))
        resumed = [
            (r.request_id, r.reply_partition, r.created_at - self.cfg.takeover_margin_s)
            for tp, offset, r in taken
            if tp not in self.settled or offset < self.takeover_below.get(tp, -1)
        ]
        emitted = await self.tokens.emitted(resumed) if resumed else {}
        for tp, offset, request in taken:
            if not self.tracker.tracks(tp, offset):
                # its partition was given up during the read: the new owner takes it from the commit. (One
                # revoked meanwhile but held, or kept by the assignment, goes on: a kept partition is not
                # read again from its commit for what this worker tracks, so skipping would lose it.)
                continue
            s = request.sampling
            ids = prompt_ids(self.engine.tokenizer, request.messages, request.output)
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
            )
            before = emitted.get(request.request_id)
            if before is not None and before.completion is not None:
                await self._done(tp, offset)
                continue
            if before is not None and before.chunks:
                self.metrics.takeovers.labels(self.cfg.model).inc()
                self.resuming[request.request_id] = time.monotonic()
                seq.generated = before.token_ids
                seq.resumed = len(seq.generated)
                seq.emitted_text = before.text
                seq.next_seq = len(before.chunks)
            self.owned[request.request_id] = (tp, offset, request, seq)
            self.chunks_written[request.request_id] = seq.next_seq  # a takeover's: what the log holds
            self.spans[request.request_id] = tracing.hop(
                f"chat {request.model}",
                parents.get(request.request_id),
                role="worker",
                kind="internal",
                attributes={
                    **tracing.request_attributes(request),
                    **tracing.record_attributes(tp.topic, tp.partition, offset, self.group),
                    "tokenstream.worker_id": self.worker_id,
                    "tokenstream.resumed_tokens": seq.resumed,
                },
            )
            if request.output.callable_tools:
                parser = self.parsers[request.request_id] = ToolCallParser(request.request_id)
                parser.feed(seq.emitted_text)  # a request taken over: the calls emitted so far
            if request.output.constrained:  # compiled off the step loop; meanwhile other requests run
                task = asyncio.create_task(self._constrain(request, seq))
                self.pending_completions.add(task)
                task.add_done_callback(self.pending_completions.discard)
                continue
            self.engine.add(seq)

    async def _constrain(self, request: InferenceRequest, seq: Sequence) -> None:
        """Give `seq` its grammar state, then to the engine; a grammar that fails ends it with an error."""
        try:
            seq.grammar = await self.grammars.state_for(request.output, seq.generated)
        except GrammarError as exc:
            async with self.step_lock:
                if self.owned.get(request.request_id, (None,) * 4)[3] is seq:
                    seq.finished_at = time.time()
                    await self._publish(
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
        if self.owned.get(request.request_id, (None,) * 4)[3] is seq:  # not revoked meanwhile
            self.engine.add(seq)
            self.work.set()

    async def _cancels_since(self, since: float) -> None:
        """Read the control topic from `since`: a cancel sent while no worker held its request (this
        one starting, the group rebalancing) still stops it here (the engine keeps recent cancels
        and ends such a request as soon as it arrives); otherwise a request the gateway had ended
        with its progress deadline was generated in full by the worker that took it over."""
        # assigned here, not subscribed: a subscription's assignment can still be empty right after
        # start, and its partitions then began at "latest" later, past the cancels looked for
        tps = [TopicPartition(CONTROL.name, p) for p in range(CONTROL.partitions)]
        self.control.assign(tps)
        for tp in tps:
            await self.control.position(tp)  # fixes "latest" now, so no cancel sent after start is missed
        found = await self.control.offsets_for_times({tp: int(since * 1000) for tp in tps})
        for tp, at in found.items():
            if at is not None:
                self.control.seek(tp, at.offset)
        # taken in before the first request is: read by the running task, they raced the requests
        # they cancel, which then began generating
        ends = await self.control.end_offsets(tps)
        while [tp for tp in tps if await self.control.position(tp) < ends[tp]]:
            self._take_cancels(await self.control.getmany(timeout_ms=200))

    async def _cancels(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self._take_cancels(await self.control.getmany(timeout_ms=200))

    def _take_cancels(self, batches: dict) -> None:
        for records in batches.values():
            for rec in records:
                try:
                    event = decode_record(rec, CONTROL)
                except DecodeError:
                    continue
                if isinstance(event, Cancel):
                    self.engine.cancel(event.request_id)
                    self.work.set()

    # ---- stepping and publishing ----
    async def _steps(self, stop: asyncio.Event) -> None:
        """Step the engine on the torch thread while there is work, two steps deep.

        The next step is queued on the torch thread while this one runs, so the torch thread goes
        from one forward straight to the next; the event loop takes each step's outputs and
        publishes them while the following step runs. A step queued behind the one that finished
        the last request finds no work and returns nothing. With `step_delay_s` (tests that need
        slow steps) one step at a time.
        """
        loop = asyncio.get_running_loop()
        depth = 1 if self.cfg.step_delay_s else 2
        queued: deque[asyncio.Future] = deque()

        def queue_steps() -> None:
            while len(queued) < depth and self.engine.has_work:
                queued.append(loop.run_in_executor(self.stepper, self._step))

        while not stop.is_set():
            self.health.step_loop_turned()
            queue_steps()
            if not queued:
                self.work.clear()
                try:
                    await asyncio.wait_for(self.work.wait(), 0.05)
                except TimeoutError:
                    pass
                continue
            async with self.step_lock:
                outputs, seconds = await queued.popleft()
                if seconds is not None:
                    self.metrics.step_seconds.labels(self.cfg.model).observe(seconds)
                queue_steps()  # the next step is queued before these outputs are published
                await self._publish(outputs)
            if self.cfg.step_delay_s:
                await asyncio.sleep(self.cfg.step_delay_s)
            else:
                await asyncio.sleep(0)

    def _step(self) -> tuple[list[Output], float | None]:
        """One engine step and its duration (on the torch thread); nothing if no work is left."""
        if not self.engine.has_work:
            return [], None
        t0 = time.perf_counter()
        outputs = self.engine.step()
        return outputs, time.perf_counter() - t0

    async def _publish(self, outputs: list[Output]) -> None:
        async with self.publish_lock:
            await self._publish_locked(outputs)

    async def _publish_locked(self, outputs: list[Output]) -> None:
        for out in outputs:
            rid = out.seq.request_id
            owned = self.owned.get(rid)
            if owned is None or owned[3] is not out.seq:
                continue  # aborted: its partition belongs to another worker now (or it was taken over afresh)
            tp, offset, request, _ = owned
            if self.handover.holds(tp):
                self.handover.wait(tp, out)  # revoked: written only if the next assignment keeps it
                continue
            parser = self.parsers.get(rid)
            span = self.spans.get(rid)
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
                    worker_id=self.worker_id,
                    logprobs=self.token_texts.report(out.logprobs) if out.logprobs else [],
                )
                if not request.shadow_of:  # a shadow replay's answer is its Completion alone
                    await publish(
                        self.producer,
                        TOKENS,
                        chunk,
                        partition=request.reply_partition,
                        wait=False,
                        trace=chunk_trace,
                    )
                self.chunks_written[rid] = out.chunk_seq + 1
                if rid in self.resuming:  # where a takeover's time goes: taken in -> its next token out
                    log.info(
                        "worker %s resumed %s at chunk %d, %.2f s after taking it over",
                        self.worker_id,
                        rid,
                        out.chunk_seq,
                        time.monotonic() - self.resuming.pop(rid),
                    )
            if out.finish_reason is not None and self.owned.get(rid) is owned:  # not given up meanwhile
                seq = out.seq
                reason, error = out.finish_reason, out.error
                if seq.grammar is not None and seq.grammar.error is not None and reason == "stop":
                    reason, error = "error", seq.grammar.error
                if parser is not None:
                    self.parsers.pop(rid, None)
                    if parser.calls and reason == "stop":
                        reason = "tool_calls"
                    for call in [] if request.shadow_of else parser.calls:  # the audit trail (by call_id)
                        await publish(
                            self.producer,
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
                    worker_id=self.worker_id,
                    model=self.cfg.model,
                    tier=request.tier,
                    moderated=request.output.moderated,
                )
                headers = [(EVENT_TYPE, b"completion"), *(trace.headers() if trace else ())]
                if request.shadow_of:  # never a client's: apart from ts.tokens, for `tokenstream shadow`
                    future = await self.producer.send(
                        SHADOW_ANSWERS.name, encode(done), key=rid.encode(), headers=headers
                    )
                else:
                    future = await self.producer.send(
                        TOKENS.name,
                        encode(done),
                        key=rid.encode(),
                        partition=request.reply_partition,
                        headers=headers,
                    )
                if span is not None and span.span is not None:
                    span.set(tracing.completion_attributes(done, request.model))
                    if reason == "error":
                        span.fail(error or "error")
                self._end_span(rid)
                if (
                    reason in ("stop", "length") and not request.shadow_of
                ):  # its messages and answer: in the KV cache
                    await self.announcer.held(request, done.text)
                self.owned.pop(rid, None)
                self.chunks_written.pop(rid, None)
                self.resuming.pop(rid, None)
                self.completed[rid] = None
                while len(self.completed) > COMPLETED_KEPT:
                    self.completed.popitem(last=False)
                task = asyncio.create_task(self._after_delivery(future, tp, offset))
                self.pending_completions.add(task)
                task.add_done_callback(self.pending_completions.discard)

    def _end_span(self, rid: str, attributes: dict | None = None) -> None:
        span = self.spans.pop(rid, None)
        if span is not None:
            span.set(attributes or {})
            span.end()

    async def _after_delivery(self, future, tp: TopicPartition, offset: int) -> None:
        await future  # acknowledged by the broker (acks=all): now the request may be committed
        await self._done(tp, offset)

    async def _done(self, tp: TopicPartition, offset: int) -> None:
        self.tracker.done(tp, offset)
        await self._commit()

    async def _commit(self) -> None:
        async with self.commit_lock:
            assignment = self.consumer.assignment()
            offsets = {tp: off for tp, off in self.tracker.committable().items() if tp in assignment}
            if not offsets:
                return
            try:
                await self.consumer.commit(offsets)
            except (KafkaError, AssertionError) as exc:  # rebalancing: the new owner redoes the rest
                log.warning("commit of %s failed: %s", offsets, exc)
                return
            self.tracker.mark_committed(offsets)
            self.metrics.commits.labels(self.cfg.model).inc()
