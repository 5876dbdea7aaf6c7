"""Scaling a worker group on its consumer lag, with the semantics of KEDA's Kafka scaler.

What runs here locally is what a KEDA ScaledObject (deploy/k8s) does in a cluster:

    metric      total lag of the group on its topic (end offset - committed offset, summed)
    cap         unless allow_idle_consumers, the metric is capped at partitions x lag_threshold,
                so no more replicas than partitions are asked for (KEDA's allowIdleConsumers)
    active      lag > activation_lag_threshold (KEDA's activationLagThreshold)
    desired     ceil(lag / lag_threshold), left alone within the HPA's 10 % tolerance
    up          at once (the HPA's default scale-up policy)
    down        the highest recommendation of the last stabilization_s seconds (the HPA's
                scale-down stabilization window, 300 s by default)
    zero        only with min_replicas 0 (opt-in): after cooldown_s inactive (KEDA's cooldownPeriod)
    bounds      [max(min_replicas, 1 when active), max_replicas]

`decide` is the pure decision; `Autoscaler` samples the lag and applies decisions through a
callback (the local supervisor's scale.json, or a test's recorder).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from producers.lag import LagSampler


@dataclass(frozen=True)
class ScalePolicy:
    lag_threshold: int = 10
    activation_lag_threshold: int = 0
    min_replicas: int = 1
    max_replicas: int = 4
    cooldown_s: float = 300.0
    stabilization_s: float = 300.0
    tolerance: float = 0.1
    allow_idle_consumers: bool = False

    def __post_init__(self) -> None:
        if self.lag_threshold < 1:
            raise ValueError("lag_threshold must be at least 1")
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError("need 0 <= min_replicas <= max_replicas")


@dataclass
class ScaleMemory:
    """What a decision remembers between samples (KEDA keeps the same in the operator and HPA)."""

    last_active: float | None = None
    recommendations: deque[tuple[float, int]] = field(default_factory=deque)


@dataclass(frozen=True)
class Decision:
    replicas: int
    reason: str


def decide(
    policy: ScalePolicy, lag: int, partitions: int, current: int, now: float, memory: ScaleMemory
) -> Decision:
    metric = lag
    if not policy.allow_idle_consumers and partitions > 0:
        metric = min(metric, partitions * policy.lag_threshold)
    active = lag > policy.activation_lag_threshold
    if active:
        memory.last_active = now
    if not active and current == 0:
        return Decision(0, f"inactive (lag {lag} <= {policy.activation_lag_threshold}), stays at zero")
    if not active and policy.min_replicas == 0:
        idle_for = now - memory.last_active if memory.last_active is not None else math.inf
        if idle_for >= policy.cooldown_s:
            memory.recommendations.clear()
            return Decision(
                0,
                f"inactive for {min(idle_for, 1e9):.0f}s >= cooldown {policy.cooldown_s:.0f}s: scale to zero",
            )
    floor = max(policy.min_replicas, 1)
    ceiling = (
        policy.max_replicas
        if policy.allow_idle_consumers or partitions <= 0
        else min(policy.max_replicas, partitions)
    )
    if current == 0:  # activation: KEDA brings a scaled-to-zero target to at least one replica at once
        raw = math.ceil(metric / policy.lag_threshold)
    elif current > 0 and abs(metric / (current * policy.lag_threshold) - 1) <= policy.tolerance:
        raw = current
    else:
        raw = math.ceil(metric / policy.lag_threshold)
    wanted = max(floor, min(ceiling, raw))
    while memory.recommendations and now - memory.recommendations[0][0] > policy.stabilization_s:
        memory.recommendations.popleft()
    memory.recommendations.append((now, wanted))
    if wanted >= current:
        why = f"lag {lag} / threshold {policy.lag_threshold} -> {raw}, bounds [{floor}, {ceiling}]"
        return Decision(wanted, why if wanted > current else f"steady: {why}")
    held = max(n for _, n in memory.recommendations)
    if held > wanted:
        return Decision(
            min(current, held),
            f"scale-down to {wanted} held by the {policy.stabilization_s:.0f}s "
            f"stabilization window (highest recent: {held})",
        )
    return Decision(
        wanted,
        f"lag {lag} / threshold {policy.lag_threshold} -> {raw}, "
        f"stable for {policy.stabilization_s:.0f}s: scale down",
    )


class Autoscaler:
    """Samples a group's lag every `interval_s` and applies `decide` through `apply(replicas)`."""

    def __init__(
        self,
        bootstrap: str,
        group: str,
        topic: str,
        policy: ScalePolicy,
        current: int,
        apply: Callable[[int, Decision], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.group, self.topic, self.policy, self.current = group, topic, policy, current
        self.apply, self.clock = apply, clock
        self.sampler = LagSampler(bootstrap)
        self.memory = ScaleMemory()

    async def step(self) -> Decision:
        load = await self.sampler.sample(self.group, self.topic)
        decision = decide(self.policy, load.lag, load.partitions, self.current, self.clock(), self.memory)
        if decision.replicas != self.current:
            self.apply(decision.replicas, decision)
            self.current = decision.replicas
        return decision

    async def run(self, interval_s: float, stop: asyncio.Event, say: Callable[[str], None] = print) -> None:
        try:
            while not stop.is_set():
                before = self.current
                try:
                    decision = await self.step()
                except Exception as exc:  # noqa: BLE001 - a broker hiccup: keep the replicas, try again
                    say(f"autoscale {self.group}: no lag sample ({exc})")
                else:
                    if decision.replicas != before:
                        say(f"autoscale {self.group}: {before} -> {decision.replicas} ({decision.reason})")
                try:
                    await asyncio.wait_for(stop.wait(), interval_s)
                except TimeoutError:
                    pass
        finally:
            await self.sampler.close()
