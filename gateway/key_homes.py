"""Which region every API key is at home in, as this gateway knows it (deployments with regions only).

`KeyHomes` reads ts.key.homes (this region's keys) and its copies from the other regions
(`<region>.ts.key.homes`, made by MirrorMaker 2) from the beginning and follows them, into a map
digest -> region held in memory (a digest and a short name per key). It also publishes the home of
every key of this region's durable store that the topic lacks, at start and whenever the number of
keys changes, so a key made with `tokenstream keys create` is known everywhere within seconds;
every gateway instance may do so (the same record twice is harmless on a compacted topic).

Until it has read every one of those topics to the end it is not `caught_up`, and the gateway is not
ready: it would otherwise answer 401 to a key at home elsewhere that it has not read yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiokafka.structs import TopicPartition

from producers import start_consumer, start_producer
from producers.consume import caught_up
from producers.publish import decode_record, publish
from schemas import DecodeError, KeyHome
from schemas import keys as K
from topics import KEY_HOMES
from topics.registry import mirror_of

log = logging.getLogger(__name__)

PUBLISH_EVERY_S = 2.0


class KeyHomes:
    def __init__(self, bootstrap: str, region: str, regions: list[str], redis) -> None:
        """`region`: this one; `regions`: every region of the deployment; `redis`: the durable store."""
        self.bootstrap, self.region, self.redis = bootstrap, region, redis
        self.topics = [KEY_HOMES.name, *(mirror_of(KEY_HOMES, r) for r in sorted(regions) if r != region)]
        self.homes: dict[str, str] = {}
        self.caught_up = False

    def home(self, digest: str) -> str | None:
        """The region the key hashing to `digest` is at home in, if any region published it."""
        return self.homes.get(digest)

    def tasks(self) -> list[asyncio.Task]:
        """Start following the topics and publishing this region's keys (the caller cancels them)."""
        return [
            asyncio.create_task(self._follow(), name="key-homes-follow"),
            asyncio.create_task(self._publish(), name="key-homes-publish"),
        ]

    async def _follow(self) -> None:
        while True:
            consumer = None
            try:
                consumer = await start_consumer(group=None, bootstrap=self.bootstrap)
                parts = await self._partitions(consumer)
                consumer.assign(parts)
                await consumer.seek_to_beginning(*parts)
                ends = await consumer.end_offsets(parts)
                while True:
                    batches = await consumer.getmany(timeout_ms=500)
                    for records in batches.values():
                        for record in records:
                            self._take(record)
                    if not self.caught_up and await caught_up(consumer, ends):
                        self.caught_up = True
                        log.info("key homes: %d keys known from %s", len(self.homes), ", ".join(self.topics))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the broker went away, or a copy is not there yet
                log.warning("key homes: not following %s: %s", ", ".join(self.topics), exc)
                await asyncio.sleep(1.0)
            finally:
                if consumer is not None:
                    with contextlib.suppress(Exception):
                        await consumer.stop()

    async def _partitions(self, consumer) -> list[TopicPartition]:
        cluster = await consumer._client.fetch_all_metadata()
        missing = [t for t in self.topics if not cluster.partitions_for_topic(t)]
        if missing:  # a region's copy appears once MirrorMaker has started and its source exists
            raise RuntimeError(f"no topic {', '.join(missing)} yet")
        own = [
            TopicPartition(KEY_HOMES.name, p) for p in sorted(cluster.partitions_for_topic(KEY_HOMES.name))
        ]
        return own + [
            TopicPartition(copy, p)
            for copy in self.topics[1:]
            for p in sorted(cluster.partitions_for_topic(copy))
        ]

    def _take(self, record) -> None:
        try:
            event = decode_record(record, KEY_HOMES)
        except DecodeError as exc:
            log.warning(
                "key homes: record %s/%d@%d skipped: %s", record.topic, record.partition, record.offset, exc
            )
            return
        if isinstance(event, KeyHome):
            self.homes[event.digest] = event.region

    async def _publish(self) -> None:
        """Publish the home of each key of this region's store that the topic lacks."""
        producer, counted = None, -1
        try:
            while True:
                try:
                    if self.caught_up and self.redis is not None:
                        keys = await self.redis.scard(K.API_KEYS)
                        if keys != counted:
                            producer = producer or await start_producer(self.bootstrap)
                            await self._publish_missing(producer)
                            counted = keys
                except Exception as exc:  # noqa: BLE001 - tried again at the next turn
                    log.warning("key homes: cannot publish this region's keys: %s", exc)
                await asyncio.sleep(PUBLISH_EVERY_S)
        finally:
            if producer is not None:
                with contextlib.suppress(Exception):
                    await producer.stop()

    async def _publish_missing(self, producer) -> None:
        digests = sorted(d.decode() for d in await self.redis.smembers(K.API_KEYS))
        unknown = [d for d in digests if self.homes.get(d) != self.region]
        for digest in unknown:
            region = await self.redis.hget(K.api_key(digest), "region")
            if region is not None and region.decode() not in ("", self.region):
                continue  # made at home elsewhere (a copy of another region's store): not ours to publish
            await publish(
                producer,
                KEY_HOMES,
                KeyHome(request_id=f"key-{digest[:16]}", digest=digest, region=self.region),
                key=digest,
            )
            self.homes[digest] = self.region
        if unknown:
            log.info("key homes: published %d keys at home in %s", len(unknown), self.region)
