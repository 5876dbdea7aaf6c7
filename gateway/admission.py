"""Admission control from the consumer lag of each model's worker group.

Every poll interval the gateway reads, for group `worker.<model>` on inference_topic(model),
the committed offsets (admin API) and the end offsets. lag = end - committed, summed over
partitions; the drain rate is the growth of the committed offsets over a sliding window.
A new request is refused with 429 when lag / drain rate exceeds the wait budget. Requests
admitted since the last sample count as lag too, so a burst between samples cannot
overshoot. When no sample has succeeded for a while, the broker is taken to be down (503).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass

from aiokafka.errors import KafkaError

from gateway.metrics import Metrics
from gateway.openai_api import overloaded, unavailable
from producers.lag import LagSampler
from topics import inference_topic, worker_group

log = logging.getLogger(__name__)


@dataclass
class ModelLoad:
    model: str
    lag: int = 0
    rate: float = 0.0  # requests per second taken by the worker group
    admitted_since_sample: int = 0
    last_ok: float = 0.0


@dataclass
class Decision:
    admitted: bool
    lag: int
    rate: float
    wait_s: float
    retry_after: int = 0


class Admission:
    def __init__(
        self,
        bootstrap: str,
        models: list[str],
        metrics: Metrics,
        *,
        budget_s: float,
        poll_s: float = 0.5,
        window_s: float = 10.0,
        min_rate: float = 1.0,
        stale_s: float = 5.0,
    ) -> None:
        self.metrics = metrics
        self.budget_s, self.poll_s = budget_s, poll_s
        self.min_rate, self.stale_s = min_rate, stale_s
        self.loads = {m: ModelLoad(m) for m in models}
        self.sampler = LagSampler(bootstrap, window_s=window_s)

    # ------------------------------------------------------------------ decisions

    def decide(self, model: str, share: float = 1.0) -> Decision:
        load = self.loads[model]
        if time.monotonic() - load.last_ok > self.stale_s:
            raise unavailable(
                "The inference pipeline is unreachable (no broker answer for "
                f"{self.stale_s:.0f}s); try again shortly."
            )
        lag = load.lag + load.admitted_since_sample
        rate = max(load.rate, self.min_rate)
        wait = lag / rate
        self.metrics.estimated_wait.labels(model).set(wait)
        budget = self.budget_s * share
        if wait > budget:
            retry = max(1, math.ceil((lag - budget * rate) / rate))
            return Decision(False, lag, rate, wait, retry)
        return Decision(True, lag, rate, wait)

    def admit(self, model: str, share: float = 1.0) -> Decision:
        """Count the request in, or raise the 429 (or 503) it gets instead (`share`: of the wait budget)."""
        decision = self.decide(model, share)
        if not decision.admitted:
            self.metrics.rejections.labels(model).inc()
            raise overloaded(decision.retry_after, decision.wait_s)
        self.loads[model].admitted_since_sample += 1
        return decision

    def healthy(self) -> bool:
        now = time.monotonic()
        return all(now - load.last_ok <= self.stale_s for load in self.loads.values())

    # ------------------------------------------------------------------ sampling

    async def run(self) -> None:
        while True:
            try:
                await self._sample_all()
            except asyncio.CancelledError:
                raise
            except (KafkaError, OSError, TimeoutError) as exc:  # broker down or restarting: stay stale
                log.warning("admission sample failed: %s", exc)
            except Exception:  # anything else is a bug, but admission keeps sampling (stale meanwhile)
                log.exception("admission sample failed")
            await asyncio.sleep(self.poll_s)

    async def close(self) -> None:
        await self.sampler.close()

    async def _sample_all(self) -> None:
        for load in self.loads.values():
            sample = await self.sampler.sample(worker_group(load.model), inference_topic(load.model).name)
            load.lag, load.rate, load.admitted_since_sample, load.last_ok = (
                sample.lag,
                sample.rate,
                0,
                time.monotonic(),
            )
            self.metrics.lag.labels(load.model).set(load.lag)
            self.metrics.drain_rate.labels(load.model).set(load.rate)
