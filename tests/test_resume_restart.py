"""A gateway restart with 1,000 live streams: every client resumes on the new process with
`Last-Event-ID`, gets each token after the one it saw once and in order, and the new process reads
each partition from its streams' first records (its replay readers log what they took in and read).

The tokens come from the benchmark's synthetic worker, which notes each request's first record as a
worker does; the gateways, Kafka and Redis are real. Other requests' records fill the partitions
between the streams' admission and their first tokens: a resume reading from the admission would read
them, one reading from the first records reads none.
"""

from __future__ import annotations

import asyncio
import re
import resource
import time
from pathlib import Path

import pytest

from bench.gateway import MODEL, SyntheticWorker, synthetic_gateway
from bench.rawhttp import chat_post
from bench.sse_clients import Clients
from producers import start_consumer
from tests.gateway_support import fill
from topics import TOKENS

pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # two gateways and 2,000 streams: about a minute
STREAMS = 1000
FILLER = 200  # other requests' records on each partition after admission, before the first tokens
BEFORE, AFTER = 3, 3  # tokens written before the restart / after the resumes were taken in

TAKEN_IN = re.compile(rb"replay reader of \S+?, partition=(\d+)\S*: (\d+) resumes taken in, (\d+) from")
SEEK = re.compile(rb"replay reader of \S+?, partition=(\d+)\S*: .*seek to (\d+)")
STOPPED = re.compile(rb"replay reader of .* stopped: (\d+) records read, (\d+) seeks, (\d+) resumes")


async def _until(condition, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


async def _ends(bootstrap: str) -> dict[int, int]:
    from aiokafka.structs import TopicPartition

    consumer = await start_consumer(group=None, bootstrap=bootstrap)
    try:
        tps = [TopicPartition(TOKENS.name, p) for p in range(TOKENS.partitions)]
        return {tp.partition: off for tp, off in (await consumer.end_offsets(tps)).items()}
    finally:
        await consumer.stop()


def _resume(port: int, rid: str, last: int | None, key: str) -> bytes:
    seen = f"Last-Event-ID: {rid}:{last}\r\n" if last is not None else ""
    return (
        f"GET /v1/chat/completions/chatcmpl-{rid}/stream HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n"
        f"Authorization: Bearer {key}\r\n{seen}\r\n"
    ).encode()


async def test_a_gateway_restart_with_1000_live_streams_resumes_each_from_its_first_record(stack, tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    bootstrap = stack.kafka.address
    first_dir, second_dir = tmp_path / "a", tmp_path / "b"
    first_dir.mkdir()
    second_dir.mkdir()
    async with synthetic_gateway(stack, first_dir, "restart a") as (_, port, key):
        worker = await SyntheticWorker(bootstrap).start()
        try:
            body = {"model": MODEL, "stream": True, "max_tokens": 64}
            clients = Clients(
                port,
                [
                    chat_post(port, {**body, "messages": [{"role": "user", "content": f"s{i}"}]}, key=key)
                    for i in range(STREAMS)
                ],
            ).start()
            await _until(lambda: len(worker.arrived) >= STREAMS, "every request reached the worker")
            rids = list(worker.arrived)
            for p in range(TOKENS.partitions):  # traffic after admission, before the first tokens
                await fill(worker.producer, p, FILLER)
            before_first = await _ends(bootstrap)
            for seq in range(BEFORE):
                await worker.tick(rids, seq, last=False)
            await _until(lambda: worker.first.written >= STREAMS, "first records noted")
            await _until(lambda: clients.opened.value >= STREAMS, "every stream got a frame")
        except BaseException:
            await worker.stop()
            raise
    first = await clients.result(timeout=60)  # the gateway is gone: every stream was cut
    seen = {rid: max(first.received[rid]) for rid in rids if first.received.get(rid)}

    try:
        async with synthetic_gateway(stack, second_dir, "restart b") as (_, port, key):
            log_path = Path(second_dir / "gateway.log")
            clients = Clients(port, [_resume(port, rid, seen.get(rid), key) for rid in rids]).start()
            taken = lambda: sum(int(m[1]) for m in TAKEN_IN.findall(log_path.read_bytes()))
            await _until(lambda: taken() >= STREAMS, "every resume taken in")
            for seq in range(BEFORE, BEFORE + AFTER):  # live from here on
                await worker.tick(rids, seq, last=seq == BEFORE + AFTER - 1)
            second = await clients.result(timeout=120)
            await _until(lambda: STOPPED.search(log_path.read_bytes()), "the readers stopped", 60)
            text = log_path.read_bytes()
    finally:
        await worker.stop()

    last = BEFORE + AFTER  # the completion's position
    assert second.statuses == {"200": STREAMS}, second.statuses
    assert second.out_of_order == 0 and second.connect_errors == 0
    for rid in rids:
        got = sorted(second.received.get(rid, {}))
        assert got and got[-1] >= last - 1, (rid, seen.get(rid), got)  # to the end
        assert all(s > seen.get(rid, -10) for s in got), (rid, seen.get(rid), got)  # nothing seen twice
    from_first = sum(int(m[2]) for m in TAKEN_IN.findall(text))
    assert from_first == STREAMS and sum(int(m[1]) for m in TAKEN_IN.findall(text)) == STREAMS, from_first
    for partition, offset in SEEK.findall(text):  # no record before the streams' first ones is read
        assert int(offset) >= before_first[int(partition)], (partition, offset, before_first)
    ends = await _ends(bootstrap)
    written = sum(ends[p] - before_first[p] for p in range(TOKENS.partitions))
    records, seeks = (int(x) for x in STOPPED.findall(text)[-1][:2])
    assert records <= seeks * written, (records, seeks, written)
    print(
        f"restart with {STREAMS} streams: {records} records read in {seeks} seeks"
        f" ({written} written since the first records, {FILLER * TOKENS.partitions} before them)"
    )
