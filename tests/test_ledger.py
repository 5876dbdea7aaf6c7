"""The tamper-evident ledger on a real broker: records notarized, copies of a partition edited,
with a record deleted, reordered, inserted or truncated away, each named by `audit verify`; the
exported bundle checked by its own verify.py, which imports nothing of tokenstream."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from aiokafka.structs import TopicPartition

from audit import ledger_math as lm
from audit.notary import notarize, read_ledger
from audit.proof import _records, export, prove
from audit.signer import Signer
from producers import publish, start_producer
from schemas import ChatMessage, ChatRequest, TokenChunk, encode
from schemas.steps import STEP_HEADERS, StepEntry, entry, is_step, step_value
from topics import CHAT_REQUESTS, TOKENS, TopicSpec
from topics.admin import apply
from topics.registry import all_topics

MODEL = "ledger-model"


def _seq(*digests: str) -> list[tuple[int, str]]:
    return list(enumerate(digests))


@pytest.mark.parametrize(
    ("actual", "kind"),
    [
        ("abcde", None),
        ("abcdef", None),
        ("abXde", "changed"),
        ("abde", "removed"),
        ("acbde", "reordered"),
        ("abXcde", "inserted"),
        ("cde", "removed"),
        ("abc", "removed"),
    ],
)
def test_the_first_difference_is_named_by_its_kind(actual, kind):
    found = lm.first_difference(_seq(*"abcde"), _seq(*actual))
    assert (found.split(":")[0] if found else None) == kind, found


def test_a_checkpoint_edited_or_left_out_breaks_the_chain():
    signer = Signer(bytes(32))
    from audit.signer import as_dict
    from schemas import Checkpoint

    def cp(first: int, digests: list[str], prev: str) -> dict:
        c = Checkpoint(
            request_id="t/0",
            topic="t",
            partition=0,
            first_offset=first,
            last_offset=first + len(digests) - 1,
            offsets=list(range(first, first + len(digests))),
            record_digests=digests,
            prev_head=prev,
            head=lm.fold(prev, digests),
            key_id=signer.key_id,
        )
        return as_dict(signer.sign(c))

    d = [lm.record_digest(i, b"k", str(i).encode()) for i in range(4)]
    one = cp(0, d[:2], lm.ZERO_HEAD)
    two = cp(2, d[2:], one["head"])
    assert lm.check_checkpoints([one, two], signer.public_key) is None
    assert "does not continue" in lm.check_checkpoints([one, cp(2, d[2:], lm.ZERO_HEAD)], signer.public_key)
    edited = {**two, "record_digests": [d[3], d[2]]}
    assert "signature" in lm.check_checkpoints([one, edited], signer.public_key)
    assert "signature" in lm.check_checkpoints([one, two], Signer(bytes([1]) * 32).public_key)


async def _write_requests(bootstrap: str, n: int) -> None:
    producer = await start_producer(bootstrap)
    try:
        for i in range(n):
            tenant = "acme" if i % 2 else "globex"
            await publish(
                producer,
                CHAT_REQUESTS,
                ChatRequest(
                    request_id=f"ledger-{i}",
                    tenant=tenant,
                    conversation_id="ledger-conv",
                    model=MODEL,
                    messages=[ChatMessage(role="user", content=f"question {i} of {tenant}")],
                ),
                key="ledger",
            )  # one partition
    finally:
        await producer.stop()


async def _write_steps(bootstrap: str) -> tuple[int, int, int]:
    """Two step records on a tokens partition (schemas/steps.py): one holding chunks of acme and globex,
    one of acme alone; the partition and their offsets."""
    partition = 7
    producer = await start_producer(bootstrap)

    def chunk(i: int, tenant: str) -> StepEntry:
        rid = f"ledger-{i}"
        answer = TokenChunk(request_id=rid, tenant=tenant, seq=0, text=f"answer of {tenant}")
        return entry(rid, encode(answer))

    try:
        offsets = []
        for entries in ([chunk(1, "acme"), chunk(0, "globex")], [chunk(3, "acme")]):
            sent = await producer.send_and_wait(
                TOKENS.name, step_value(entries), partition=partition, headers=STEP_HEADERS
            )
            offsets.append(sent.offset)
        return partition, offsets[0], offsets[1]
    finally:
        await producer.stop()


async def _copy(bootstrap: str, partition: int, records: list, name: str, change) -> None:
    """Re-produce `records` (one partition) into partition `partition` of a new topic, after `change`."""
    await apply(
        [TopicSpec(name, CHAT_REQUESTS.partitions, "copy", CHAT_REQUESTS.events, "a forged copy")], bootstrap
    )
    producer = await start_producer(bootstrap)
    try:
        for r in change(list(records)):
            await producer.send_and_wait(
                name,
                r.value,
                key=r.key,
                partition=partition,
                timestamp_ms=r.timestamp,
                headers=list(r.headers),
            )
    finally:
        await producer.stop()


@pytest.mark.asyncio
async def test_verify_names_each_forgery_of_a_copy_and_the_bundle_verifies_alone(
    stack, bootstrap, tmp_path, unique
):
    await apply(all_topics([MODEL]), bootstrap)
    await _write_requests(bootstrap, 12)
    step_partition, mixed, own = await _write_steps(bootstrap)
    signer = Signer.load()
    assert await notarize(bootstrap, signer, interval_s=60) >= 14
    # The live log is whole and in order (the requests topic, and the tokens topic's step records
    # attested as the records they are: the session's other topics hold more).
    proofs = await prove(bootstrap, signer.public_key, topics={CHAT_REQUESTS.name, TOKENS.name})
    assert any(p.topic == TOKENS.name and p.partition == step_partition for p in proofs)
    assert proofs and all(p.problem is None for p in proofs), [p for p in proofs if p.problem]
    # One partition holding our records, as attested.
    ledger = await read_ledger(bootstrap)
    partition = next(p for (t, p), _ in ledger.items() if t == CHAT_REQUESTS.name)
    cps = ledger[(CHAT_REQUESTS.name, partition)]
    records = await _records(
        bootstrap, CHAT_REQUESTS.name, partition, cps[0].first_offset, cps[-1].last_offset
    )
    assert len(records) >= 2

    def edited(rs):
        rs[1] = dataclasses.replace(rs[1], value=rs[1].value + b" ")
        return rs

    forgeries = {
        "changed": edited,
        "removed": lambda rs: rs[:1] + rs[2:],
        "reordered": lambda rs: [rs[1], rs[0], *rs[2:]],
        "inserted": lambda rs: [rs[0], edited(list(rs))[1], *rs[1:]],
    }
    for kind, change in forgeries.items():
        copy = f"forged.{kind}.{unique}"
        await _copy(bootstrap, partition, records, copy, change)
        [proof] = [
            p
            for p in await prove(bootstrap, signer.public_key, copies={CHAT_REQUESTS.name: copy})
            if p.partition == partition
        ]
        assert proof.problem and proof.problem.startswith(kind), (kind, proof.problem)
    # Truncating a copy's head (DeleteRecords, as someone with broker access could): named as removed.
    copy = f"forged.truncated.{unique}"
    await _copy(bootstrap, partition, records, copy, lambda rs: rs)
    from aiokafka.admin import AIOKafkaAdminClient, RecordsToDelete

    from common import kafka_auth

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **kafka_auth.client_options())
    await admin.start()
    try:
        await admin.delete_records({TopicPartition(copy, partition): RecordsToDelete(before_offset=1)})
    finally:
        await admin.close()
    [proof] = [
        p
        for p in await prove(bootstrap, signer.public_key, copies={CHAT_REQUESTS.name: copy})
        if p.partition == partition
    ]
    assert proof.problem and proof.problem.startswith("removed"), proof.problem

    # The bundle: acme's records in full, globex's as digests, checked by its verify.py alone.
    bundle = tmp_path / "bundle"
    manifest = await export(bootstrap, signer.public_key, bundle, tenant="acme")
    assert manifest["records"] >= 12 and manifest["key_id"] == signer.key_id
    rows = [json.loads(line) for line in (bundle / "records.jsonl").read_text().splitlines()]
    assert not any(b"globex" in (r.get("value") or "").encode() for r in rows)
    assert any("digest" in r for r in rows)  # globex's records: their place, not their content
    steps = {r["offset"]: r for r in rows if r["topic"] == TOKENS.name and r["partition"] == step_partition}
    assert "digest" in steps[mixed] and "value" not in steps[mixed]  # a step holding globex's chunk too
    assert is_step([(k, base64.b64decode(v)) for k, v in steps[own]["headers"]]) and "value" in steps[own]
    requests = [json.loads(line) for line in (bundle / "requests.jsonl").read_text().splitlines()]
    assert {r["tenant"] for r in requests if r["request_id"].startswith("ledger-")} == {"acme"}
    ok = await asyncio.to_thread(_standalone, bundle)
    assert ok.returncode == 0 and "verified" in ok.stdout, ok.stdout + ok.stderr
    # Change one attested record's bytes in the bundle: its verifier names it.
    i = next(i for i, r in enumerate(rows) if "value" in r and b"ledger-" in base64.b64decode(r["value"]))
    edited = base64.b64decode(rows[i]["value"]).replace(
        MODEL.encode(), MODEL.upper().encode()
    )  # a clear field
    assert edited != base64.b64decode(rows[i]["value"])
    rows[i]["value"] = base64.b64encode(edited).decode()
    (bundle / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    bad = await asyncio.to_thread(_standalone, bundle)
    assert bad.returncode == 1 and f"changed: the record at offset {rows[i]['offset']}" in bad.stdout, (
        bad.stdout
    )


PROJECT = (
    "tokenstream",
    "common",
    "schemas",
    "topics",
    "producers",
    "audit",
    "gateway",
    "processors",
    "gpu_workers",
    "tools",
    "bench",
    "safety_model",
)


def _standalone(bundle: Path) -> subprocess.CompletedProcess:
    """Run the bundle's verify.py from the bundle's folder, and fail it if it imported any project module."""
    harness = (
        "import runpy, sys\n"
        "code = 0\n"
        "try:\n"
        "    runpy.run_path('verify.py', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    code = e.code\n"
        f"leaked = [m for m in sys.modules if m.split('.')[0] in {PROJECT!r}]\n"
        "print('project modules imported:', leaked) if leaked else None\n"
        "sys.exit(3 if leaked else code)\n"
    )
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-I", "-c", harness, str(bundle)],
        cwd=bundle,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert time.monotonic() - started < 60
    return out
