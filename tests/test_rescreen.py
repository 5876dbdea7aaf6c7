"""`tokenstream audit rescreen` against the real broker with the real safety classifier.

The stored run is written as the roles write it, its live input verdicts judged by the classifier
under the live policy; re-screening under a stricter test policy must report exactly the
differences the classifier's scores imply, write its verdicts to their own topic and leave the
live verdict topic untouched.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.structs import TopicPartition

from audit.rescreen import Rescreener, commit_progress, group_of
from audit.run import Auditor, Options
from common import kafka_auth
from producers import publish, start_consumer, start_producer
from safety_model.classifier import SafetyClassifier
from safety_model.config import Policy
from schemas import ChatMessage, Completion, InferenceRequest, SafetyVerdict, TokenChunk
from schemas.ids import new_request_id
from tests.kafka_support import Tap
from topics import PREPARED, RESCREENED, TOKENS, VERDICTS
from topics.admin import apply
from topics.registry import all_topics

pytestmark = pytest.mark.slow  # loads the classifier (MiniLM) twice

TEXTS = [
    "What is the capital of Norway?",
    "Explain how photosynthesis works.",
    "The boxer knocked out his opponent in the third round with a brutal punch.",
    "I am so angry at my neighbour I could scream.",
    "The war film showed soldiers being shot on the beach.",
    "I am going to find him tonight and stab him until he stops breathing.",
]
ANSWER = "Here is a short, friendly answer."


@pytest.fixture(scope="module")
def classifier():
    return SafetyClassifier.load()


async def write_run(bootstrap: str, classifier: SafetyClassifier, tenant: str) -> list[str]:
    live = classifier.judge(TEXTS)
    producer = await start_producer(bootstrap)
    rids = []
    try:
        for text, verdict in zip(TEXTS, live, strict=True):
            rid = new_request_id(2, time.time())
            ids = dict(request_id=rid, conversation_id=rid, tenant=tenant)
            await publish(
                producer,
                PREPARED,
                InferenceRequest(
                    **ids, model="m", reply_partition=2, messages=[ChatMessage(role="user", content=text)]
                ),
            )
            await publish(
                producer,
                VERDICTS,
                SafetyVerdict(
                    **ids,
                    stage="input",
                    blocked=verdict.blocked,
                    categories=verdict.categories,
                    scores=verdict.scores,
                    policy_version=verdict.policy_version,
                ),
            )
            if not verdict.blocked:
                await publish(producer, TOKENS, TokenChunk(**ids, seq=0, text=ANSWER), partition=2)
                await publish(
                    producer, TOKENS, Completion(**ids, seq=1, finish_reason="stop", text=ANSWER), partition=2
                )
            rids.append(rid)
    finally:
        await producer.stop()
    return rids


async def test_rescreen_reports_the_differences_and_leaves_live_verdicts_alone(
    stack, bootstrap, classifier, tmp_path
):
    await apply(all_topics(["m"]), bootstrap)
    tenant = "t-" + uuid.uuid4().hex[:6]
    since = int(time.time() * 1000) - 1
    rids = await write_run(bootstrap, classifier, tenant)
    until = int(time.time() * 1000) + 1
    strict = Policy(
        version="test-strict-1",
        thresholds={},
        default_threshold=0.05,
        categories=classifier.policy.categories,
    )
    strict_clf = classifier.with_policy(strict)
    live, new = classifier.judge(TEXTS), strict_clf.judge(TEXTS)
    expected_inputs = {
        rid: set(n.categories)
        for rid, lv, n in zip(rids, live, new, strict=True)
        if n.blocked and not lv.blocked
    }
    assert expected_inputs, "the test policy must block something the live one allowed"
    answered = [rid for rid, lv in zip(rids, live, strict=True) if not lv.blocked]
    answer_blocked = strict_clf.judge([ANSWER])[0].blocked

    consumer = await start_consumer(group=None, bootstrap=bootstrap)
    tps = [TopicPartition(VERDICTS.name, p) for p in range(VERDICTS.partitions)]
    live_before = await consumer.end_offsets(tps)
    producer = await start_producer(bootstrap)
    try:
        async with Tap(RESCREENED) as written:
            async with Auditor(Options(bootstrap, tenant=tenant, horizon_s=20)) as auditor:
                screener = Rescreener(strict_clf, producer)
                await auditor.range(since, until, screener.add)
                await screener.flush()
                await commit_progress(auditor, bootstrap, "test-strict")
            mine = await written.wait_for(lambda e: e.tenant == tenant, count=len(rids) + len(answered))
        assert (await consumer.end_offsets(tps)) == live_before  # the live verdicts are untouched
    finally:
        await producer.stop()
        await consumer.stop()
    report = screener.report
    inputs = report.stages["input"]
    assert inputs.judged == len(TEXTS)
    newly = {c for c in inputs.newly_blocked}
    assert newly == set().union(*expected_inputs.values())
    assert sum(inputs.newly_blocked.values()) == sum(len(c) for c in expected_inputs.values())
    assert not inputs.newly_allowed  # stricter: nothing the live policy blocked is allowed now
    outputs = report.stages["output"]
    assert outputs.judged == len(answered) and outputs.blocked_now == (len(answered) if answer_blocked else 0)
    assert {e.policy_version for e in mine} == {"test-strict-1"}
    assert {(e.request_id, e.stage) for e in mine} == {(r, "input") for r in rids} | {
        (r, "output") for r in answered
    }
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **kafka_auth.client_options())
    await admin.start()
    try:
        committed = await admin.list_consumer_group_offsets(group_of("test-strict"))
    finally:
        await admin.close()
    assert committed and any(tp.topic == VERDICTS.name for tp in committed)


@pytest.mark.heavy  # the CLI's table over the logic tested above, as its own process: make test-all
async def test_the_rescreen_command_prints_what_would_change(stack, bootstrap, classifier, tmp_path):
    await apply(all_topics(["m"]), bootstrap)
    tenant = "t-" + uuid.uuid4().hex[:6]
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(time.time() - 1))
    await write_run(bootstrap, classifier, tenant)
    policies = tmp_path / "policies.json"
    policies.write_text(json.dumps({"test-strict": {"version": "test-strict-2", "threshold": 0.05}}))
    out = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable,
            "-m",
            "tokenstream.cli",
            "audit",
            "rescreen",
            "--policy",
            "test-strict",
            "--policies",
            str(policies),
            "--since",
            since,
            "--tenant",
            tenant,
            "--horizon",
            "20",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"rescreen of {len(TEXTS)} request(s) under test-strict (test-strict-2)" in out.stdout
    assert "newly blocked" in out.stdout and "ts-audit-rescreen.test-strict" in out.stdout
    unknown = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable,
            "-m",
            "tokenstream.cli",
            "audit",
            "rescreen",
            "--policy",
            "nope",
            "--policies",
            str(policies),
            "--since",
            since,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert unknown.returncode == 2 and "no safety policy 'nope'" in unknown.stdout + unknown.stderr
