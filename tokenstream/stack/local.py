"""The whole system on a throwaway stack, for benchmarks and fault drills: every role a real process.

`LocalSystem` starts Kafka (one node, or a cluster of `brokers`) and Redis on free ports, applies the
topics, then `instances` processes of each processor and of the worker, and one gateway per entry of
`gateways` (each with its own environment and its own share of the tokens partitions). Every process can
be killed (-9) and started again with the same arguments. `key` is an API key of tenant `local` (paid,
no limits, exact cache off) for the clients of a benchmark or drill. `supervise()` restarts any that
exits, with back-off, as a process supervisor (systemd, Kubernetes) would. Logs stay in the given
folder.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

PROCESSORS = ("conversation", "safety", "router")


@dataclass
class Process:
    """One `tokenstream <args>` process of the system, restartable with the same arguments."""

    name: str
    role: str
    args: list[str]
    env: dict[str, str]
    probe: str | None = None  # URL that answers 200 once it serves
    popen: subprocess.Popen | None = None
    starts: int = 0
    started_at: float = 0.0
    backoff_s: float = 1.0
    killed: bool = False  # by kill9(): an injected fault, not a crash loop
    logs: list[Path] = field(default_factory=list)

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


class LocalSystem:
    def __init__(
        self,
        root: Path,
        model: str,
        gateways: dict[str, dict[str, str]],
        *,
        instances: int = 1,
        processor_env: dict[str, str] | None = None,
        worker_args: tuple[str, ...] = (),
        workers: int | None = None,
        brokers: int = 1,
    ) -> None:
        from tokenstream.stack import Stack

        self.root, self.model, self.gateway_envs, self.instances = root, model, gateways, instances
        self.processor_env = processor_env or {}
        self.worker_args = worker_args
        self.workers = instances if workers is None else workers
        self.stack = Stack.ephemeral(root, brokers=brokers)
        self.procs: dict[str, Process] = {}
        self.ports: dict[str, int] = {}
        self.key = ""

    def say(self, message: str) -> None:
        print(message, flush=True)

    # ---------------------------------------------------------------- processes
    def add(
        self, name: str, role: str, *args: str, env: dict[str, str] | None = None, probe: str | None = None
    ) -> Process:
        proc = self.procs[name] = Process(name, role, list(args), env or {}, probe)
        self.launch(proc)
        return proc

    def launch(self, proc: Process) -> None:
        proc.starts += 1
        proc.started_at = time.monotonic()
        path = self.root / f"{proc.name}.{proc.starts}.log"
        proc.logs.append(path)
        with open(path, "wb") as log:
            proc.popen = subprocess.Popen(
                [sys.executable, "-m", "tokenstream.cli", *proc.args],
                env={**os.environ, **self.stack.environment(), "PYTHONUNBUFFERED": "1", **proc.env},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def kill9(self, name: str) -> None:
        proc = self.procs[name]
        if proc.alive:
            proc.killed = True
            os.killpg(proc.popen.pid, signal.SIGKILL)
            proc.popen.wait()

    async def freeze(self, name: str, seconds: float) -> None:
        """Stop a process (SIGSTOP) for `seconds`, then let it go on: alive to its supervisor, silent
        to the broker."""
        proc = self.procs[name]
        if proc.alive:
            os.killpg(proc.popen.pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(seconds)
            finally:
                os.killpg(proc.popen.pid, signal.SIGCONT)

    async def supervise(
        self, stop: asyncio.Event, first_backoff_s: float = 1.0, most_s: float = 30.0
    ) -> None:
        """Start again every process that exited, after a back-off that doubles while it keeps
        exiting by itself within a minute of its start (and resets once it stays up). A process
        killed by `kill9` is started again after the first back-off: an injected fault is no crash
        loop (doubled, a role killed twice within a minute stayed down up to 30 s, longer than
        the fault it stood for)."""
        from producers.membership import evict_and_say

        died: dict[str, float] = {}
        evicting: set[asyncio.Task] = set()  # a dead process taken out of its groups (membership.evict)
        while not stop.is_set():
            now = time.monotonic()
            for proc in self.procs.values():
                if proc.alive:
                    if now - proc.started_at > 60:
                        proc.backoff_s = first_backoff_s
                    continue
                if proc.killed:
                    proc.killed, proc.backoff_s = False, first_backoff_s
                if proc.name not in died:  # seen dead just now: its groups need not wait out its session
                    task = asyncio.create_task(
                        evict_and_say(self.stack.kafka.address, proc.popen.pid, proc.name, self.say)
                    )
                    evicting.add(task)
                    task.add_done_callback(evicting.discard)
                since = died.setdefault(proc.name, now)
                if now - since >= proc.backoff_s:
                    del died[proc.name]
                    quick = now - proc.started_at < 60
                    proc.backoff_s = min(most_s, proc.backoff_s * 2) if quick else first_backoff_s
                    self.launch(proc)
            await asyncio.sleep(0.2)

    def of_role(self, role: str) -> list[Process]:
        return [p for p in self.procs.values() if p.role == role]

    # ---------------------------------------------------------------- lifecycle
    async def __aenter__(self) -> Self:
        from tokenstream.stack.roles import shared_host_worker_args
        from tokenstream.stack.service import free_port
        from tokenstream.stack.stack import use
        from topics.admin import apply
        from topics.registry import all_topics

        self.stack.kafka.start(self.say)
        self.stack.redis.start(self.say)
        self.stack.cache.start(self.say)
        use(self.stack.kafka.environment())  # this process's own clients (apply, the drill's checks)
        from tokenstream.keys import KeyStore

        self.key, _ = KeyStore(self.stack.redis.address).create(
            "local", tier="paid", name="local system", exact_cache=False
        )
        await apply(all_topics([self.model]), self.stack.kafka.address)
        for i in range(self.instances):
            for name in PROCESSORS:
                self.add(f"{name}-{i}", name, "processor", name, env=self.processor_env)
        # (a caller that gives its own --threads chose the share)
        share = (
            ["--no-spin-wait"] if "--threads" in self.worker_args else shared_host_worker_args(self.workers)
        )
        for i in range(self.workers):
            port = free_port()
            self.add(
                f"worker-{i}",
                "worker",
                "worker",
                "--model",
                self.model,
                "--metrics-port",
                str(port),
                "--worker-id",
                f"worker-{i}",
                *share,
                *self.worker_args,
                probe=f"http://127.0.0.1:{port}/metrics",
            )
        count = len(self.gateway_envs)
        for index, (name, env) in enumerate(self.gateway_envs.items()):
            port = self.ports[name] = free_port()
            self.add(
                f"gateway-{name}",
                "gateway",
                "gateway",
                "--port",
                str(port),
                "--instance-index",
                str(index),
                "--instance-count",
                str(count),
                probe=f"http://127.0.0.1:{port}/health/ready",
                env={
                    "TOKENSTREAM_GATEWAY_MODELS": json.dumps([self.model]),
                    "TOKENSTREAM_GATEWAY_INSTANCE_ID": f"gateway-{name}",
                    "TOKENSTREAM_GATEWAY_ADMISSION_BUDGET_S": "100000",
                    **env,
                },
            )
        self.say("waiting for the workers and the gateways")
        await self.ready([p for p in self.procs.values() if p.probe])
        return self

    async def ready(self, procs: list[Process], timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        for proc in procs:
            while True:
                if not proc.alive:
                    raise RuntimeError(f"{proc.name} exited (log {proc.logs[-1]})")
                try:
                    await asyncio.to_thread(urllib.request.urlopen, proc.probe, None, 2)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{proc.name} not ready (log {proc.logs[-1]})") from None
                    await asyncio.sleep(0.5)

    async def __aexit__(self, *exc) -> None:
        for proc in self.procs.values():
            if proc.alive:
                proc.popen.terminate()
        for proc in self.procs.values():
            if proc.popen is not None:
                try:
                    proc.popen.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.popen.pid, signal.SIGKILL)
        self.stack.cache.stop(self.say)
        self.stack.redis.stop(self.say)
        self.stack.kafka.stop(self.say)

    def url(self, gateway: str) -> str:
        return f"http://127.0.0.1:{self.ports[gateway]}"
