"""`tokenstream shadow` and the gate `tokenstream route set` asks for, against the real broker and real
workers.

A worker of tiny random model weights serves four requests, one after another (as the router would hand
them on); two candidates are tried on that recorded traffic: the same weights under another name, and
another model (SmolLM2-135M-Instruct, which answers in words where the tiny one repeats a token). The
candidates' answers go to ts.shadow.answers only; the evaluation of the other weights fails
`agreement>=0.9` and `route set` refuses it; the same weights pass and `route set` sends the canary its
share.
"""

from __future__ import annotations

import asyncio
import datetime as dt

import pytest

from gpu_workers.model_loader import smollm2_dir
from producers import publish, start_producer
from schemas import Completion, InferenceRequest
from tests import test_worker_kafka
from tests.kafka_support import Tap
from tests.test_worker_kafka import TokenReader, request, wait_for_log
from topics import ROUTES, SHADOW_ANSWERS, SHADOW_GATES, TOKENS, inference_topic
from topics.admin import apply
from topics.registry import all_topics

pytestmark = pytest.mark.slow
tiny_dir = test_worker_kafka.tiny_dir  # its fixture, used here too


def cli(roles, *args: str, timeout: float = 180) -> tuple[int, str]:
    """Run `tokenstream ARGS` as the operator would; (exit code, its output)."""
    proc = roles.start(*args, name="-".join(args[:2]))
    proc.wait(timeout)
    return proc.returncode, roles.log(proc)


@pytest.mark.heavy  # about 36 s: make test-all (tests/test_shadow_units.py in make test)
async def test_a_candidate_is_tried_on_recorded_traffic_and_route_set_asks_for_its_passed_gate(
    bootstrap, unique, roles, tiny_dir
):
    served, same, other = f"tiny-{unique}", f"tiny-same-{unique}", f"tiny-other-{unique}"
    await apply(all_topics([served, same, other]), bootstrap)
    other_dir = await asyncio.to_thread(smollm2_dir)
    workers = {
        m: roles.start("worker", "--model", m, "--model-path", str(path), name=f"worker-{m}")
        for m, path in ((served, tiny_dir), (same, tiny_dir), (other, other_dir))
    }
    for proc in workers.values():
        await asyncio.to_thread(wait_for_log, roles, proc, "worker ready")

    # the recorded traffic: four requests the served model answers, one after another
    since = dt.datetime.now(dt.UTC).isoformat()
    producer = await start_producer(bootstrap)
    try:
        async with TokenReader(bootstrap) as reader:
            sent = [request(served, f"question {i}: name a colour", 12) for i in range(4)]
            for r in sent:
                await publish(producer, inference_topic(served), r)
                await reader.until(lambda rd, rid=r.request_id: rd.completion(rid) is not None, timeout=60)
    finally:
        await producer.stop()

    async with Tap(TOKENS) as tokens, Tap(SHADOW_ANSWERS) as answers, Tap(inference_topic(other)) as copies:
        code, out = cli(
            roles,
            "shadow",
            "--model",
            other,
            "--served",
            served,
            "--since",
            since,
            "--rate",
            "20",
            "--in-flight",
            "1",
            "--require",
            "agreement>=0.9",
        )
        assert code == 1 and "4 requests" in out and "gate: FAIL (agreement>=0.9)" in out, out
        # the candidate answered each copy on ts.shadow.answers, and nothing of it reached ts.tokens
        await answers.caught_up()
        theirs = [e for e, _ in answers.events if isinstance(e, Completion) and e.model == other]
        assert len({e.request_id for e in theirs}) == 4
        await copies.caught_up()
        replayed = [e for e, _ in copies.events if isinstance(e, InferenceRequest)]
        assert sorted(e.shadow_of for e in replayed) == sorted(r.request_id for r in sent)
        assert {e.priority for e in replayed} == {-2} and {e.model for e in replayed} == {other}
        await tokens.caught_up()
        copied = {e.request_id for e in replayed}
        assert not [e for e, _ in tokens.events if e.request_id in copied or getattr(e, "model", "") == other]

    code, out = cli(roles, "route", "set", served, "-w", f"{served}=0.9", "-w", f"{other}=0.1")
    assert code == 1 and "refused" in out and "failed its gate" in out, out

    async with Tap(SHADOW_GATES) as gates, Tap(ROUTES) as routes:
        code, out = cli(
            roles,
            "shadow",
            "--model",
            same,
            "--served",
            served,
            "--since",
            since,
            "--rate",
            "20",
            "--in-flight",
            "1",
            "--require",
            "agreement>=0.5",
        )
        assert code == 0 and "gate: PASS (agreement>=0.5)" in out, out
        gate = (await gates.wait_for(lambda e: e.candidate == same))[0]
        assert gate.passed and gate.requests == 4 and gate.served == served
        assert set(gate.figures) >= {
            "agreement",
            "similarity",
            "tool_agreement",
            "safety_changes",
            "ttft_ratio",
        }
        code, out = cli(roles, "route", "set", served, "-w", f"{served}=0.9", "-w", f"{same}=0.1")
        assert code == 0, out
        route = (await routes.wait_for(lambda e: e.model == served))[0]
        assert route.weights == {served: 0.9, same: 0.1}
    for proc in workers.values():
        assert proc.poll() is None, roles.log(proc)[-2000:]
