"""The tool processor as a real `tokenstream tools` process on the real broker and Redis."""

from __future__ import annotations

import pytest

import asyncio
import json
import os
import signal
import time

import redis

from producers import decode_record, start_consumer
from schemas import ToolResult, encode
from schemas.keys import tool_result
from tests.tool_support import code_call, sandbox_root, serving, tools_env
from tools.sandbox import folder_name
from topics.registry import DEAD_LETTER


async def test_code_runs_and_the_folder_persists_within_a_conversation_only(roles, bootstrap):
    root = sandbox_root()
    async with serving(roles, bootstrap, tools_env(root)) as (_, bus):
        first = code_call("open('state.txt', 'w').write('42')\nprint('saved')\n6 * 7")
        await bus.send(first)
        r1 = (await bus.wait([first.call_id]))[first.call_id]
        assert r1.ok, r1.error
        out = json.loads(r1.output)
        assert out["stdout"] == "saved\n" and out["value"] == "42"
        assert out["files"] == [{"path": "state.txt", "bytes": 2, "text": "42"}]
        assert float(r1.meta["cpu_s"]) > 0 and int(r1.meta["max_rss_kb"]) > 0 and r1.duration_s > 0
        second = code_call("open('state.txt').read()", conversation=first.conversation_id)
        other = code_call("import os; os.listdir('.')")  # another conversation: its own empty folder
        await bus.send(second)
        await bus.send(other)
        got = await bus.wait([second.call_id, other.call_id])
        assert json.loads(got[second.call_id].output)["value"] == "'42'"
        assert json.loads(got[other.call_id].output)["value"] == "[]"
        assert got[second.call_id].request_id == second.request_id  # keyed and tagged like the call


async def test_a_call_read_twice_runs_once_a_completed_one_is_replayed_and_bad_events_dead_lettered(roles, bootstrap, stack):
    root = sandbox_root()
    async with serving(roles, bootstrap, tools_env(root)) as (_, bus):
        call = code_call("open('runs', 'a').write('x')\nlen(open('runs').read())")
        await bus.send(call)
        await bus.send(call)  # a duplicate (a writer's retry): same call id
        bad_key = f"bad-{call.call_id}".encode()
        await bus.send_raw(b'{"type": "tool_call", "not": "valid"', key=bad_key)
        # a call whose run completed (result stored) but whose processor died before publishing:
        # the stored result is replayed, the code is not run again
        completed = code_call("open('ran', 'w').write('again')")
        stored = ToolResult(request_id=completed.request_id, call_id=completed.call_id, name=completed.name,
                            ok=True, output='{"value": "stored"}', conversation_id=completed.conversation_id,
                            tenant=completed.tenant)
        r = redis.Redis.from_url(stack.redis.address)
        r.set(tool_result(completed.call_id), encode(stored))
        await bus.send(completed)
        sentinel = code_call("1")
        await bus.send(sentinel)  # on its own partition maybe; wait for it and the call
        got = await bus.wait([call.call_id, sentinel.call_id, completed.call_id])
        assert got[completed.call_id].output == '{"value": "stored"}'
        assert not (root / folder_name("t-test", completed.conversation_id) / "ran").exists()
        folder = root / folder_name("t-test", call.conversation_id)
        deadline = time.monotonic() + 30
        letters = await start_consumer(DEAD_LETTER, group=None, bootstrap=bootstrap, from_beginning=True)
        try:
            found = None
            while found is None and time.monotonic() < deadline:
                for records in (await letters.getmany(timeout_ms=300)).values():
                    for r in records:
                        letter = decode_record(r, DEAD_LETTER)
                        if letter.key == bad_key:
                            found = letter
            assert found is not None and found.consumer_group == "ts-tools"
        finally:
            await letters.stop()
        # the duplicate is behind the dead letter on its partition or before it: either way, by now read
        await bus.poll()
        assert (folder / "runs").read_text() == "x"
        assert bus.count(call.call_id) == 1


@pytest.mark.heavy  # make test-all; make test kills the tool processor mid-run in tests/test_responses.py
async def test_kill_9_mid_call_the_next_processor_completes_it_once(roles, bootstrap):
    root = sandbox_root()
    env = tools_env(root, TOKENSTREAM_TOOLS_WALL_S="20")
    async with serving(roles, bootstrap, env, name="tools-first") as (first, bus):
        call = code_call("import time\nopen('starts', 'a').write('s')\ntime.sleep(4)\n"
                         "open('finished', 'a').write('f')\n'done'")
        folder = root / folder_name("t-test", call.conversation_id)
        await bus.send(call)
        deadline = time.monotonic() + 60
        while not (folder / "starts").exists():
            assert time.monotonic() < deadline, roles.log(first)
            await asyncio.sleep(0.05)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        assert not (folder / "finished").exists()
        second = roles.start("tools", env=env, name="tools-second")
        result = (await bus.wait([call.call_id], timeout_s=120))[call.call_id]
        assert result.ok and json.loads(result.output)["value"] == "'done'", result
        assert (folder / "starts").read_text() == "ss"   # interrupted once, then run again
        assert (folder / "finished").read_text() == "f"  # ran to completion once
        # everything the group had to read is read and committed: the result stays single
        sentinel = code_call("1")
        await bus.send(sentinel)
        await bus.wait([sentinel.call_id])
        await bus.poll()
        assert bus.count(call.call_id) == 1
        assert second.poll() is None
