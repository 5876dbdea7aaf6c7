"""A supervisor that saw its process die takes the process's place in its consumer groups at once
(producers/membership.py, `evict`): the survivor holds every partition long before the dead member's
session would have ended, and no live member is touched."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from common import kafka_auth
from producers.membership import describe, evict, member_client_id, of_process
from tests.kafka_support import wait_for
from topics import processor_group
from topics.admin import apply
from topics.registry import all_topics

SESSION_MS = 30_000  # far longer than the test waits: only the eviction can end the dead member's hold

MEMBER = """
import asyncio, sys
from aiokafka import AIOKafkaConsumer
from common import kafka_auth
from producers.membership import member_client_id

async def main(bootstrap, topic, group):
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=group,
                                client_id=member_client_id("probe"), session_timeout_ms=30000,
                                heartbeat_interval_ms=500, **kafka_auth.client_options())
    await consumer.start()
    while True:
        await consumer.getmany(timeout_ms=200)

asyncio.run(main(*sys.argv[1:]))
"""


async def _poll(consumer: AIOKafkaConsumer) -> None:
    while True:
        await consumer.getmany(timeout_ms=200)


async def test_a_dead_processs_partitions_reach_the_survivor_before_its_session_ends(bootstrap, unique):
    topic, group = f"evict-{unique}", f"evict-{unique}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **kafka_auth.client_options())
    await admin.start()
    await admin.create_topics([NewTopic(topic, 4, 1)])
    mine = member_client_id("probe")
    survivor = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=group,
        client_id=mine,
        session_timeout_ms=SESSION_MS,
        heartbeat_interval_ms=500,
        **kafka_auth.client_options(),
    )
    await survivor.start()
    polling = asyncio.create_task(_poll(survivor))
    child = await asyncio.create_subprocess_exec(sys.executable, "-c", MEMBER, bootstrap, topic, group)
    try:

        async def two_members_split() -> bool:
            state = await describe(admin, group)
            return state.state == "Stable" and state.members == 2 and len(survivor.assignment()) == 2

        await wait_for(two_members_split, 120, "the dead-to-be member and the survivor share the topic")

        child.kill()
        await child.wait()
        killed = time.monotonic()
        assert await evict(bootstrap, child.pid) == [group]
        await wait_for(
            lambda: len(survivor.assignment()) == 4,
            SESSION_MS / 1000 / 2,
            "the survivor holds every partition",
        )
        assert time.monotonic() - killed < SESSION_MS / 1000 / 2
        state = await describe(admin, group)
        assert (state.members, set(state.clients)) == (1, {mine})  # the survivor stays a member

        assert await evict(bootstrap, child.pid) == []  # nothing left of it to take
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
        polling.cancel()
        await asyncio.gather(polling, return_exceptions=True)
        await survivor.stop()
        await admin.close()


def _child_of(pid: int) -> int | None:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return int(children[0]) if children else None


async def test_the_guard_takes_its_dead_role_out_of_its_group_and_exits_with_its_status(bootstrap):
    """`tokenstream guard` (the Kubernetes containers' first process) does what the local supervisors
    do: the role's member leaves its group when the role dies, not when its (here 30 s) session ends."""
    await apply(all_topics(["smollm2"]), bootstrap)
    group = processor_group("router")
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **kafka_auth.client_options())
    await admin.start()
    guard = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tokenstream.cli",
        "guard",
        "processor",
        "router",
        env={**os.environ, "TOKENSTREAM_KAFKA_SESSION_TIMEOUT_S": str(SESSION_MS // 1000)},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        role = await wait_for(lambda: _child_of(guard.pid), 30, "the guard's role process")

        async def members_of_role() -> list[str]:
            return [c for c in (await describe(admin, group)).clients if of_process(c, role)]

        await wait_for(members_of_role, 120, "the role's member in its group")

        os.kill(role, signal.SIGKILL)
        killed = time.monotonic()
        await wait_for(lambda: guard.returncode is not None, SESSION_MS / 1000 / 2, "the guard's exit")
        assert not await members_of_role()
        assert time.monotonic() - killed < SESSION_MS / 1000 / 2
        assert guard.returncode == 128 + signal.SIGKILL
        assert f"taken out of {group}" in (await guard.stdout.read()).decode()
    finally:
        if guard.returncode is None:
            guard.kill()
            await guard.wait()
        await admin.close()
