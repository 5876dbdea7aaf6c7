"""What `bench tokens` reads off the running system at the edges of a stage's window, and after it.

- `Meter.sample()`: the time, each role process's CPU seconds (psutil, user + system, children
  included), every topic's end offsets and the bytes of every topic's log segments on the broker's
  disk (what the log wrote, batch framing included);
- `Meter.catch_up(...)`: how long after the window each consumer group reading ts.tokens took to commit
  past the window's last record (the processors keep up, or fall behind);
- `Meter.chunks(...)`: the ts.tokens records between two samples' offsets, decoded with the project's
  codec (sealed content opened, a step record's chunks unpacked): each token chunk's request, number,
  created_at, token count, record and its share of the record's size.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Sample:
    at: float
    cpu_s: dict[str, float]
    offsets: dict[tuple[str, int], int]
    log_bytes: dict[str, int]


@dataclass
class Chunk:
    request_id: str
    seq: int
    created_at: float
    tokens: int
    size: float  # its record's key + value + headers, bytes (a step record's shared among its chunks)
    record: tuple[int, int]  # its record's partition and offset (a step record's chunks: the same)


@dataclass
class Meter:
    bootstrap: str
    log_dir: Path  # the broker's log.dirs
    pids: dict[str, int] = field(default_factory=dict)  # role name -> pid

    async def start(self) -> Meter:
        from aiokafka.admin import AIOKafkaAdminClient

        from common import kafka_auth
        from producers import start_consumer

        self.consumer = await start_consumer(group=None, bootstrap=self.bootstrap)
        self.admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap, **kafka_auth.client_options())
        await self.admin.start()
        return self

    async def stop(self) -> None:
        await self.consumer.stop()
        await self.admin.close()

    def cpu(self) -> dict[str, float]:
        import psutil

        seconds = {}
        for name, pid in self.pids.items():
            try:
                t = psutil.Process(pid).cpu_times()
            except psutil.Error:
                continue
            seconds[name] = t.user + t.system + t.children_user + t.children_system
        return seconds

    def log_bytes(self) -> dict[str, int]:
        """Bytes of each topic's segment files (`<topic>-<partition>/*.log`)."""
        sizes: dict[str, int] = {}
        for folder in self.log_dir.iterdir():
            topic, _, partition = folder.name.rpartition("-")
            if not folder.is_dir() or not partition.isdigit():
                continue
            for segment in folder.glob("*.log"):
                try:
                    sizes[topic] = sizes.get(topic, 0) + segment.stat().st_size
                except FileNotFoundError:  # rolled or deleted meanwhile
                    pass
        return sizes

    def partitions(self) -> list:
        """Every partition the broker holds (its log folders), internal topics aside."""
        from aiokafka.structs import TopicPartition

        found = []
        for folder in self.log_dir.iterdir():
            topic, _, partition = folder.name.rpartition("-")
            if folder.is_dir() and partition.isdigit() and not topic.startswith("__"):
                found.append(TopicPartition(topic, int(partition)))
        return found

    async def offsets(self) -> dict[tuple[str, int], int]:
        ends = await self.consumer.end_offsets(self.partitions())
        return {(tp.topic, tp.partition): offset for tp, offset in ends.items()}

    async def sample(self) -> Sample:
        offsets = await self.offsets()
        return Sample(time.time(), self.cpu(), offsets, self.log_bytes())

    async def catch_up(self, topic: str, target: dict[tuple[str, int], int], limit_s: float) -> dict:
        """Seconds until each consumer group of `topic` committed at least `target` on every partition,
        or, where one did not within `limit_s`, how many records it was still behind then."""
        started = time.monotonic()
        wanted = {tp: off for tp, off in target.items() if tp[0] == topic and off > 0}
        groups = [g[0] for g in await self.admin.list_consumer_groups()]
        done: dict[str, float | None] = {}
        behind: dict[str, int] = {}
        for group in groups:
            committed = await self.admin.list_consumer_group_offsets(group)
            if any(tp.topic == topic for tp in committed):
                done[group] = None
        while any(v is None for v in done.values()):
            for group in [g for g, v in done.items() if v is None]:
                committed = {
                    (tp.topic, tp.partition): m.offset
                    for tp, m in (await self.admin.list_consumer_group_offsets(group)).items()
                }
                behind[group] = sum(max(0, off - committed.get(tp, 0)) for tp, off in wanted.items())
                if not behind[group]:
                    done[group] = round(time.monotonic() - started, 2)
            if time.monotonic() - started > limit_s:
                break
            await asyncio.sleep(0.25)
        return {g: s if s is not None else {"behind_records": behind[g]} for g, s in done.items()}

    async def chunks(self, topic: str, start: Sample, end: Sample) -> list[Chunk]:
        """The token chunks written to `topic` between the two samples."""
        from aiokafka.structs import TopicPartition

        from schemas import TokenChunk, decode
        from schemas.headers import EVENT_TYPE
        from schemas.steps import unpack

        ranges = {
            TopicPartition(t, p): (start.offsets.get((t, p), 0), off)
            for (t, p), off in end.offsets.items()
            if t == topic and off > start.offsets.get((t, p), 0)
        }
        found: list[Chunk] = []
        if not ranges:
            return found
        self.consumer.assign(list(ranges))
        for tp, (first, _) in ranges.items():
            self.consumer.seek(tp, first)
        left = set(ranges)
        while left:
            batches = await self.consumer.getmany(*left, timeout_ms=1000, max_records=5000)
            for tp, records in batches.items():
                last = ranges[tp][1]
                for record in records:
                    if record.offset >= last:
                        break
                    size = len(record.value or b"") + len(record.key or b"")
                    size += sum(len(k.encode()) + len(v or b"") for k, v in record.headers or ())
                    held = unpack(record)  # a step record: its chunks, sharing its size
                    for one in held:
                        if dict(one.headers or ()).get(EVENT_TYPE) != b"token_chunk":
                            continue  # a completion, an in-band verdict
                        event = decode(one.value, TokenChunk)
                        tokens = max(1, len(event.token_ids))
                        found.append(
                            Chunk(
                                event.request_id,
                                event.seq,
                                event.created_at,
                                tokens,
                                size / len(held),
                                (tp.partition, record.offset),
                            )
                        )
            for tp in list(left):
                if await self.consumer.position(tp) >= ranges[tp][1]:
                    left.discard(tp)
        self.consumer.unsubscribe()
        return found
