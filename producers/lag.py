"""Consumer-group lag and drain rate, sampled from the broker: the load signal of admission and routing.

lag   = end offsets - committed offsets of the group, summed over the topic's partitions
rate  = growth of the committed offsets per second over a sliding window
wait  = lag / max(rate, min_rate): how long a request written now would queue

A partition the group never committed counts from the end offset seen at the first sample,
so history written before the group existed is not taken for a backlog.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.structs import TopicPartition

from common import kafka_auth


@dataclass
class Load:
    group: str
    topic: str
    lag: int = 0
    rate: float = 0.0
    partitions: int = 0  # 0: the topic does not exist (yet)
    sampled_at: float = 0.0
    samples: deque[tuple[float, int]] = field(default_factory=deque)
    baseline: dict[int, int] = field(default_factory=dict)
    behind: dict[int, tuple[int, int]] = field(default_factory=dict)  # partition -> (committed, end) with lag

    def wait_s(self, min_rate: float) -> float:
        return self.lag / max(self.rate, min_rate)


class LagSampler:
    """Keeps one admin client and one group-less consumer; `sample` refreshes one group's Load."""

    def __init__(self, bootstrap: str, window_s: float = 10.0, timeout_s: float = 5.0) -> None:
        self.bootstrap, self.window_s, self.timeout_s = bootstrap, window_s, timeout_s
        self.loads: dict[tuple[str, str], Load] = {}
        self._admin: AIOKafkaAdminClient | None = None
        self._consumer: AIOKafkaConsumer | None = None

    async def close(self) -> None:
        admin, consumer, self._admin, self._consumer = self._admin, self._consumer, None, None
        for stop in (consumer.stop if consumer else None, admin.close if admin else None):
            if stop is not None:
                with contextlib.suppress(Exception):  # closing a client of a broker that is gone
                    await stop()

    async def _clients(self) -> tuple[AIOKafkaAdminClient, AIOKafkaConsumer]:
        if self._admin is None or self._consumer is None:
            await self.close()
            self._admin = AIOKafkaAdminClient(
                bootstrap_servers=self.bootstrap, **kafka_auth.client_options(), request_timeout_ms=5000
            )
            await self._admin.start()
            self._consumer = AIOKafkaConsumer(
                bootstrap_servers=self.bootstrap,
                **kafka_auth.client_options(),
                group_id=None,
                request_timeout_ms=5000,
                enable_auto_commit=False,
            )
            await self._consumer.start()
        return self._admin, self._consumer

    async def _read(self, topic: str, group: str) -> tuple[list[TopicPartition], dict, dict]:
        """The topic's partitions, their end offsets and the group's committed offsets."""
        admin, consumer = await self._clients()
        partitions = consumer.partitions_for_topic(topic)
        if not partitions:
            await consumer._client.force_metadata_update()
            partitions = consumer.partitions_for_topic(topic)
        if not partitions:
            return [], {}, {}
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        ends = await consumer.end_offsets(tps)
        committed = await admin.list_consumer_group_offsets(group, partitions=tps)
        return tps, ends, committed

    async def sample(self, group: str, topic: str) -> Load:
        """Refresh and return the Load of `group` on `topic` (raises when the broker does not answer)."""
        load = self.loads.setdefault((group, topic), Load(group, topic))
        try:
            async with asyncio.timeout(self.timeout_s):
                tps, ends, committed = await self._read(topic, group)
        except BaseException:  # a broker that is down, restarting or too slow: start afresh next time
            await self.close()
            raise
        now = time.monotonic()
        if not tps:
            load.lag, load.partitions, load.sampled_at = 0, 0, now
            return load
        lag = done = 0
        load.behind = {}
        for tp in tps:
            base = load.baseline.setdefault(tp.partition, ends[tp])
            meta = committed.get(tp)
            at = meta.offset if meta is not None and meta.offset >= 0 else base
            lag += max(0, ends[tp] - at)
            done += at
            if ends[tp] > at:
                load.behind[tp.partition] = (at, ends[tp])
        load.samples.append((now, done))
        while len(load.samples) > 2 and now - load.samples[0][0] > self.window_s:
            load.samples.popleft()
        t0, d0 = load.samples[0]
        load.rate = (done - d0) / (now - t0) if now > t0 else 0.0
        load.lag, load.partitions, load.sampled_at = lag, len(tps), now
        return load
