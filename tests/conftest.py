"""Test fixtures: one real stack (Kafka, Redis, Weaviate) per test session on free loopback ports.

Every test that needs a broker gets the real one; its data lives in a temporary folder
and everything is stopped at the end of the session.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from common import id_key
from tokenstream.stack import Stack

# One id key for the session's processes (schemas/ids.py): the roles started here inherit it.
os.environ.setdefault("TOKENSTREAM_ID_KEY", os.urandom(32).hex())
id_key.install()
# Workers compute in float32 in the tests: their greedy answers are compared with HF generate() in
# float32, and are then the same on every CPU (`auto` picks bf16 where the CPU has it natively).
os.environ.setdefault("TOKENSTREAM_WORKER_DTYPE", "float32")
# Workers coalesce their text in the tests: a chunk every 3 tokens, whatever the time (the stream
# interval, gpu_workers/streaming.py): takeover, resume, cancel, erasure and audit replay are tested
# over chunks of several tokens (the deployment default, 32 tokens or 20 ms, would send this CPU
# engine's tokens one by one).
os.environ.setdefault("TOKENSTREAM_WORKER_STREAM_INTERVAL", "3")
os.environ.setdefault("TOKENSTREAM_WORKER_STREAM_INTERVAL_MS", "0")


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory):
    root: Path = tmp_path_factory.mktemp("stack")
    stack = Stack.ephemeral(root)
    old = {k: os.environ.get(k) for k in stack.environment()}
    try:
        stack.up(say=lambda m: print(m))
        os.environ.update(stack.environment())
        from common.config import settings

        settings.cache_clear()
        yield stack
    finally:
        stack.down(say=lambda m: print(m))
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def bootstrap(stack: Stack) -> str:
    return stack.kafka.address


@pytest.fixture
def unique() -> str:
    """A fresh suffix for topic and group names, so tests never see each other's events."""
    return uuid.uuid4().hex[:8]


# What a role's process runs first: it asks to be SIGKILLed when the test session's process ends, however
# it ends (a pytest killed by a timeout runs no teardown, and a role outlives a dead broker by design),
# then becomes `python -m tokenstream.cli ARGS`, the same process. (Not a preexec_fn: those are unsafe in
# a process with threads, as the test session is.) argv: the session's pid, then the role's arguments.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)  # the session ended before the signal was asked for\n"
    "os.execv(sys.executable, [sys.executable, '-m', 'tokenstream.cli', *sys.argv[2:]])\n"
)


class Roles:
    """Starts tokenstream roles as real processes (`tokenstream ...`) pointed at the test stack.

    Each process logs to its own file; every one still running is killed at the end of the test.
    """

    def __init__(self, stack: Stack, log_dir: Path) -> None:
        self.stack = stack
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []

    def start(
        self, *args: str, env: dict[str, str] | None = None, name: str | None = None
    ) -> subprocess.Popen:
        name = name or "-".join(args[:2])
        # the child keeps its copy of the log's descriptor; this process needs none
        with open(self.log_dir / f"{name}-{len(self.procs)}.log", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *args],
                # every role of the suite shares this host's cores: a worker's threads sleep rather than
                # spin (as the local stacks run it, tokenstream.stack.roles.shared_host_worker_args)
                env={
                    **os.environ,
                    **self.stack.environment(),
                    "PYTHONUNBUFFERED": "1",
                    "TOKENSTREAM_WORKER_SPIN_WAIT": "false",
                    **(env or {}),
                },
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        proc.log_path = log.name  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def start_processors(self, env: dict[str, str] | None = None) -> dict[str, subprocess.Popen]:
        """The conversation, safety and router processors, logging at info."""
        return {
            name: self.start("processor", name, "--loglevel", "info", env=env, name=f"processor-{name}")
            for name in ("conversation", "safety", "router")
        }

    def log(self, proc: subprocess.Popen) -> str:
        return Path(proc.log_path).read_text(errors="replace")  # type: ignore[attr-defined]

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture
def roles(stack: Stack, tmp_path: Path):
    r = Roles(stack, tmp_path)
    yield r
    r.stop_all()


@pytest.fixture
def no_broker(monkeypatch):
    """For tests that only build a faust app and reach no broker or Redis: no credentials to look up,
    and no keyring installed (the first one installed serves the whole process: built here before the
    suite's stack is up, it pointed every later test's sealing at a Redis that is not there)."""
    from common.config import settings

    monkeypatch.setenv("TOKENSTREAM_KAFKA_SECURITY", "plaintext")
    monkeypatch.setenv("TOKENSTREAM_SEALING", "false")
    settings.cache_clear()
    yield
    monkeypatch.undo()
    settings.cache_clear()
