"""Resumes and takeovers read a request's events from its first record, not from its admission.

Real Kafka and Redis: the benchmark's synthetic worker writes token events and notes each request's
first record the way a worker does (common/first_records.py). Between the requests' admission and
their first tokens, other requests' records fill their partitions: a read from the admission time
would read all of them, a read from the first records reads none.

- A gateway that restarts with many live streams: every stream resumes at once (gateway.resume.replay,
  on a fresh process's readers), gets every token once and in order through one consumer per partition,
  and no reader ever seeks before the lowest first record of the streams it serves; a resume arriving
  later, behind the reader, is served from the records it keeps, without a seek or a read.
  (tests/test_resume_restart.py, `heavy`: the same through two real gateway processes over HTTP.)
- A request whose note is missing (its writer died before the ack) falls back to the admission time.
- A worker's takeover read (gpu_workers.recovery.TokenLog) starts at the first records too, and notes
  the first record it found of a request that had none.
- A gateway that stops (Gateway.stop) stops its resumes' readers; the resumes they serve end.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis
from prometheus_client import generate_latest

from bench.gateway import SyntheticWorker
from gateway import replays
from gateway.metrics import Metrics
from gateway.resume import read_so_far, replay
from gpu_workers.recovery import TokenLog
from schemas import Completion
from schemas import keys as K
from schemas.ids import new_request_id
from tests.gateway_support import fill
from topics import CHAT_REQUESTS, TOKENS
from topics.admin import apply

STREAMS = 1000
PARTITIONS = (3, 4)
FILLER = 1500  # other requests' records on each partition between admission and first tokens
TOKENS_BEFORE = 3  # tokens written before the restart
TOKENS_AFTER = 3  # tokens written while the resumes are live


async def _until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def _ends(bootstrap: str, partitions) -> dict[int, int]:
    from aiokafka.structs import TopicPartition

    from producers import start_consumer

    consumer = await start_consumer(group=None, bootstrap=bootstrap)
    try:
        tps = [TopicPartition(TOKENS.name, p) for p in partitions]
        return {tp.partition: off for tp, off in (await consumer.end_offsets(tps)).items()}
    finally:
        await consumer.stop()


@pytest.fixture
async def worker(stack):
    await apply([CHAT_REQUESTS, TOKENS], stack.kafka.address)
    w = await SyntheticWorker(stack.kafka.address).start()
    yield w
    await w.stop()


async def test_a_restart_with_1000_live_streams_resumes_each_from_its_first_record(stack, worker):
    bootstrap = stack.kafka.address
    now = time.time()
    rids = [new_request_id(PARTITIONS[i % len(PARTITIONS)], now) for i in range(STREAMS)]
    for i, rid in enumerate(rids):
        worker.arrived[rid] = (PARTITIONS[i % len(PARTITIONS)], now)
    for p in PARTITIONS:  # traffic of other requests after their admission, before their first tokens
        await fill(worker.producer, p, FILLER)
    before_first = await _ends(bootstrap, PARTITIONS)
    for seq in range(TOKENS_BEFORE):
        await worker.tick(rids, seq, last=False)
    await _until(lambda: worker.first.written >= STREAMS)

    # the restarted gateway: a fresh process's readers, every stream resuming at once
    hub = replays.hub(bootstrap)
    await hub.close()
    hub.stats = replays.Stats()
    got: dict[str, list] = {}

    async def resume(rid: str) -> None:
        got[rid] = []
        async for batch in replay(bootstrap, rid, idle_timeout_s=60):
            got[rid].extend(batch)

    tasks = [asyncio.create_task(resume(r)) for r in rids]
    await _until(lambda: sum(len(v) for v in got.values()) >= STREAMS * TOKENS_BEFORE)
    for seq in range(TOKENS_BEFORE, TOKENS_BEFORE + TOKENS_AFTER):  # live from here on
        await worker.tick(rids, seq, last=seq == TOKENS_BEFORE + TOKENS_AFTER - 1)
    await asyncio.wait_for(asyncio.gather(*tasks), 60)

    want = list(range(TOKENS_BEFORE + TOKENS_AFTER + 1))
    for rid in rids:  # every token once, in order, then the completion
        assert [e.seq for e in got[rid]] == want, (rid, got[rid])
        assert isinstance(got[rid][-1], Completion)
    stats = hub.stats
    assert stats.consumers_started == len(PARTITIONS), stats  # one consumer per partition
    assert stats.exact == STREAMS and stats.fallback == 0, stats
    for partition, offset in stats.seeks:  # never before the streams' first records: no filler read
        assert offset >= before_first[partition], (partition, offset, before_first)
    ends = await _ends(bootstrap, PARTITIONS)
    written = sum(ends[p] - before_first[p] for p in PARTITIONS)
    assert stats.records_read <= len(stats.seeks) * written, stats.records_read
    # a resume arriving later, behind the reader's position: served from the records it keeps
    seeks, read = list(stats.seeks), stats.records_read
    again = [e for batch in [b async for b in replay(bootstrap, rids[0], idle_timeout_s=60)] for e in batch]
    assert [e.seq for e in again] == want
    assert list(stats.seeks) == seeks and stats.consumers_started == len(PARTITIONS), stats.seeks
    assert stats.records_read == read  # nothing read again (nothing new was written meanwhile)
    scraped = generate_latest(Metrics().registry).decode()  # what /metrics says of the same readers
    assert f'gateway_resume_starts_total{{start="first_record"}} {float(STREAMS + 1)}' in scraped, scraped
    assert f"gateway_resume_records_read_total {float(stats.records_read)}" in scraped
    scan = sum(FILLER + ends[p] - before_first[p] for p in PARTITIONS) // len(PARTITIONS) * STREAMS
    print(
        f"{STREAMS} resumes: {stats.records_read} records read by {stats.consumers_started} consumers in"
        f" {len(stats.seeks)} seeks; one consumer per resume reading from admission: ~{scan} records"
    )
    await hub.close()


async def test_a_missing_note_falls_back_to_the_admission_time(stack, worker):
    bootstrap = stack.kafka.address
    partition = 5
    noted, lost = new_request_id(partition, time.time()), new_request_id(partition, time.time())
    worker.arrived.update({noted: (partition, time.time()), lost: (partition, time.time())})
    await fill(worker.producer, partition, 200)
    for seq in range(3):
        await worker.tick([noted, lost], seq, last=seq == 2)
    await _until(lambda: worker.first.written >= 2)
    r = aioredis.from_url(stack.redis.address)
    assert (await r.get(K.first_record(noted))) is not None
    await r.delete(K.first_record(lost))  # as if its writer died before the ack
    hub = replays.hub(bootstrap)
    await hub.close()
    hub.stats = replays.Stats()
    events = {rid: await read_so_far(bootstrap, rid) for rid in (noted, lost)}
    for rid in (noted, lost):
        assert [e.seq for e in events[rid]] == [0, 1, 2, 3], events[rid]
    assert hub.stats.exact == 1 and hub.stats.fallback == 1, hub.stats

    # a takeover: one read from the noted request's first record; the other's is found and noted
    log = TokenLog(bootstrap, stack.redis.address)
    await log.start()
    try:
        wanted = [(rid, partition, time.time() - 30) for rid in (noted, lost)]
        emitted = await log.emitted(wanted)
        assert [c.seq for c in emitted[noted].chunks] == [0, 1, 2] and emitted[noted].completion is not None
        assert [c.seq for c in emitted[lost].chunks] == [0, 1, 2] and emitted[lost].completion is not None
        first = int((await r.get(K.first_record(noted))).split(b":")[1])
        # noted by the read: the step record holding both chunks 0 (schemas/steps.py)
        assert await r.get(K.first_record(lost)) == f"{partition}:{first}".encode()
        scanned = log.records_read
        emitted = await log.emitted(
            [(noted, partition, time.time() - 30), (lost, partition, time.time() - 30)]
        )
        assert [c.seq for c in emitted[lost].chunks] == [0, 1, 2]
        # three step records and two Completions: the filler is not read again
        assert log.records_read - scanned == 5, log.records_read - scanned
    finally:
        await log.stop()
        await r.aclose()
        await hub.close()


async def test_a_gateway_stopping_stops_its_resumes_readers(stack, worker):
    from gateway.config import GatewaySettings
    from gateway.pipeline import Gateway

    bootstrap, partition = stack.kafka.address, 6
    rid = new_request_id(partition, time.time())
    worker.arrived[rid] = (partition, time.time())
    await worker.tick([rid], 0, last=False)
    gw = Gateway(GatewaySettings(models=["smollm2"]), bootstrap, redis_url=None)
    got: list = []

    async def resume() -> None:
        async for batch in replay(bootstrap, rid, idle_timeout_s=60):
            got.extend(batch)

    resuming = asyncio.create_task(resume())
    await _until(lambda: got)
    hub = replays.hub(bootstrap)
    reader = hub.readers[partition]
    await gw.stop()
    assert reader.task.done() and hub._redis is None and partition not in hub.readers
    await asyncio.wait_for(resuming, 10)  # the resume it served ended with it
