"""The whole system on a throwaway stack, for benchmarks: every role a real `tokenstream` process.

`LocalSystem` starts Kafka and Redis on free ports, applies the topics, then the three
processors, one worker and one gateway instance per entry of `gateways` (each with its own
environment and its own share of the tokens partitions). Logs stay in the given folder.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ID_RE = re.compile(rb"id: ([0-9a-f]{16}p\d+t\d+):(-?\d+)\r?\n")


class LocalSystem:
    def __init__(self, root: Path, model: str, gateways: dict[str, dict[str, str]],
                 processor_env: dict[str, str] | None = None) -> None:
        from tokenstream.stack import Stack

        self.root, self.model, self.gateway_envs = root, model, gateways
        self.processor_env = processor_env or {}
        self.stack = Stack.ephemeral(root)
        self.procs: list[subprocess.Popen] = []
        self.ports: dict[str, int] = {}
        self._timeline: Timeline | None = None

    def say(self, message: str) -> None:
        print(message, flush=True)

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.root / f"{name}.log", "wb")
        proc = subprocess.Popen([sys.executable, "-m", "tokenstream.cli", *args],
                                env={**os.environ, **self.stack.environment(), "PYTHONUNBUFFERED": "1",
                                     **(env or {})},
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    async def __aenter__(self) -> LocalSystem:
        from tokenstream.stack.service import free_port
        from topics.admin import apply
        from topics.registry import all_topics

        self.stack.kafka.start(self.say)
        self.stack.redis.start(self.say)
        await apply(all_topics([self.model]), self.stack.kafka.address)
        for name in ("conversation", "safety", "router"):
            self.start(f"processor-{name}", "processor", name, env=self.processor_env)
        metrics = free_port()
        self.start("worker", "worker", "--model", self.model, "--metrics-port", str(metrics))
        count = len(self.gateway_envs)
        for index, (name, env) in enumerate(self.gateway_envs.items()):
            port = self.ports[name] = free_port()
            self.start(f"gateway-{name}", "gateway", "--port", str(port), "--instance-index", str(index),
                       "--instance-count", str(count),
                       env={"TOKENSTREAM_GATEWAY_MODELS": json.dumps([self.model]),
                            "TOKENSTREAM_GATEWAY_ADMISSION_BUDGET_S": "100000", **env})
        self.say("waiting for the worker and the gateways")
        await self._ready([f"http://127.0.0.1:{metrics}/metrics",
                           *(f"http://127.0.0.1:{p}/health/ready" for p in self.ports.values())])
        return self

    async def _ready(self, urls: list[str], timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        for url in urls:
            while True:
                dead = [p for p in self.procs if p.poll() is not None]
                if dead:
                    raise RuntimeError(f"a role exited (logs in {self.root})")
                try:
                    await asyncio.to_thread(urllib.request.urlopen, url, None, 2)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{url} not ready (logs in {self.root})") from None
                    await asyncio.sleep(0.5)

    async def __aexit__(self, *exc) -> None:
        if self._timeline is not None:
            await self._timeline.stop()
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.stack.redis.stop(self.say)
        self.stack.kafka.stop(self.say)

    async def timeline(self) -> Timeline:
        self._timeline = await Timeline(self.stack.kafka.address, self.model).start()
        return self._timeline

    async def stream_one(self, gateway: str, prompt: str, max_tokens: int) -> tuple[str, float, float | None]:
        """One streamed greedy request over a raw socket: (request id, sent at, first content at)."""
        port = self.ports[gateway]
        body = json.dumps({"model": self.model, "stream": True, "max_tokens": max_tokens, "temperature": 0,
                           "messages": [{"role": "user", "content": prompt}]}).encode()
        head = (f"POST /v1/chat/completions HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        sent = time.time()
        writer.write(head + body)
        buf, rid, first = b"", "", None
        while first is None:
            data = await reader.read(65536)
            if not data:
                break
            buf += data
            for m in ID_RE.finditer(buf):
                rid = m.group(1).decode()
                if int(m.group(2)) >= 0:
                    first = time.time()
                    break
        while await reader.read(65536):
            pass
        writer.close()
        return rid, sent, first


class Timeline:
    """When each request's events reached the broker: record timestamps of every hop's topic."""

    def __init__(self, bootstrap: str, model: str) -> None:
        from topics import CHAT_REQUESTS, PREPARED, SCREENED, TOKENS, inference_topic

        self.bootstrap = bootstrap
        self.marks: dict[str, dict] = {}
        self.topics = {CHAT_REQUESTS.name: "chat", PREPARED.name: "prepared", SCREENED.name: "screened",
                       inference_topic(model).name: "inference", TOKENS.name: "tokens"}

    async def start(self) -> Timeline:
        from aiokafka.structs import TopicPartition

        from producers import start_consumer

        self.consumer = await start_consumer(group=None, bootstrap=self.bootstrap, fetch_max_wait_ms=50)
        from topics.registry import spec_for

        tps = [TopicPartition(t, p) for t in self.topics for p in range(spec_for(t).partitions)]
        self.consumer.assign(tps)
        await self.consumer.seek_to_end(*tps)
        for tp in tps:
            await self.consumer.position(tp)
        self._task = asyncio.create_task(self._run())
        return self

    async def _run(self) -> None:
        from producers.publish import decode_record
        from schemas import Completion, TokenChunk
        from topics.registry import spec_for

        while True:
            for tp, records in (await self.consumer.getmany(timeout_ms=100)).items():
                spec = spec_for(tp.topic)
                for record in records:
                    try:
                        event = decode_record(record, spec)
                    except Exception:  # noqa: BLE001 - not ours to judge here
                        continue
                    marks = self.marks.setdefault(event.request_id, {})
                    name = self.topics[tp.topic]
                    if name == "tokens":
                        if isinstance(event, TokenChunk) and "first_token" not in marks:
                            marks["first_token"] = record.timestamp / 1000
                        elif isinstance(event, Completion):
                            marks["completion"] = event
                    else:
                        marks.setdefault(name, record.timestamp / 1000)

    async def settle(self, rids: list[str], timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while any("completion" not in self.marks.get(r, {}) for r in rids) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self.consumer.stop()
