"""Proving a range of the log whole and in order (`audit verify`), and the bundle a third party checks
without our code (`audit export`).

verify: for each attested partition, the checkpoints of the range (signed, chained, each head the
fold of its digests), then every record they attest, read back from the topic (or from a copy of it:
`copies`), compared in order with what was attested: the first record changed, removed, reordered or
inserted is named (`audit/ledger_math.py`). A tenant narrows the report to the partitions holding
its records; the proof still covers each of them whole.

export: manifest.json (range, counts, public key), checkpoints.jsonl, records.jsonl (each attested
record with its bytes, base64; a record of another tenant than the one asked for as its digest
alone, so nothing of theirs leaves), requests.jsonl (per request: ids, tenant, model, admission and
finish times, input and output sha256, safety verdicts, tool calls) and verify.py (the verifier).
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from aiokafka.structs import TopicPartition

from audit import ledger_math as lm
from audit.notary import read_ledger
from audit.scan import Span, merged, spans_between
from audit.signer import as_dict
from producers import start_consumer
from schemas import ChatRequest, Checkpoint, Completion, DecodeError, SafetyVerdict, ToolCall, decode
from schemas.steps import unpack


@dataclass
class PartitionProof:
    topic: str
    partition: int
    checkpoints: int
    attested: int
    problem: str | None
    read_from: str  # the topic the records were read from (the original, or a copy of it)


def _in_range(cp: Checkpoint, since_ms: int | None, until_ms: int | None) -> bool:
    at = cp.signed_at * 1000
    return (since_ms is None or at >= since_ms) and (until_ms is None or at <= until_ms)


async def _records(bootstrap: str, topic: str, partition: int, first: int | None, last: int | None) -> list:
    """The records of one partition from offset `first` through `last` (None: from its start, to its end)."""
    consumer = await start_consumer(group=None, bootstrap=bootstrap, from_beginning=True)
    try:
        return await _read(consumer, topic, partition, first, last)
    finally:
        await consumer.stop()


async def _read(consumer, topic: str, partition: int, first: int | None, last: int | None) -> list:
    """`_records` with a consumer of the caller's (one for every partition of a proof or an export)."""
    tp = TopicPartition(topic, partition)
    [span] = await spans_between(consumer, [tp], None, None) or [Span(tp, 0, 0)]
    if first is not None:
        span = Span(tp, first, span.stop if last is None else min(span.stop, last + 1))
    return [r async for batch in merged(consumer, [span], {topic: 0}, unpack=False) for r in batch]


def _digest(record) -> str:
    return lm.record_digest(record.timestamp, record.key, record.value, list(record.headers))


def _events(record) -> list:
    """The events a record holds, its own or a step record's chunks (schemas/steps.py), each None where
    no event type reads its bytes."""
    try:
        held = unpack(record)
    except DecodeError:
        return [None]
    return [_event(r) for r in held]


def _event(record):
    try:
        return decode(record.value or b"")
    except DecodeError:
        return None


def _tenants_of(record) -> set[str]:
    return {e.tenant for e in _events(record) if e is not None}


async def prove(
    bootstrap: str,
    public_key: bytes,
    *,
    since_ms: int | None = None,
    until_ms: int | None = None,
    tenant: str | None = None,
    copies: dict[str, str] | None = None,
    topics: set[str] | None = None,
) -> list[PartitionProof]:
    """One proof per attested partition (of `topics` only, or of the `copies`' topics, when given)."""
    copies = copies or {}
    out = []
    consumer = await start_consumer(group=None, bootstrap=bootstrap, from_beginning=True)
    try:
        ledger = await read_ledger(bootstrap)
        for (topic, partition), cps in sorted(ledger.items()):
            proof = await _prove_one(
                consumer, topic, partition, cps, public_key, since_ms, until_ms, tenant, copies, topics
            )
            if proof is not None:
                out.append(proof)
    finally:
        await consumer.stop()
    return out


async def _prove_one(
    consumer,
    topic: str,
    partition: int,
    cps: list[Checkpoint],
    public_key: bytes,
    since_ms: int | None,
    until_ms: int | None,
    tenant: str | None,
    copies: dict[str, str],
    topics: set[str] | None,
) -> PartitionProof | None:
    cps = [c for c in cps if _in_range(c, since_ms, until_ms)]
    if not cps or (copies and topic not in copies) or (topics is not None and topic not in topics):
        return None
    source = copies.get(topic, topic)
    if source == topic:
        records = await _read(consumer, topic, partition, cps[0].first_offset, cps[-1].last_offset)
    else:  # a copy holds the range from its own start, at offsets of its own
        records = await _read(consumer, source, partition, None, None)
    if tenant is not None and not any(tenant in _tenants_of(r) for r in records):
        return None
    attested = [(o, d) for c in cps for o, d in zip(c.offsets, c.record_digests, strict=True)]
    problem = lm.check_checkpoints([as_dict(c) for c in cps], public_key) or lm.first_difference(
        attested, [(r.offset, _digest(r)) for r in records]
    )
    return PartitionProof(topic, partition, len(cps), len(attested), problem, source)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _request_fields(event, requests: dict[str, dict]) -> None:
    """Fold one decoded event into the per-request record-keeping fields."""
    row = requests.setdefault(
        event.request_id, {"request_id": event.request_id, "verdicts": [], "tool_calls": []}
    )
    if isinstance(event, ChatRequest):
        row.update(
            conversation_id=event.conversation_id,
            tenant=event.tenant,
            model=event.model,
            admitted_at=event.created_at,
            input_sha256=_sha(json.dumps([m.content for m in event.messages], default=str)),
        )
    elif isinstance(event, Completion):
        row.update(
            finished_at=event.created_at,
            finish_reason=event.finish_reason,
            output_sha256=_sha(event.text),
            usage={"prompt": event.usage.prompt_tokens, "completion": event.usage.completion_tokens},
            worker_id=event.worker_id,
        )
    elif isinstance(event, SafetyVerdict):
        row["verdicts"].append(
            {
                "stage": event.stage,
                "blocked": event.blocked,
                "categories": event.categories,
                "policy": event.policy_version,
            }
        )
    elif isinstance(event, ToolCall):
        row["tool_calls"].append(
            {"call_id": event.call_id, "name": event.name, "arguments_sha256": _sha(event.arguments)}
        )


async def export(
    bootstrap: str,
    signer_public_key: bytes,
    folder: Path,
    *,
    since_ms: int | None = None,
    until_ms: int | None = None,
    tenant: str | None = None,
) -> dict:
    """Write the bundle; its manifest."""
    folder.mkdir(parents=True, exist_ok=True)
    n_records = n_partitions = 0
    requests: dict[str, dict] = {}
    consumer = await start_consumer(group=None, bootstrap=bootstrap, from_beginning=True)
    try:
        with (
            (folder / "checkpoints.jsonl").open("w") as cps_out,
            (folder / "records.jsonl").open("w") as rec_out,
        ):
            for (topic, partition), cps in sorted((await read_ledger(bootstrap)).items()):
                cps = [c for c in cps if _in_range(c, since_ms, until_ms)]
                if not cps:
                    continue
                records = await _read(consumer, topic, partition, cps[0].first_offset, cps[-1].last_offset)
                events = [_events(r) for r in records]  # each record decoded once
                if tenant is not None and not any(tenant in {e.tenant for e in es if e} for es in events):
                    continue
                n_partitions += 1
                for cp in cps:
                    cps_out.write(json.dumps(as_dict(cp)) + "\n")
                for r, held in zip(records, events, strict=True):
                    n_records += 1
                    row = {"topic": topic, "partition": partition, "offset": r.offset}
                    if tenant is not None and not all(e is not None and e.tenant == tenant for e in held):
                        # another tenant's record (or a step record holding another's chunk too): its
                        # place, not its content
                        row["digest"] = _digest(r)
                    else:
                        row.update(
                            timestamp=r.timestamp,
                            key=_b64(r.key),
                            value=_b64(r.value),
                            headers=[[k, base64.b64encode(bytes(v)).decode()] for k, v in r.headers],
                        )
                        for event in held:
                            if event is not None:
                                _request_fields(event, requests)
                    rec_out.write(json.dumps(row) + "\n")
    finally:
        await consumer.stop()
    with (folder / "requests.jsonl").open("w") as out:
        for row in requests.values():
            if "tenant" in row or tenant is None:
                out.write(json.dumps(row, default=str) + "\n")
    shutil.copyfile(Path(lm.__file__), folder / "verify.py")
    manifest = {
        "format": "tokenstream-audit-bundle-1",
        "since_ms": since_ms,
        "until_ms": until_ms,
        "tenant": tenant,
        "partitions": n_partitions,
        "records": n_records,
        "requests": len(requests),
        "public_key": signer_public_key.hex(),
        "key_id": lm.key_id(signer_public_key),
        "verify": "python verify.py <this folder> (Python 3.11+ and the cryptography package)",
    }
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()
