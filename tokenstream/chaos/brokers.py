"""The drill's broker faults: a restart of the one broker, or, on a three-node cluster, in turn:

  node kill -9        a node chosen at random is killed, and started again once the others lead its
                      partitions (as a supervisor would);
  controller kill -9  the active controller (the KRaft quorum's leader) is killed, and started again
                      once another node leads the quorum;
  rolling restart     every node stopped (SIGTERM: a controlled shutdown) and started again in turn,
                      the next only once every partition has all its copies in sync again.

Each returns (kind, target); the fault is over when it returns (the cluster whole and in sync).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

from tokenstream.stack.cluster import KafkaCluster

CLUSTER_FAULTS = ("node kill -9", "controller kill -9", "rolling restart")


async def broker_fault(kafka, n: int) -> tuple[str, str]:
    """The `n`th broker fault of a run (0-based) on `kafka`, a single node or a cluster."""
    if not isinstance(kafka, KafkaCluster):
        await asyncio.to_thread(kafka.stop, lambda m: None)
        await asyncio.to_thread(kafka.start, lambda m: None)
        return "broker restart", "kafka"
    kind = CLUSTER_FAULTS[n % len(CLUSTER_FAULTS)]
    await kafka.wait_in_sync()  # a fault on a cluster still catching up would be two faults at once
    if kind == "rolling restart":
        for node in kafka.nodes:
            await asyncio.to_thread(node.stop, lambda m: None)
            await asyncio.to_thread(node.start, lambda m: None, False)
            await kafka.wait_in_sync()
        return kind, "all nodes"
    if kind == "controller kill -9":
        victim = await _controller(kafka)
    else:
        victim = random.choice(kafka.nodes).node_id
    await kill9(kafka, victim)
    if kind == "controller kill -9":
        await _controller(kafka, not_=victim)
    await asyncio.to_thread(kafka.node(victim).start, lambda m: None, False)
    await kafka.wait_in_sync()
    return kind, kafka.node(victim).name


async def kill9(kafka: KafkaCluster, node_id: int) -> None:
    node = kafka.node(node_id)
    pid = node.pid()
    if pid is None:
        raise RuntimeError(f"{node.name} is not running")
    os.killpg(pid, signal.SIGKILL)
    while node.pid() is not None:
        await asyncio.sleep(0.05)


async def _controller(kafka: KafkaCluster, not_: int | None = None, timeout_s: float = 60.0) -> int:
    """The active controller once the live nodes agree on one (other than `not_`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        leader = kafka.active_controller()
        if leader is not None and leader != not_:
            return leader
        if time.monotonic() > deadline:
            raise RuntimeError(f"{kafka.name}: no active controller after {timeout_s:.0f} s")
        await asyncio.sleep(0.1)
