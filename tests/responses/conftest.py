"""One chain for both Responses modules: started before the first test of this package and stopped
after its last (package scope), so the rest of the suite never shares a consumer group with it."""

from __future__ import annotations

import asyncio

import pytest

from tests.conftest import Roles
from tests.gateway_support import api_client, start_gateway
from tests.responses.chain import MODEL, worker_args
from tests.test_worker_kafka import wait_for_log
from tests.tool_support import sandbox_root, tools_env, wait_ready


@pytest.fixture(scope="package")
def system(stack, tmp_path_factory):
    """The three processors, a SmolLM2 worker under its own model name, a tool processor, a gateway."""
    from topics.admin import apply
    from topics.registry import all_topics

    asyncio.run(apply(all_topics([MODEL]), stack.kafka.address))
    roles = Roles(stack, tmp_path_factory.mktemp("responses"))
    env = tools_env(sandbox_root())
    try:
        procs = {
            name: roles.start("processor", name, "--loglevel", "info", name=f"processor-{name}")
            for name in ("conversation", "safety", "router")
        }
        tools = roles.start("tools", env=env, name="tools")
        worker = procs["worker"] = roles.start(*worker_args(), name="worker")
        url, _ = start_gateway(
            roles,
            [MODEL],
            timeout=120,
            env={
                "TOKENSTREAM_GATEWAY_RESPONSES_MAX_STEPS": "3",
                "TOKENSTREAM_GATEWAY_PROGRESS_TIMEOUT_S": "240",
            },
        )
        wait_for_log(roles, worker, "worker ready", 300)
        asyncio.run(wait_ready(tools, roles.log))
        yield {"url": url, "roles": roles, "tools": tools, "env": env, "procs": procs}
    finally:
        roles.stop_all()


@pytest.fixture
def client(system):
    return api_client(system["url"], timeout=300)
