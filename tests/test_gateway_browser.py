"""The chat page in a real headless Chromium: streamed multi-turn answers, the stop button, and a
dropped connection (the gateway killed mid-answer, another one started) resumed from the log.
Screenshots of the page are taken into the test's temporary folder and checked there."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import uuid

import pytest

from tests.conftest import Roles
from tests.gateway_support import (
    Chromium,
    FakePipeline,
    default_key,
    expected_answer,
    free_port,
    start_gateway,
)
from tests.kafka_support import wait_for as until

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian's chromium is not installed")


@pytest.fixture
async def pipeline(stack, bootstrap):
    p = await FakePipeline(bootstrap, f"page-{uuid.uuid4().hex[:6]}", token_delay=0.08).start()
    yield p
    await p.stop()


@pytest.fixture
def browser(tmp_path):
    b = Chromium(tmp_path / "profile", CHROMIUM)
    try:
        b.connect()
        yield b
    finally:
        b.close()


async def test_chat_page(stack, pipeline, browser, tmp_path):
    roles = Roles(stack, tmp_path)
    port = free_port()
    env = {"TOKENSTREAM_GATEWAY_CANCEL_GRACE_S": "30"}
    try:
        url, first = await asyncio.to_thread(start_gateway, roles, [pipeline.model], port=port, env=env)

        async def js(expr: str):
            return await asyncio.to_thread(browser.js, expr)

        async def wait_for(expr: str, timeout: float = 30):
            return await asyncio.to_thread(browser.wait_for, expr, timeout)

        async def say(text: str) -> None:
            await js(
                f"document.getElementById('input').value = {json.dumps(text)};"
                "document.getElementById('send').click()"
            )

        answers = "Array.from(document.querySelectorAll('.assistant')).map(d => d.firstChild.data)"
        await asyncio.to_thread(browser.call, "Page.enable")
        await asyncio.to_thread(browser.call, "Page.navigate", url=url + "/")
        # no key yet: the page asks for one; once given, it is remembered across a reload
        await wait_for("document.body.classList.contains('needs-key')")
        await js(
            f"document.getElementById('apikey').value = {json.dumps(default_key())};"
            "document.getElementById('savekey').click()"
        )
        await wait_for("document.body.dataset.state === 'idle' && document.getElementById('model').value")
        await asyncio.to_thread(browser.call, "Page.reload")
        await wait_for(
            "document.body.dataset.state === 'idle' && document.getElementById('model').value"
            " && !document.body.classList.contains('needs-key')"
        )

        # a streamed answer: tokens appear one by one before the answer completes
        turn1 = "hello from a real browser " + " ".join(f"w{i}" for i in range(12))
        await say(turn1)
        await wait_for(f"(({answers})[0] || '').split(' ').length >= 3")
        partial = (await js(answers))[0]
        assert partial and partial != turn1, "the answer should be visible while it streams"
        await asyncio.to_thread(browser.screenshot, tmp_path / "streaming.png")
        await wait_for("document.body.dataset.state === 'idle'")
        assert (await js(answers))[0] == expected_answer(turn1)

        # multi-turn: the whole history goes with the second question
        await say("and a second turn")
        await wait_for(
            "document.body.dataset.state === 'idle' && document.querySelectorAll('.assistant').length == 2"
        )
        assert (await js(answers))[1] == "and a second turn"
        last = max(pipeline.requests.values(), key=lambda r: r.created_at)
        assert [m.role for m in last.messages] == ["user", "assistant", "user"]
        assert last.messages[1].content == expected_answer(turn1)

        # stop: the answer stops early and the worker's slot is freed
        await say(" ".join(f"s{i}" for i in range(60)))
        await wait_for(f"(({answers})[2] || '').split(' ').length >= 3")
        await js("document.getElementById('stop').click()")
        await wait_for("document.body.dataset.state === 'idle'")
        stopped = (await js(answers))[2]
        assert 3 <= len(stopped.split()) < 60
        rid = (await js("window.tokenstream.completionId")).removeprefix("chatcmpl-")
        await until(lambda: rid not in pipeline.active, 10, "the stopped answer's slot freed")
        assert rid not in pipeline.active and pipeline.served[rid].finish_reason == "cancelled"

        # a dropped connection: kill the gateway mid-answer, start another; the page resumes
        turn4 = " ".join(f"r{i}" for i in range(40))
        await say(turn4)
        await wait_for(f"(({answers})[3] || '').split(' ').length >= 5")
        os.killpg(first.pid, signal.SIGKILL)
        await asyncio.to_thread(first.wait)
        await wait_for("document.getElementById('status').textContent.includes('resuming')", 10)
        await asyncio.to_thread(start_gateway, roles, [pipeline.model], port=port, env=env)
        await wait_for("document.body.dataset.state === 'idle'", 60)
        assert (await js(answers))[3] == expected_answer(turn4)
        assert await js("window.tokenstream.resumes") >= 1
        assert "resumed" in await js("document.querySelectorAll('.assistant')[3].textContent")
        shot = tmp_path / "chat-page.png"
        await asyncio.to_thread(browser.screenshot, shot)  # streamed, stopped and resumed answers
        assert shot.stat().st_size > 10_000
    finally:
        await asyncio.to_thread(roles.stop_all)
