"""A model sharded over processes: the vLLM backend with `--tensor-parallel-size 3`, through the whole chain

    SDK -> gateway -> conversation -> safety -> router -> ts.inference.<model>
        -> worker (3 vLLM ranks) -> ts.tokens

SmolLM2-135M has 9 attention heads and 3 key/value heads, so it shards over 3 ranks (not 2); each rank
holds a third of every layer's heads and MLP columns and the ranks sum their parts after each layer.
This VM has 2 cores: every rank runs one unbound thread (`gpu_workers/vllm_env.py`). Shown: the worker
runs three ranks, and its greedy answers (fp32) are those of HF `generate()`, the one-process reference.

In `make test-all` (heavy): vLLM's virtualenv, and about two minutes to start three ranks on two cores.
"""

from __future__ import annotations

import asyncio
import re
import uuid

import pytest

from tests.conftest import Roles
from tests.gateway_support import api_client, start_gateway
from tests.test_backends import hf_greedy
from tests.test_worker_kafka import wait_for_log

pytestmark = [pytest.mark.slow, pytest.mark.heavy, pytest.mark.timeout(900)]
QUESTIONS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Write one sentence about the sea.",
]


@pytest.fixture(scope="module")
def sharded(stack, tmp_path_factory):
    from gpu_workers.model_loader import smollm2_dir
    from gpu_workers.vllm_env import ensure_worker_deps
    from topics.admin import apply
    from topics.registry import all_topics

    ok, why = ensure_worker_deps(print)
    assert ok, f"vLLM's virtualenv: {why}"
    model = f"smollm2-tp-{uuid.uuid4().hex[:6]}"
    asyncio.run(apply(all_topics([model]), stack.kafka.address))
    roles = Roles(stack, tmp_path_factory.mktemp("tensor-parallel"))
    try:
        roles.start_processors()
        worker = roles.start(
            "worker",
            "--model",
            model,
            "--model-path",
            str(smollm2_dir()),
            "--backend",
            "vllm",
            "--enforce-eager",
            "--dtype",
            "float32",
            "--tensor-parallel-size",
            "3",
            "--max-running",
            "4",
            name="worker-tp3",
        )
        wait_for_log(roles, worker, "worker ready", 600)
        url, _ = start_gateway(roles, [model], timeout=120)
        yield roles, worker, url, model
    finally:
        roles.stop_all()


def test_the_worker_runs_three_tensor_parallel_ranks(sharded):
    roles, worker, _, _ = sharded
    text = roles.log(worker)
    ranks = dict(re.findall(r"\(Worker_TP(\d) pid=(\d+)\)", text))  # vLLM's log prefix of each rank's process
    assert set(ranks) == {"0", "1", "2"} and len(set(ranks.values())) == 3, text[-3000:]
    assert "world_size=3" in text


async def test_sharded_greedy_answers_equal_one_process_generate(sharded):
    _, _, url, model = sharded
    client = api_client(url, timeout=300)

    async def ask(question: str) -> str:
        out = await client.chat.completions.create(
            model=model, temperature=0, max_tokens=40, messages=[{"role": "user", "content": question}]
        )
        return out.choices[0].message.content

    answers = await asyncio.gather(*(ask(q) for q in QUESTIONS))
    for question, answer in zip(QUESTIONS, answers):
        assert answer == hf_greedy([{"role": "user", "content": question}], 40), question
