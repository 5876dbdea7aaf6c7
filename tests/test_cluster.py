"""A three-node Kafka cluster (`tokenstream stack up --brokers 3`, tokenstream/stack/cluster.py) under a
steady stream of writes: kill -9 of a node, then of the active controller, then a rolling restart of every
node (the chaos drill's broker faults). Nothing acknowledged is lost or written twice, and a consumer group
follows to the end."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
import uuid

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.structs import TopicPartition

from common import kafka_auth
from common.config import settings
from producers import commit_past, decode_record, publish, start_consumer, start_producer
from schemas import TokenChunk
from tokenstream.chaos.brokers import CLUSTER_FAULTS, broker_fault
from tokenstream.stack import Stack
from tokenstream.stack.cluster import KafkaCluster
from tokenstream.stack.stack import use
from topics import TopicSpec
from topics.admin import apply

# about 65 s: make test-all, beside the chaos drill on three brokers
pytestmark = [pytest.mark.slow, pytest.mark.heavy]
STREAMS = 6  # keys written side by side, each its own ordered sequence
log = logging.getLogger("test.cluster")


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory, stack
):  # the suite's `stack`: its Redis holds the sealing keys of what the load writes
    own = Stack.ephemeral(tmp_path_factory.mktemp("cluster"), brokers=3)
    saved = dict(os.environ)
    try:
        own.kafka.start(say=print)
        use(own.kafka.environment())  # this module's clients: the cluster, as its admin
        yield own.kafka
    finally:
        own.kafka.stop(say=print)
        os.environ.clear()
        os.environ.update(saved)
        settings.cache_clear()


class Load:
    """Writes TokenChunks on STREAMS keys without pause (acks=all, idempotent: the project's producer),
    keeping what the cluster acknowledged; a consumer group reads alongside, committing as it goes."""

    def __init__(self, cluster: KafkaCluster, spec: TopicSpec) -> None:
        self.cluster, self.spec = cluster, spec
        self.acked: list[tuple[str, int]] = []
        self.acked_at: list[float] = []
        self.failed: list[str] = []
        self.read: list[tuple[str, int]] = []
        self.stopping = asyncio.Event()

    async def write(self) -> None:
        producer = await start_producer(self.cluster.address)
        try:
            seq = 0
            while not self.stopping.is_set():
                key = f"s{seq % STREAMS}"
                try:
                    await publish(
                        producer, self.spec, TokenChunk(request_id=key, seq=seq, text=str(seq)), key=key
                    )
                    self.acked.append((key, seq))
                    self.acked_at.append(time.monotonic())
                except Exception as exc:  # noqa: BLE001 - a write the cluster refused: counted, asserted on
                    self.failed.append(f"{seq}: {type(exc).__name__}: {exc}")
                seq += 1
        finally:
            await producer.stop()

    async def follow(self, group: str) -> None:
        consumer = await start_consumer(
            self.spec, group=group, bootstrap=self.cluster.address, from_beginning=True
        )
        try:
            while True:
                for tp, records in (await consumer.getmany(timeout_ms=300)).items():
                    for record in records:
                        chunk = decode_record(record, self.spec)
                        self.read.append((chunk.request_id, chunk.seq))
                    await commit_past(consumer, tp, records[-1].offset, log)
        finally:
            await consumer.stop()

    def worst_gap(self, since: float) -> float:
        """The longest time without an acknowledged write from `since` to now."""
        times = [since, *(t for t in self.acked_at if t > since), time.monotonic()]
        return max(b - a for a, b in itertools.pairwise(times))

    async def more(self, n: int, timeout_s: float = 90) -> None:
        """Wait until `n` more writes are acknowledged (the cluster takes writes again)."""
        target, deadline = len(self.acked) + n, time.monotonic() + timeout_s
        while len(self.acked) < target:
            assert time.monotonic() < deadline, (
                f"writes stalled: {len(self.acked)} acked, failed {self.failed[-3:]}"
            )
            await asyncio.sleep(0.05)


async def _partitions(cluster: KafkaCluster, topic: str) -> list[dict]:
    admin = AIOKafkaAdminClient(bootstrap_servers=cluster.address, **kafka_auth.client_options())
    await admin.start()
    try:
        return (await admin.describe_topics([topic]))[0]["partitions"]
    finally:
        await admin.close()


async def test_nothing_acknowledged_is_lost_or_doubled_when_a_node_the_controller_or_every_node_goes(cluster):
    spec = TopicSpec(
        f"test.cluster.{uuid.uuid4().hex[:8]}",
        3,
        "request_id",
        (TokenChunk,),
        "cluster test",
        {"cleanup.policy": "delete"},
    )
    await apply([spec], cluster.address)  # replication from the cluster: three copies
    partitions = await _partitions(cluster, spec.name)
    assert [len(p["replicas"]) for p in partitions] == [3, 3, 3]
    assert cluster.node(1).properties()["min.insync.replicas"] == "2"

    load = Load(cluster, spec)
    stalls: dict[str, float] = {}
    tasks = [asyncio.create_task(load.write()), asyncio.create_task(load.follow(f"g-{spec.name}"))]
    try:
        await load.more(200)
        # kill -9 of a node, then of the active controller, then a rolling restart: the drill's broker
        # faults (tokenstream/chaos/brokers.py), each over once the cluster is whole and in sync again
        for n, kind in enumerate(CLUSTER_FAULTS):
            began = time.monotonic()
            assert (await broker_fault(cluster, n))[0] == kind
            await load.more(100)
            stalls[kind] = load.worst_gap(began)
        print("longest time without an acknowledged write:", stalls)
        # a killed node's partitions wait for its death to be noticed (broker.session.timeout.ms, 1.5 s) and a
        # new leader; 10 s leaves room for a loaded 2-core host, and no fault stops writes for longer
        assert max(stalls.values()) < 10, stalls
    finally:
        load.stopping.set()
        await tasks[0]

    assert not load.failed, load.failed[:5]
    # the log holds every acknowledged write once, each key's in the order written
    end = time.monotonic() + 60
    while not set(load.acked) <= set(load.read):
        assert time.monotonic() < end, f"the group read {len(set(load.read))} of {len(load.acked)}"
        await asyncio.sleep(0.2)
    tasks[1].cancel()
    await asyncio.gather(tasks[1], return_exceptions=True)
    logged = await _read_all(cluster, spec)
    assert sorted(logged) == sorted(set(logged)), "a write is in the log twice"
    assert set(logged) == set(load.acked), "the log and the acknowledged writes differ"
    for key in {k for k, _ in logged}:
        seqs = [s for k, s in logged if k == key]
        assert seqs == sorted(seqs), f"{key} out of order"


async def _read_all(cluster: KafkaCluster, spec: TopicSpec) -> list[tuple[str, int]]:
    consumer = await start_consumer(group=None, bootstrap=cluster.address, from_beginning=True)
    try:
        tps = [TopicPartition(spec.name, p) for p in range(spec.partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        out: list[tuple[str, int]] = []
        while [tp for tp in tps if await consumer.position(tp) < ends[tp]]:
            for records in (await consumer.getmany(timeout_ms=500)).values():
                out += [(c.request_id, c.seq) for c in (decode_record(r, spec) for r in records)]
        return out
    finally:
        await consumer.stop()
