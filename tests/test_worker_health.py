"""A real worker (`tokenstream worker`, the tiny random Llama) reports what it can do on /health/ready:
ready once it holds its partitions, not ready within seconds of the session's broker stopping (and
`tokenstream ops probe --url` says why, as `ops probe --group` does for any group), ready again
after the broker is back. The rules themselves are unit-tested in test_health_units.py."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid

import httpx
import pytest

from gpu_workers.startup import needed_topics
from tests.gateway_support import free_port
from topics.admin import apply

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from gpu_workers.random_model import build

    return build(tmp_path_factory.mktemp("health-tiny-model"))


async def ready(url: str) -> tuple[int, dict]:
    try:
        answer = await asyncio.to_thread(httpx.get, url, timeout=5)
    except httpx.HTTPError as exc:
        return 0, {"error": str(exc)}
    return answer.status_code, answer.json()


def holds_partitions(body: dict) -> bool:
    return body.get("checks", {}).get("partitions", 0) > 0


async def until(url: str, want: bool, timeout: float, also=lambda body: True) -> tuple[dict, float]:
    """The body once readiness is `want` (and `also` holds for it), and how long that took."""
    started = time.monotonic()
    while True:
        status, body = await ready(url)
        if (status == 200) == want and also(body):
            return body, time.monotonic() - started
        assert time.monotonic() - started < timeout, (
            f"ready stayed {not want} for {timeout} s: {status} {body}"
        )
        await asyncio.sleep(0.2)


def probe(*args: str) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-m", "tokenstream.cli", "ops", "probe", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ),
        check=False,
    )
    return done.returncode, done.stdout + done.stderr


@pytest.mark.heavy  # a broker stopped and started (25 s): `make test-all`
async def test_a_worker_is_not_ready_while_its_broker_is_away_and_ready_again_after(
    stack, bootstrap, roles, tiny_model
):
    model = f"tiny-health-{uuid.uuid4().hex[:6]}"
    await apply(needed_topics(model), bootstrap)
    port = free_port()
    url = f"http://127.0.0.1:{port}/health/ready"
    worker = roles.start(
        "worker",
        "--model",
        model,
        "--model-path",
        str(tiny_model),
        "--metrics-port",
        str(port),
        name="worker",
    )
    # the group check runs every second, so the first ready body may show the group as it was just
    # before the assignment (a rebalance under way: ready, no partitions yet)
    body, _ = await until(url, True, timeout=180, also=holds_partitions)
    assert worker.poll() is None
    assert body["checks"]["member"] is True and body["checks"]["partitions"] > 0 and body["detail"] == []
    code, said = await asyncio.to_thread(probe, "--url", url)
    assert code == 0 and said.startswith("ready"), said

    await asyncio.to_thread(stack.kafka.stop, lambda _m: None)
    try:
        body, took = await until(url, False, timeout=15)  # broker_stale_s (5 s) + a check or two
        print(f"not ready {took:.1f} s after the broker stopped: {body['detail']}")
        assert body["checks"]["broker"] is False and body["detail"][0].startswith("broker: no answer"), body
        code, said = await asyncio.to_thread(probe, "--url", url)
        assert code == 1 and "broker: no answer" in said, said
        code, said = await asyncio.to_thread(probe, "--group", f"worker.{model}", "--no-redis")
        assert code == 1 and "the broker could not say" in said, said  # a processor's probe, the same truth
        live = await asyncio.to_thread(httpx.get, url.replace("ready", "live"), timeout=5)
        assert live.status_code == 200  # a restart would not bring the broker back
    finally:
        await asyncio.to_thread(stack.kafka.start, lambda _m: None)
    body, took = await until(url, True, timeout=60, also=holds_partitions)
    print(f"ready again {took:.1f} s after the broker was back")
    assert body["checks"]["member"] is True and body["checks"]["partitions"] > 0, body
    assert worker.poll() is None, roles.log(worker)[-3000:]
