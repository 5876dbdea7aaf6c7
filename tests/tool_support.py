"""Driving a real `tokenstream tools` process through the real broker: send ToolCalls, read ToolResults."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Self

from producers import decode_record, publish, start_consumer, start_producer
from schemas import ToolCall, ToolResult
from topics.admin import apply
from topics.registry import DEAD_LETTER, FILE_INGEST, SPEECH_JOBS, TOKENS, TOOL_CALLS, TOOL_RESULTS


def sandbox_root() -> Path:
    """A sandbox root the unprivileged sandbox user can reach (pytest's tmp folders are 0700)."""
    root = Path(tempfile.mkdtemp(prefix="ts-sandbox-", dir="/tmp"))
    os.chmod(root, 0o711)
    atexit.register(shutil.rmtree, root, True)
    return root


def tools_env(root: Path, **extra: str) -> dict[str, str]:
    env = {
        "TOKENSTREAM_TOOLS_SANDBOX_DIR": str(root),
        "TOKENSTREAM_TOOLS_CPU_S": "3",
        "TOKENSTREAM_TOOLS_WALL_S": "8",
        "TOKENSTREAM_TOOLS_MEMORY_MB": "256",
        "TOKENSTREAM_TOOLS_OUTPUT_KB": "16",
        "TOKENSTREAM_TOOLS_FILE_MB": "1",
        "TOKENSTREAM_TOOLS_PROCESSES": "16",
        "TOKENSTREAM_TOOLS_CLAIM_LEASE_S": "3",
    }
    env.update(extra)
    return env


def code_call(code: str, conversation: str = "", request_id: str = "", tenant: str = "t-test") -> ToolCall:
    import json

    return ToolCall(
        request_id=request_id or f"req-{uuid.uuid4().hex[:10]}",
        call_id=f"call-{uuid.uuid4().hex}",
        conversation_id=conversation or f"conv-{uuid.uuid4().hex[:8]}",
        tenant=tenant,
        name="code_interpreter",
        arguments=json.dumps({"code": code}),
    )


class ToolBus:
    """A producer of calls and a group-less reader of every result written since it started."""

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        self.results: list[ToolResult] = []

    async def __aenter__(self) -> Self:
        # every topic the processor uses (its speech loop too: a topic it may not read ends the process)
        await apply([TOOL_CALLS, TOOL_RESULTS, FILE_INGEST, SPEECH_JOBS, TOKENS, DEAD_LETTER], self.bootstrap)
        self.producer = await start_producer(self.bootstrap)
        self.consumer = await start_consumer(TOOL_RESULTS, group=None, bootstrap=self.bootstrap)
        await self.consumer.getmany(timeout_ms=100)  # position at the end now
        return self

    async def __aexit__(self, *exc) -> None:
        await self.consumer.stop()
        await self.producer.stop()

    async def send(self, call: ToolCall) -> None:
        await publish(self.producer, TOOL_CALLS, call, key=call.request_id)

    async def send_raw(self, value: bytes, key: bytes) -> None:
        await self.producer.send_and_wait(TOOL_CALLS.name, value, key=key)

    async def poll(self) -> None:
        batches = await self.consumer.getmany(timeout_ms=200)
        for records in batches.values():
            self.results += [decode_record(r, TOOL_RESULTS) for r in records]

    async def wait(self, call_ids: list[str], timeout_s: float = 120) -> dict[str, ToolResult]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            await self.poll()
            found = {r.call_id: r for r in self.results if r.call_id in call_ids}
            if len(found) == len(call_ids):
                return found
        missing = set(call_ids) - {r.call_id for r in self.results}
        raise AssertionError(f"no result within {timeout_s} s for {sorted(missing)}")

    def count(self, call_id: str) -> int:
        return sum(1 for r in self.results if r.call_id == call_id)


async def wait_ready(proc, read_log, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError("tool processor exited:\n" + read_log(proc))
        if "serving" in read_log(proc):
            return
        await asyncio.sleep(0.2)
    raise AssertionError("tool processor not ready:\n" + read_log(proc))


@contextlib.asynccontextmanager
async def serving(roles, bootstrap: str, env: dict[str, str], name: str | None = None):
    """A real `tokenstream tools` process, ready, and a ToolBus on the same broker."""
    proc = roles.start("tools", env=env, name=name)
    async with ToolBus(bootstrap) as bus:
        await wait_ready(proc, roles.log)
        yield proc, bus
