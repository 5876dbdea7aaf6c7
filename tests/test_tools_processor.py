"""The tool processor as a real `tokenstream tools` process on the real broker and Redis."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import msgspec
import openai
import pytest
import redis

from producers import decode_record, publish, start_consumer
from schemas import ToolResult, encode
from schemas import keys as K
from schemas.keys import tool_result
from tests.chart_page import chart_on_the_page, framed
from tests.tool_support import code_call, sandbox_root, serving, tools_env
from tests.voice_page import CHROMIUM
from tools.sandbox import folder_name
from topics.registry import DEAD_LETTER, TOOL_RESULTS


async def test_code_runs_and_the_folder_persists_within_a_conversation_only(roles, bootstrap):
    root = sandbox_root()
    async with serving(roles, bootstrap, tools_env(root)) as (_, bus):
        first = code_call("open('state.txt', 'w').write('42')\nprint('saved')\n6 * 7")
        await bus.send(first)
        r1 = (await bus.wait([first.call_id]))[first.call_id]
        assert r1.ok, r1.error
        out = json.loads(r1.output)
        assert out["stdout"] == "saved\n" and out["value"] == "42"
        assert out["files"] == [{"path": "state.txt", "bytes": 2, "text": "42"}]  # what the model reads
        assert json.loads(r1.meta["files"]) == [
            {
                "path": "state.txt",
                "bytes": 2,
                "kept": True,
                "file_id": K.container_file_id(first.call_id, "state.txt"),
            }
        ]
        assert r1.meta["container_id"] == K.container_id(first.conversation_id)
        assert float(r1.meta["cpu_s"]) > 0 and int(r1.meta["max_rss_kb"]) > 0 and r1.duration_s > 0
        second = code_call("open('state.txt').read()", conversation=first.conversation_id)
        other = code_call("import os; os.listdir('.')")  # another conversation: its own empty folder
        await bus.send(second)
        await bus.send(other)
        got = await bus.wait([second.call_id, other.call_id])
        assert json.loads(got[second.call_id].output)["value"] == "'42'"
        assert json.loads(got[other.call_id].output)["value"] == "[]"
        assert got[second.call_id].request_id == second.request_id  # keyed and tagged like the call


CHART = """
import matplotlib.pyplot as plt
import pandas as pd
table = pd.DataFrame({"month": [1, 2, 3], "sales": [3, 5, 8]})
table.to_csv("data.csv", index=False)
plt.plot(table.month, table.sales)
plt.title("sales")
plt.savefig("plot.png")
print(table.sales.sum())
"""


async def test_a_chart_and_a_table_the_code_writes_are_listed_and_downloaded_by_their_tenant_alone(
    roles, bootstrap, tmp_path
):
    """matplotlib and pandas in the sandbox; the files a run writes kept as its container's files, which
    the gateway lists and serves (OpenAI's containers API, through the SDK) to the call's tenant only, and
    the chat page shows (the chart inline, the table as a download; tests/chart_page.py)."""
    from tests.gateway_support import api_client, new_key, start_gateway

    # the processor's default limits (pandas and matplotlib map more than the other tests' 256 MiB)
    limits = {
        "TOKENSTREAM_TOOLS_MEMORY_MB": "512",
        "TOKENSTREAM_TOOLS_CPU_S": "10",
        "TOKENSTREAM_TOOLS_WALL_S": "30",
    }
    async with serving(roles, bootstrap, tools_env(sandbox_root(), **limits)) as (_, bus):
        call = code_call(CHART, tenant="test")  # the tests' default key's tenant
        await bus.send(call)
        result = (await bus.wait([call.call_id]))[call.call_id]
    out = json.loads(result.output)
    assert result.ok and out["stdout"] == "16\n", result
    container = result.meta["container_id"]
    assert container == K.container_id(call.conversation_id)
    assert {f["path"]: f["kept"] for f in json.loads(result.meta["files"])} == {
        "data.csv": True,
        "plot.png": True,
    }
    url, _ = start_gateway(roles, ["smollm2"], timeout=120)
    client = api_client(url)
    listed = await client.containers.files.list(container)
    assert sorted(f.path for f in listed.data) == ["data.csv", "plot.png"]
    by_path = {f.path: f for f in listed.data}
    csv = await client.containers.files.content.retrieve(by_path["data.csv"].id, container_id=container)
    assert csv.content == b"month,sales\n1,3\n2,5\n3,8\n"
    png = await client.containers.files.content.retrieve(by_path["plot.png"].id, container_id=container)
    assert png.content[:8] == b"\x89PNG\r\n\x1a\n" and len(png.content) == by_path["plot.png"].bytes
    assert (
        await client.containers.files.retrieve(by_path["plot.png"].id, container_id=container)
    ).path == "plot.png"
    if os.path.exists(CHROMIUM):  # the chat page shows the chart inline and offers the table
        item, citations = framed(result, call.conversation_id)
        _size, text = await chart_on_the_page(url, item, citations, tmp_path)
        assert text == "month,sales\n1,3\n2,5\n3,8\n"
    stranger = openai.AsyncOpenAI(base_url=url + "/v1", api_key=new_key("someone-else"), max_retries=0)
    with pytest.raises(openai.NotFoundError):
        await stranger.containers.files.list(container)
    with pytest.raises(openai.NotFoundError):
        await stranger.containers.files.content.retrieve(by_path["data.csv"].id, container_id=container)


async def test_a_call_read_twice_runs_once_a_completed_one_is_replayed_and_bad_events_dead_lettered(
    roles, bootstrap, stack
):
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
        stored = ToolResult(
            request_id=completed.request_id,
            call_id=completed.call_id,
            name=completed.name,
            ok=True,
            output='{"value": "stored"}',
            conversation_id=completed.conversation_id,
            tenant=completed.tenant,
        )
        r = redis.Redis.from_url(stack.redis.address)
        r.set(tool_result(completed.call_id), encode(stored))
        await bus.send(completed)
        # ...and one whose processor died after the broker took its result, before the published mark:
        # the result is found in the log and marked, not written again (a call behind it, same key, marks
        # when it was handled: calls of one partition run in order)
        written = code_call("open('ran', 'w').write('again')")
        kept = msgspec.structs.replace(
            stored,
            request_id=written.request_id,
            call_id=written.call_id,
            conversation_id=written.conversation_id,
            output='{"value": 1}',
        )
        r.set(tool_result(written.call_id), encode(kept))
        await publish(bus.producer, TOOL_RESULTS, kept, key=written.request_id)
        await bus.send(written)
        behind = code_call("2", request_id=written.request_id)
        await bus.send(behind)
        sentinel = code_call("1")
        await bus.send(sentinel)  # on its own partition maybe; wait for it and the call
        got = await bus.wait([call.call_id, sentinel.call_id, completed.call_id, behind.call_id])
        assert got[completed.call_id].output == '{"value": "stored"}'
        assert bus.count(written.call_id) == 1 and r.exists(K.tool_published(written.call_id))
        assert not (root / folder_name("t-test", written.conversation_id) / "ran").exists()
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


# make test-all, with the kill -9 mid-run of tests/responses/test_responses.py; make test keeps a call read
# twice running once (above)
@pytest.mark.heavy
async def test_kill_9_mid_call_the_next_processor_completes_it_once(roles, bootstrap):
    root = sandbox_root()
    env = tools_env(root, TOKENSTREAM_TOOLS_WALL_S="20")
    async with serving(roles, bootstrap, env, name="tools-first") as (first, bus):
        call = code_call(
            "import time\nopen('starts', 'a').write('s')\ntime.sleep(4)\n"
            "open('finished', 'a').write('f')\n'done'"
        )
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
        assert (folder / "starts").read_text() == "ss"  # interrupted once, then run again
        assert (folder / "finished").read_text() == "f"  # ran to completion once
        # everything the group had to read is read and committed: the result stays single
        sentinel = code_call("1")
        await bus.send(sentinel)
        await bus.wait([sentinel.call_id])
        await bus.poll()
        assert bus.count(call.call_id) == 1
        assert second.poll() is None
