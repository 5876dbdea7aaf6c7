"""The autoscaler's decisions (KEDA Kafka-scaler semantics) and its loop on a real group's lag."""

from __future__ import annotations

import uuid

import pytest
from aiokafka.structs import OffsetAndMetadata, TopicPartition

from producers import publish, start_consumer, start_producer
from schemas import ChatMessage, InferenceRequest
from tokenstream.ops.autoscale import Autoscaler, ScaleMemory, ScalePolicy, decide
from topics import inference_topic, worker_group
from topics.admin import apply


def run(policy: ScalePolicy, samples: list[tuple[float, int]], start: int, partitions: int = 12) -> list[int]:
    """Replicas after each (time, lag) sample, applying every decision."""
    memory, current, out = ScaleMemory(), start, []
    for now, lag in samples:
        current = decide(policy, lag, partitions, current, now, memory).replicas
        out.append(current)
    return out


def test_scales_up_at_once_and_down_only_after_the_stabilization_window():
    policy = ScalePolicy(lag_threshold=10, min_replicas=1, max_replicas=4, stabilization_s=60)
    samples = [(0, 0), (5, 25), (10, 100), (20, 5), (50, 5), (71, 5), (80, 0)]
    assert run(policy, samples, start=1) == [1, 3, 4, 4, 4, 1, 1]


def test_never_more_than_max_replicas_nor_partitions():
    assert run(ScalePolicy(lag_threshold=1, max_replicas=50), [(0, 1000)], start=1, partitions=6) == [6]
    assert run(ScalePolicy(lag_threshold=1, max_replicas=3), [(0, 1000)], start=1) == [3]
    idle_ok = ScalePolicy(lag_threshold=1, max_replicas=8, allow_idle_consumers=True)
    assert run(idle_ok, [(0, 1000)], start=1, partitions=6) == [8]


def test_within_the_tolerance_nothing_changes():
    policy = ScalePolicy(lag_threshold=10, max_replicas=10)
    assert run(policy, [(0, 41), (1, 39)], start=4) == [4, 4]


def test_scale_to_zero_is_opt_in_and_waits_for_the_cooldown():
    keep_one = ScalePolicy(lag_threshold=10, min_replicas=1, cooldown_s=30, stabilization_s=0)
    assert run(keep_one, [(0, 20), (10, 0), (100, 0)], start=1) == [2, 1, 1]
    to_zero = ScalePolicy(lag_threshold=10, min_replicas=0, cooldown_s=30, stabilization_s=0)
    assert run(to_zero, [(0, 20), (10, 0), (29, 0), (31, 0), (40, 0), (41, 3)], start=1) == [2, 1, 1, 0, 0, 1]


def test_activation_threshold_keeps_a_small_lag_from_waking_the_group():
    policy = ScalePolicy(lag_threshold=10, activation_lag_threshold=5, min_replicas=0, cooldown_s=0)
    assert run(policy, [(0, 4), (1, 6)], start=0) == [0, 1]


def test_bad_policies_are_refused():
    with pytest.raises(ValueError):
        ScalePolicy(lag_threshold=0)
    with pytest.raises(ValueError):
        ScalePolicy(min_replicas=3, max_replicas=2)


async def test_the_loop_scales_a_real_group_up_on_lag_and_back_down(bootstrap):
    model = f"scale-{uuid.uuid4().hex[:6]}"
    spec, group = inference_topic(model), worker_group(model)
    await apply([spec], bootstrap)
    tps = [TopicPartition(spec.name, p) for p in range(spec.partitions)]
    consumer = await start_consumer(group=group, bootstrap=bootstrap, enable_auto_commit=False)
    consumer.assign(tps)
    await consumer.commit({tp: OffsetAndMetadata(0, "") for tp in tps})  # the group exists, nothing pending
    clock = [0.0]
    applied: list[int] = []
    policy = ScalePolicy(lag_threshold=5, min_replicas=1, max_replicas=3, stabilization_s=30)
    scaler = Autoscaler(
        bootstrap,
        group,
        spec.name,
        policy,
        current=1,
        apply=lambda n, d: applied.append(n),
        clock=lambda: clock[0],
    )
    producer = await start_producer(bootstrap)
    try:
        assert (await scaler.step()).replicas == 1
        for i in range(40):  # 40 waiting requests: 40 / 5 = 8 wanted, capped at 3
            await publish(
                producer,
                spec,
                InferenceRequest(
                    request_id=f"r{i}", model=model, messages=[ChatMessage(role="user", content="hi")]
                ),
            )
        clock[0] = 5
        assert (await scaler.step()).replicas == 3
        ends = await consumer.end_offsets(tps)
        await consumer.commit({tp: OffsetAndMetadata(end, "") for tp, end in ends.items()})  # drained
        clock[0] = 10
        held = await scaler.step()
        assert held.replicas == 3 and "stabilization" in held.reason
        clock[0] = 40
        assert (await scaler.step()).replicas == 1
        assert applied == [3, 1]
    finally:
        await producer.stop()
        await consumer.stop()
        await scaler.sampler.close()
