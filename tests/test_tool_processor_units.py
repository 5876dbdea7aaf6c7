"""Pieces of the tool processor: run_tool's error handling, web checks, chunks, folders (no broker), and the
call ledger's claims against the stack's real Redis."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from schemas import ToolCall
from schemas.keys import tool_claim, tool_published
from tools.base import Outcome, ToolError, builtin_tools
from tools.config import ToolSettings
from tools.ledger import CallLedger
from tools.processor import run_tool
from tools.sandbox import folder_name
from tools.web import allowed, resolve


class Slow:
    name = "slow"

    async def run(self, call: ToolCall, args: dict) -> Outcome:
        await asyncio.sleep(30)
        return Outcome("late")


class Broken:
    name = "broken"

    async def run(self, call: ToolCall, args: dict) -> Outcome:
        raise KeyError("bug")


class Echo:
    name = "echo"

    async def run(self, call: ToolCall, args: dict) -> Outcome:
        if "say" not in args:
            raise ToolError("echo needs say")
        return Outcome(args["say"], meta={"n": "1"})


def call(name: str, arguments: str) -> ToolCall:
    return ToolCall(
        request_id="req-1",
        call_id="call-1",
        conversation_id="conv",
        tenant="t",
        name=name,
        arguments=arguments,
    )


async def test_run_tool_turns_every_failure_into_a_result():
    ok = await run_tool(Echo(), call("echo", '{"say": "hi"}'), 5)
    assert ok.ok and ok.output == "hi" and ok.meta == {"n": "1"} and ok.request_id == "req-1"
    refused = await run_tool(Echo(), call("echo", "{}"), 5)
    assert not refused.ok and refused.error == "echo needs say"
    assert "not valid JSON" in (await run_tool(Echo(), call("echo", "{"), 5)).error
    assert "must be a JSON object" in (await run_tool(Echo(), call("echo", "[1]"), 5)).error
    bug = await run_tool(Broken(), call("broken", "{}"), 5)
    assert not bug.ok and bug.error == "internal error in tool broken: KeyError"
    slow = await run_tool(Slow(), call("slow", "{}"), 0.2)
    assert not slow.ok and "took longer than 0.2 s" in slow.error and slow.duration_s < 5


def test_the_builtin_tools_are_found_by_name():
    assert set(builtin_tools()) >= {"code_interpreter", "web_fetch", "file_search"}


def test_allowlist_entries_and_subdomains():
    assert allowed("Docs.Example.com.", ["docs.example.com"])
    assert allowed("a.example.com", [".example.com"]) and not allowed("example.com.evil", [".example.com"])
    assert not allowed("evil-example.com", [".example.com"]) and not allowed("x.org", [])


async def test_private_addresses_are_refused_unless_the_host_is_allowlisted_for_them():
    cfg = ToolSettings(web_allow_hosts=["127.0.0.1", "10.1.2.3"], web_allow_private=["127.0.0.1"])
    assert await resolve("127.0.0.1", 80, cfg) == "127.0.0.1"
    with pytest.raises(ToolError, match="private or loopback"):
        await resolve("10.1.2.3", 80, cfg)
    with pytest.raises(ToolError, match="not on the web tool's allowlist"):
        await resolve("192.168.0.1", 80, cfg)


def test_conversation_folders_are_hashes_apart_per_tenant():
    assert folder_name("a", "../../etc") != folder_name("b", "../../etc")
    assert all(c in "0123456789abcdef" for c in folder_name("a", "../../etc"))


def test_the_registry_names_the_group_the_processor_joins():
    from tools.processor import GROUP
    from topics.registry import TOOL_CALLS, TOOL_RESULTS, Role

    assert TOOL_CALLS.groups == [GROUP] == ["ts-tools"]
    assert [w.role for w in TOOL_RESULTS.writers] == [Role.TOOLS]


async def test_a_slow_processor_never_renews_or_releases_a_claim_another_now_holds(stack):
    call_id = f"call-{uuid.uuid4().hex}"
    slow, fresh = CallLedger("tools-slow", lease_s=0.3), CallLedger("tools-fresh", lease_s=30)
    try:
        assert await slow.claim(call_id) and await slow.renew(call_id)  # its own claim: renewed
        assert not await fresh.claim(call_id)
        deadline = time.monotonic() + 10  # the slow one stalls: its lease lapses
        while await slow.redis.exists(tool_claim(call_id)) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert await fresh.claim(call_id)
        # the slow processor wakes up: its renewal, its release (its run failed) and its published mark
        # (its run completed first) all leave the other's claim as it was
        assert not await slow.renew(call_id) and not await slow.release(call_id)
        await slow.mark_published(call_id)
        assert await fresh.redis.get(tool_claim(call_id)) == b"tools-fresh"
        assert await fresh.redis.pttl(tool_claim(call_id)) > 20_000  # the fresh lease, not the slow one's
        assert await fresh.published(call_id)
        assert await fresh.renew(call_id) and await fresh.release(call_id)
        assert not await fresh.redis.exists(tool_claim(call_id))
    finally:
        await fresh.redis.delete(tool_claim(call_id), tool_published(call_id))
        await slow.close()
        await fresh.close()
