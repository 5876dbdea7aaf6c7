"""The whole system for a test module: the three real processors, a real SmolLM2 worker and two
gateway instances (the first screens input in parallel with generation, the second in series),
as `tokenstream ...` processes against the session's Kafka, Redis and Weaviate.

    SDK -> gateway -> ts.chat.requests -> conversation -> ts.requests.prepared -> safety
        -> ts.requests.screened -> router -> ts.inference.smollm2 -> worker -> ts.tokens -> gateway

No role is stood in for: what these tests see is what a client of `make run` sees.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from dataclasses import dataclass, field

import httpx
import openai

from tests.conftest import Roles
from tests.gateway_support import free_port, headers, openai_client, start_gateway
from topics.admin import apply
from topics.registry import all_topics

MODEL = "smollm2"
SCREENING = ("parallel", "serial")  # of gateway 0 and gateway 1


@dataclass
class System:
    roles: Roles
    gateways: list[str] = field(default_factory=list)
    worker_metrics: str = ""
    tools_health: str = ""  # the tool processor's health URL, when started (tools=True)
    procs: dict[str, object] = field(default_factory=dict)

    @classmethod
    def start(
        cls,
        stack,
        log_dir,
        *,
        processor_env: dict[str, str] | None = None,
        gateway_env: dict[str, str] | None = None,
        worker_args: tuple[str, ...] = (),
        tools: bool = False,
    ) -> System:
        asyncio.run(apply(all_topics([MODEL]), stack.kafka.address))
        system = cls(Roles(stack, log_dir))
        system.procs.update(system.roles.start_processors(processor_env))
        if tools:  # (started now: it loads its embedder while the worker loads its model)
            from tests.tool_support import sandbox_root, tools_env

            port = free_port()
            system.tools_health = f"http://127.0.0.1:{port}"
            system.procs["tools"] = system.roles.start(
                "tools", "--health-port", str(port), env=tools_env(sandbox_root()), name="tools"
            )
        port = free_port()
        system.worker_metrics = f"http://127.0.0.1:{port}/metrics"
        system.procs["worker"] = system.roles.start(
            "worker", "--model", MODEL, "--metrics-port", str(port), *worker_args, name="worker"
        )
        for index in range(2):
            env = {"TOKENSTREAM_GATEWAY_SCREENING": SCREENING[index], **(gateway_env or {})}
            url, proc = start_gateway(system.roles, [MODEL], index=index, count=2, env=env, timeout=120)
            system.gateways.append(url)
            system.procs[f"gateway-{index}"] = proc
        system.wait_worker()
        return system

    def wait_worker(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while True:
            worker = self.procs["worker"]
            assert worker.poll() is None, self.roles.log(worker)[-3000:]
            try:
                with urllib.request.urlopen(self.worker_metrics, timeout=2):
                    return
            except OSError:
                assert time.monotonic() < deadline, "worker not ready:\n" + self.roles.log(worker)[-3000:]
                time.sleep(0.5)

    def worker_gauge(self, name: str) -> float:
        for line in httpx.get(self.worker_metrics, timeout=5).text.splitlines():
            if line.startswith((name + " ", name + "{")):
                return float(line.rsplit(" ", 1)[1])
        return -1.0

    def client(self, gateway: int = 0, **kw) -> openai.AsyncOpenAI:
        """The official SDK, unchanged, pointed at one gateway instance (with the tests' API key)."""
        return openai_client(self.gateways[gateway], timeout=kw.pop("timeout", 180), **kw)

    def http(self, **kw) -> httpx.AsyncClient:
        return httpx.AsyncClient(timeout=kw.pop("timeout", 180), headers=headers(), **kw)

    def stop(self) -> None:
        self.roles.stop_all()


def greedy(**kw) -> dict:
    """Deterministic sampling: the same answer on every run and every worker."""
    return {"model": MODEL, "temperature": 0, **kw}


def jsonl(data: str) -> dict:
    return json.loads(data)
