"""The notary: chains every audited topic's records and writes signed checkpoints (`audit notarize`).

It reads each partition of every topic an auditor reads (not the compacted ones, whose old records
are meant to go) in offset order from where its last checkpoint ended, digests each record
(`audit/ledger_math.py`) and writes a `Checkpoint` per partition that moved: every `interval_s`
seconds, at `max_records` records, and at the end of a pass. Run it once to catch up to the log's
end, or with `follow` to keep the ledger a few seconds behind the log.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

from aiokafka.structs import TopicPartition

from audit import ledger_math as lm
from audit.scan import merged, spans_between
from audit.signer import Signer
from audit.sources import audited
from producers import decode_record, publish, start_consumer, start_producer, stop_clients
from schemas import Checkpoint
from topics import LEDGER, TopicSpec
from topics.admin import partition_counts

MAX_RECORDS = 500  # digests per checkpoint: 500 x 64 hex digits stay far below the broker's 1 MiB


def ledgered(existing: list[str]) -> list[TopicSpec]:
    """The topics the ledger attests: every audited one on the broker except the compacted and itself."""
    return [s for s in audited(existing) if not s.compacted and s.name != LEDGER.name]


@dataclass
class Chain:
    """Where one partition's ledger stands: the last attested offset and the head after it."""

    last_offset: int = -1
    head: str = lm.ZERO_HEAD
    pending: list[tuple[int, str]] = field(default_factory=list)


async def read_ledger(bootstrap: str) -> dict[tuple[str, int], list[Checkpoint]]:
    """Every checkpoint on the ledger topic, per attested partition, in the order written (one attested
    partition's checkpoints share a key, so a ledger partition, whose order the scan keeps)."""
    consumer = await start_consumer(group=None, bootstrap=bootstrap)
    try:
        tps = [TopicPartition(LEDGER.name, p) for p in range(LEDGER.partitions)]
        out: dict[tuple[str, int], list[Checkpoint]] = {}
        async for batch in merged(consumer, await spans_between(consumer, tps, None, None), {LEDGER.name: 0}):
            for record in batch:
                cp = decode_record(record, LEDGER)
                out.setdefault((cp.topic, cp.partition), []).append(cp)
        return out
    finally:
        await consumer.stop()


async def notarize(
    bootstrap: str,
    signer: Signer,
    *,
    follow: bool = False,
    interval_s: float = 5.0,
    max_records: int = MAX_RECORDS,
    heartbeat: Path | None = None,
    say=print,
) -> int:
    """Attest every record written since the last checkpoints; the number of records attested."""
    counts = await partition_counts(bootstrap)
    specs = ledgered(list(counts))
    chains: dict[TopicPartition, Chain] = {}
    for (topic, partition), cps in (await read_ledger(bootstrap)).items():
        chains[TopicPartition(topic, partition)] = Chain(cps[-1].last_offset, cps[-1].head)
    tps = [TopicPartition(s.name, p) for s in specs for p in range(counts[s.name])]
    producer = await start_producer(bootstrap)
    consumer = await start_consumer(group=None, bootstrap=bootstrap, from_beginning=True)
    attested = 0
    try:
        consumer.assign(tps)
        for tp in tps:
            chain = chains.setdefault(tp, Chain())
            if chain.last_offset >= 0:
                consumer.seek(tp, chain.last_offset + 1)
        await consumer.seek_to_beginning(*[tp for tp in tps if chains[tp].last_offset < 0])
        ends = await consumer.end_offsets(tps)
        last_flush = time.monotonic()
        while True:
            if heartbeat is not None:  # a liveness probe's: the loop goes round (Kubernetes, deploy/k8s)
                heartbeat.touch()
            for tp, records in (await consumer.getmany(timeout_ms=500, max_records=2000)).items():
                chain = chains[tp]
                for r in records:
                    chain.pending.append(
                        (r.offset, lm.record_digest(r.timestamp, r.key, r.value, list(r.headers)))
                    )
                    if len(chain.pending) >= max_records:
                        attested += await _checkpoint(producer, signer, tp, chain)
            if time.monotonic() - last_flush >= interval_s:
                attested += await _flush(producer, signer, chains)
                last_flush = time.monotonic()
            if not follow and not [tp for tp in tps if await consumer.position(tp) < ends[tp]]:
                attested += await _flush(producer, signer, chains)
                return attested
    finally:
        await stop_clients(consumer, producer)


async def _flush(producer, signer: Signer, chains: dict[TopicPartition, Chain]) -> int:
    return sum([await _checkpoint(producer, signer, tp, c) for tp, c in chains.items() if c.pending])


async def _checkpoint(producer, signer: Signer, tp: TopicPartition, chain: Chain) -> int:
    offsets, digests = [o for o, _ in chain.pending], [d for _, d in chain.pending]
    cp = Checkpoint(
        request_id=f"{tp.topic}/{tp.partition}",
        topic=tp.topic,
        partition=tp.partition,
        first_offset=offsets[0],
        last_offset=offsets[-1],
        offsets=offsets,
        record_digests=digests,
        prev_head=chain.head,
        head=lm.fold(chain.head, digests),
        signed_at=time.time(),
        key_id=signer.key_id,
    )
    cp = signer.sign(cp)
    await publish(producer, LEDGER, cp, key=cp.request_id)
    chain.last_offset, chain.head, chain.pending = cp.last_offset, cp.head, []
    return len(offsets)


async def run_forever(
    bootstrap: str, signer: Signer, interval_s: float, heartbeat: Path | None = None, say=print
) -> None:
    """`notarize --follow`: starts again after a broker outage (the ledger on the topic is the state)."""
    while True:
        try:
            await notarize(
                bootstrap, signer, follow=True, interval_s=interval_s, heartbeat=heartbeat, say=say
            )
        except Exception as exc:  # noqa: BLE001 - the broker went away: begin again from the ledger
            say(f"notary: {type(exc).__name__}: {exc}; starting again in 5 s")
            await asyncio.sleep(5)
