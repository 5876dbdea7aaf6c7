"""The Kafka side of a worker: consume requests, feed the engine, publish tokens, commit, cancel, take over.

    inference topic (group worker.<model>) -> Engine -> tokens topic, partition reply_partition
    control topic (group-less, latest)      -> Engine.cancel

Guarantee: a request's offset is committed only after its Completion is acknowledged by the
broker (acks=all), and only up to the lowest offset still in flight on that partition. A
request re-delivered after a rebalance is resumed from the tokens already on the tokens topic.

The Worker holds the state all its parts share (the requests it owns, their offsets, the held
partitions) and runs the flow below; each part is an object of its own file, given the worker:

    intake.py     Intake      fetch requests, start them in the engine (a takeover resumes from the log)
    (here)        _steps      step the engine on the torch thread, two steps deep; publish each step's outputs
    publisher.py  Publisher   outputs -> tokens topic; a Completion acknowledged -> its offset committed
    cancels.py    Cancels     control topic -> Engine.cancel (from CANCELS_KEPT_S ago at start)
    rebalance.py  Rebalancer  the group's listener: a revoked partition held, then kept or given up
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections import OrderedDict, deque

from aiokafka.structs import TopicPartition

from common import tracing
from gpu_workers.announce import Announcer
from gpu_workers.backend import Backend
from gpu_workers.cancels import CANCELS_KEPT_S, Cancels
from gpu_workers.config import WorkerConfig
from gpu_workers.grammar import Grammars
from gpu_workers.handover import Handover
from gpu_workers.health import WorkerHealth
from gpu_workers.intake import Intake
from gpu_workers.metrics import WorkerMetrics
from gpu_workers.offsets import OffsetTracker
from gpu_workers.publisher import Publisher
from gpu_workers.rebalance import Rebalancer
from gpu_workers.recovery import TokenLog
from gpu_workers.sequence import Output, Sequence
from gpu_workers.tool_calls import ToolCallParser
from gpu_workers.torch_thread import torch_thread
from producers import start_consumer, start_producer
from producers.membership import GroupWatch, member_client_id
from producers.sticky import assignor_strategy
from schemas import InferenceRequest
from topics import inference_topic

log = logging.getLogger(__name__)


class Worker:
    """One worker of `cfg.model`: `run()` until `stop`, three loops (intake, steps, cancels) meanwhile."""

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
        self.handover = Handover()
        self.chunks_written: dict[str, int] = {}  # request id -> chunks written for it (handover checks)
        self.resuming: dict[
            str, float
        ] = {}  # request id -> when it was taken over (its first chunk is logged)
        self.step_lock = asyncio.Lock()
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

        # the parts (each a file of its own), all working on the state above
        self.rebalancer = Rebalancer(self)
        self.intake = Intake(self)
        self.cancels = Cancels(self)
        self.publisher = Publisher(self)

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
        await self.cancels.read_since(time.time() - CANCELS_KEPT_S)
        client_id = member_client_id("worker")
        self.consumer = await start_consumer(
            group=self.group,
            bootstrap=self.bootstrap,
            from_beginning=True,
            max_poll_interval_ms=600_000,
            client_id=client_id,
            partition_assignment_strategy=assignor_strategy(self.rebalancer.assignor),
        )
        self.consumer.subscribe([self.spec.name], listener=self.rebalancer)
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
            asyncio.create_task(self.intake.consume(stop)),
            asyncio.create_task(self._steps(stop)),
            asyncio.create_task(self.cancels.follow(stop)),
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
            await self.publisher.commit()
            for rid in list(self.spans):
                self.publisher.end_span(rid, {"tokenstream.unfinished": True})
            await self.consumer.stop()
            await self.control.stop()
            await self.tokens.stop()
            await self.producer.stop()
            log.info("worker %s stopped", self.worker_id)

    # ---- the parts' entry points on the worker, as unit tests drive them (tests/test_worker_kafka.py) ----
    async def assigned(self, tps: set[TopicPartition]) -> None:
        await self.rebalancer.assigned(tps)

    async def revoked(self, tps: set[TopicPartition]) -> None:
        await self.rebalancer.revoked(tps)

    async def _consume(self, stop: asyncio.Event) -> None:
        await self.intake.consume(stop)

    async def _accept(self, fetched: list, epochs: dict[TopicPartition, int]) -> None:
        await self.intake.accept(fetched, epochs)

    async def _publish(self, outputs: list[Output]) -> None:
        await self.publisher.publish(outputs)

    # ---- stepping ----
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
                await self.publisher.publish(outputs)
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
