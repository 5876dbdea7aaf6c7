"""Small helpers for tests that read and write registry topics on the real broker."""

from __future__ import annotations

import asyncio
import inspect
import itertools
import time
from collections.abc import Callable
from typing import Self

from aiokafka.partitioner import DefaultPartitioner
from aiokafka.structs import TopicPartition

from common import kafka_auth
from producers import start_consumer
from producers.publish import decode_record
from schemas import DecodeError, Event
from schemas.steps import unpack_all
from topics import TopicSpec


async def wait_for(condition: Callable[[], object], timeout: float, what: str, interval: float = 0.1):
    """Poll `condition` (a function, or a coroutine function) until it returns something true; that
    value is returned. Fails naming `what` once `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        await asyncio.sleep(interval)  # the poll interval


def partition_of(key: str, partitions: int) -> int:
    """The partition a record keyed `key` goes to (the producers' default partitioner, murmur2)."""
    every = list(range(partitions))
    return DefaultPartitioner()(key.encode(), every, every)


def key_on_partition_of(
    key: str, partitions: int, prefix: str = "marker-", as_key: Callable[[str], str] = lambda k: k
) -> str:
    """A new name whose key (`as_key(name)`) lands on the same partition as `as_key(key)`: a marker
    written after a record of `key` is handled after it by a consumer that keeps each partition's order."""
    want = partition_of(as_key(key), partitions)
    return next(
        k
        for k in (f"{prefix}{key}-{i}" for i in itertools.count())
        if partition_of(as_key(k), partitions) == want
    )


def one_key_per_partition(
    partitions: int, prefix: str, as_key: Callable[[str], str] = lambda k: k
) -> list[str]:
    """Names `prefix0`, `prefix1`, ... chosen so that their keys (`as_key(name)`) cover every partition."""
    found: dict[int, str] = {}
    for i in itertools.count():
        found.setdefault(partition_of(as_key(f"{prefix}{i}"), partitions), f"{prefix}{i}")
        if len(found) == partitions:
            return [found[p] for p in range(partitions)]


class Tap:
    """Reads a topic from its current end (or the beginning) and keeps every decoded event."""

    def __init__(self, spec: TopicSpec, from_beginning: bool = False) -> None:
        self.spec, self.from_beginning = spec, from_beginning
        self.events: list[tuple[Event, int]] = []  # (event, partition)
        self.undecodable = 0
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> Self:
        self.consumer = await start_consumer(group=None, isolation_level="read_committed")
        tps = [TopicPartition(self.spec.name, p) for p in range(self.spec.partitions)]
        self.consumer.assign(tps)
        if self.from_beginning:
            await self.consumer.seek_to_beginning(*tps)
        else:
            await self.consumer.seek_to_end(*tps)
            for tp in tps:
                await self.consumer.position(tp)  # fix the start now, before the test writes
        self._task = asyncio.create_task(self._run())
        return self

    async def _run(self) -> None:
        while True:
            for tp, records in (await self.consumer.getmany(timeout_ms=100)).items():
                for r in unpack_all(records):  # a step record: its chunks, in order
                    try:
                        self.events.append((decode_record(r, self.spec), tp.partition))
                    except DecodeError:  # a poison event (some tests write them): counted, not fatal
                        self.undecodable += 1

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self.consumer.stop()

    async def caught_up(self, timeout: float = 30.0) -> None:
        """Wait until this tap has read every partition to the end the topic has now (committed
        records only): whatever was written before this call is in `events` once it returns."""
        tps = [TopicPartition(self.spec.name, p) for p in range(self.spec.partitions)]
        ends = await self.consumer.end_offsets(tps)

        async def read() -> bool:
            return all([await self.consumer.position(tp) >= ends[tp] for tp in tps])

        await wait_for(read, timeout, f"{self.spec.name}: read to its end", interval=0.05)

    def matching(self, predicate: Callable[[Event], bool]) -> list[Event]:
        return [e for e, _ in self.events if predicate(e)]

    async def wait_for(
        self, predicate: Callable[[Event], bool], count: int = 1, timeout: float = 60.0
    ) -> list[Event]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.matching(predicate)
            if len(found) >= count:
                return found
            await asyncio.sleep(0.05)
        raise AssertionError(
            f"{self.spec.name}: {len(self.matching(predicate))} of {count} events after {timeout:.0f}s"
        )


async def group_settled(bootstrap: str, group: str, members: int, timeout: float = 120) -> None:
    """Wait until `group` is Stable with `members` members and every partition assigned (round robin
    then gives each member a share)."""
    from aiokafka.admin import AIOKafkaAdminClient

    from tokenstream.ops.lag import _group_states

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **kafka_auth.client_options())
    await admin.start()
    try:
        deadline = time.monotonic() + timeout
        while True:
            state = (await _group_states(admin, [group])).get(group)
            if (
                state
                and state.state == "Stable"
                and state.members == members
                and len(state.owners) >= members
            ):
                return
            assert time.monotonic() < deadline, f"group {group} not settled: {state}"
            await asyncio.sleep(0.5)
    finally:
        await admin.close()


async def caught_up(group: str, spec: TopicSpec, bootstrap: str) -> None:
    """Commit `group`'s offsets on `spec` at the log's end, while the group has no members: a
    processor of that group started next begins with what is written from then on, as a deployed
    one that kept up would, instead of first working through what earlier tests left on the
    session's broker."""
    consumer = await start_consumer(group=group, bootstrap=bootstrap)
    try:
        tps = [TopicPartition(spec.name, p) for p in range(spec.partitions)]
        consumer.assign(tps)
        await consumer.commit(await consumer.end_offsets(tps))
    finally:
        await consumer.stop()
