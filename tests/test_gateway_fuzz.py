"""Fuzzing the gateway from its own OpenAPI document with schemathesis: every operation, valid and
invalid inputs, bounded by TOKENSTREAM_FUZZ_EXAMPLES per operation (default 60). Nothing may answer
a server error; every refusal is in OpenAI's error shape; the gateway serves normally afterwards.

A real gateway process and a real broker; the pipeline behind the fake model is
tests.gateway_support.FakePipeline, so generated requests that are valid get real answers.
"""

from __future__ import annotations

import asyncio
import os
import uuid

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.generation.modes import GenerationMode

from tests.conftest import Roles
from tests.gateway_support import FakePipeline, client, headers, start_gateway

# raised by schemathesis's own strategies, not by this test
# heavy (make test-all, about a minute); make test keeps tests/test_gateway_hostile.py and every route's
# own tests
pytestmark = [
    pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisDeprecationWarning"),
    pytest.mark.heavy,
]
EXAMPLES = int(os.environ.get("TOKENSTREAM_FUZZ_EXAMPLES", "60"))


@pytest.fixture(scope="module")
async def pipeline(stack, bootstrap):
    p = await FakePipeline(bootstrap, f"fuzz-{uuid.uuid4().hex[:6]}", token_delay=0.0).start()
    yield p
    await p.stop()


@pytest.fixture(scope="module")
def gateway(stack, pipeline, tmp_path_factory):
    roles = Roles(stack, tmp_path_factory.mktemp("gateway-fuzz"))
    # a short deadline: a generated request for the model must never hang the run
    url, _ = start_gateway(roles, [pipeline.model], env={"TOKENSTREAM_GATEWAY_PROGRESS_TIMEOUT_S": "10"})
    yield url
    roles.stop_all()


def operations(gateway: str) -> list:
    return [
        result.ok()
        for result in schemathesis.openapi.from_url(gateway + "/openapi.json").get_all_operations()
    ]


def check(case, gateway: str, model: str) -> None:
    if isinstance(case.body, dict) and "model" in case.body and len(repr(case.body)) % 2:
        case.body["model"] = model  # half of the bodies name the served model: they go deeper
    response = case.call(base_url=gateway, headers=headers(), timeout=30)
    assert response.status_code < 500, (
        case.method,
        case.path,
        case.body,
        response.status_code,
        response.text[:500],
    )
    if response.status_code >= 400:
        err = response.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], response.text[:500]


def fuzz(gateway: str, model: str, mode: GenerationMode) -> list[str]:
    ops = operations(gateway)
    for op in ops:
        # the file and vector store routes are many (15) and their bodies small: a sixth of the examples
        # each keeps the run's length near what it was before them
        examples = EXAMPLES // 6 if op.path.startswith(("/v1/files", "/v1/vector_stores")) else EXAMPLES

        @given(case=op.as_strategy(generation_mode=mode))
        @settings(
            max_examples=examples,
            deadline=None,
            derandomize=True,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        def each(case):
            check(case, gateway, model)

        try:
            each()
        except Unsatisfiable:  # negative mode: an operation without parameters has nothing to break
            assert mode == GenerationMode.NEGATIVE
    return [f"{op.method.upper()} {op.path}" for op in ops]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
async def test_no_operation_answers_a_server_error(gateway, pipeline, mode):
    # in a thread: the pipeline double runs on this event loop meanwhile
    fuzzed = await asyncio.to_thread(fuzz, gateway, pipeline.model, mode)
    assert set(fuzzed) >= {
        "POST /v1/chat/completions",
        "GET /v1/models",
        "GET /v1/chat/completions/{completion}/stream",
        "POST /v1/chat/completions/{completion}/cancel",
        "POST /v1/vector_stores",
        "POST /v1/vector_stores/{vs_id}/search",
        "GET /v1/files",
    }


async def test_the_gateway_still_serves_after_the_fuzzing(gateway, pipeline):
    async with client(gateway) as http:
        r = await http.post(
            "/v1/chat/completions",
            json={"model": pipeline.model, "messages": [{"role": "user", "content": "after fuzzing"}]},
        )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "after fuzzing"
