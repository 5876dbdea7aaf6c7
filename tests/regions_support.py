"""Two regions for the residency test: the session's stack is region `eu` (its pipeline, with a worker,
is the full-chain module's), and a second stack, region `us`, gets a cluster, a durable Redis and a
gateway of its own; MirrorMaker 2 copies ts.key.homes between the two clusters.

Each region's gateway is a real `tokenstream gateway` process with TOKENSTREAM_REGION and
TOKENSTREAM_REGIONS set, as a deployment would run it.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

from common.config import settings
from tests.gateway_support import free_port, start_gateway
from tests.kafka_support import wait_for
from tokenstream.stack import Stack
from tokenstream.stack.mirror import MirrorMaker
from tokenstream.stack.stack import _folders, used
from topics.admin import apply
from topics.registry import REGISTRY, all_topics


@dataclass
class TwoRegions:
    eu: Stack
    us: Stack
    mirror: MirrorMaker
    eu_gateway: str
    us_gateway: str

    def region_env(self, region: str) -> dict[str, str]:
        urls = {"eu": self.eu_gateway, "us": self.us_gateway}
        return {"TOKENSTREAM_REGION": region, "TOKENSTREAM_REGIONS": json.dumps(urls)}


@contextlib.asynccontextmanager
async def two_regions(eu: Stack, roles, root: Path, model: str):
    us = Stack.ephemeral(root / "us")
    eu_port, us_port = free_port(), free_port()
    urls = {"eu": f"http://127.0.0.1:{eu_port}", "us": f"http://127.0.0.1:{us_port}"}
    mirror = MirrorMaker(
        *_folders(root / "mirror", settings().cache_dir),
        clusters={"eu": eu.kafka, "us": us.kafka},
        topics=tuple(s.name for s in REGISTRY if s.mirrored),
    )
    started = []
    try:
        for service in (us.kafka, us.redis, us.cache):
            service.start(print)
            started.append(service)
        regions = {"TOKENSTREAM_REGIONS": json.dumps(urls)}
        with used({**us.environment(), **regions, "TOKENSTREAM_REGION": "us"}):
            await apply(all_topics([model]), us.kafka.address)
        with used({**regions, "TOKENSTREAM_REGION": "eu"}):  # eu's gateway may read us's copy
            await apply(all_topics([model]), eu.kafka.address)
        mirror.start(print, wait=False)  # (its copies appear while the gateways start)
        started.append(mirror)
        eu_url, eu_proc = start_gateway(
            roles, [model], port=eu_port, wait_ready=False, env={"TOKENSTREAM_REGION": "eu", **regions}
        )
        us_env = {**us.environment(), "TOKENSTREAM_REGION": "us", **regions}
        us_url, us_proc = start_gateway(roles, [model], port=us_port, wait_ready=False, env=us_env)
        mirror.wait_ready()
        for url, proc in ((eu_url, eu_proc), (us_url, us_proc)):
            await wait_for(lambda url=url, proc=proc: _ready(url, proc, roles), 120, f"gateway {url} ready")
        yield TwoRegions(eu, us, mirror, eu_url, us_url)
    finally:
        for service in reversed(started):
            service.stop(print)


def files_holding(folder: Path, needle: bytes, suffix: str = "") -> list[Path]:
    """Every file under `folder` (named `*suffix`) whose bytes contain `needle`: a Redis's append-only
    files and snapshots; a broker's log segments (suffix ".log": its index files are 10 MiB of sparse
    offsets each)."""
    return [p for p in folder.rglob(f"*{suffix}") if p.is_file() and needle in p.read_bytes()]


async def _ready(url: str, proc, roles) -> bool:
    import httpx

    assert proc.poll() is None, "gateway exited:\n" + roles.log(proc)[-3000:]
    async with httpx.AsyncClient(timeout=2) as http:
        try:
            return (await http.get(url + "/health/ready")).status_code == 200
        except httpx.HTTPError:
            return False


async def records_on(kafka) -> dict[str, int]:
    """topic -> records written, for every tokenstream topic (ts.*, ts-*) of a cluster."""
    from aiokafka.structs import TopicPartition

    async with _consumer(kafka) as consumer:
        cluster = await consumer._client.fetch_all_metadata()
        parts = [
            TopicPartition(t, p)
            for t in cluster.topics()
            if t.startswith(("ts.", "ts-"))
            for p in cluster.partitions_for_topic(t)
        ]
        ends = await consumer.end_offsets(parts)
    out: dict[str, int] = {}
    for tp, end in ends.items():
        out[tp.topic] = out.get(tp.topic, 0) + end
    return {t: n for t, n in out.items() if n}


async def topics_holding(
    kafka, needles: list[bytes], topics: list[str] | None = None
) -> dict[bytes, set[str]]:
    """needle -> the topics (default: every topic of the cluster, its internal ones too) with a record
    whose key, value or headers contain it, read as a consumer reads them (decompressed)."""
    from aiokafka.structs import TopicPartition

    from producers.consume import caught_up

    found: dict[bytes, set[str]] = {n: set() for n in needles}
    async with _consumer(kafka) as consumer:
        cluster = await consumer._client.fetch_all_metadata()
        parts = [
            TopicPartition(t, p)
            for t in (topics or cluster.topics())
            for p in cluster.partitions_for_topic(t)
        ]
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        ends = await consumer.end_offsets(parts)
        while not await caught_up(consumer, ends):
            for tp, records in (await consumer.getmany(timeout_ms=500)).items():
                for r in records:
                    raw = b"".join([r.key or b"", r.value or b"", *(v for _, v in r.headers)])
                    for needle in needles:
                        if needle in raw:
                            found[needle].add(tp.topic)
    return found


@contextlib.asynccontextmanager
async def _consumer(kafka):
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(
        bootstrap_servers=kafka.address, enable_auto_commit=False, **kafka.client_options()
    )
    await consumer.start()
    try:
        yield consumer
    finally:
        await consumer.stop()
