"""A consumer's standing in its group, as the broker sees it: the signal of a role's readiness; and
the way a supervisor takes a dead process's place in its groups (`evict`).

`describe(admin, group)` reads one group (members, their hosts and client ids, who holds which
partition). `GroupWatch` asks that every `interval_s` for one consumer (found by its client id, which
`member_client_id` makes unique per process) and keeps the answer, so a health endpoint can say,
without a network call of its own:

- whether the broker answered lately (`broker_age_s`),
- whether this consumer is a member of its group and how many partitions it holds, and whether it
  should hold one (the group is stable and has no more members than the topic has partitions).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment
from aiokafka.errors import KafkaError
from aiokafka.protocol.group import LeaveGroupRequest
from aiokafka.structs import TopicPartition

from common import kafka_auth

log = logging.getLogger(__name__)


@dataclass
class GroupState:
    group: str
    state: str
    members: int
    owners: dict[TopicPartition, str]
    hosts: dict[str, int]  # member host (as the broker sees it) -> partitions it holds
    clients: dict[str, int] = field(default_factory=dict)  # member client id -> partitions it holds


def states(responses) -> dict[str, GroupState]:
    """GroupStates from DescribeGroups responses."""
    out = {}
    for response in responses:
        for g in response.to_object()["groups"]:
            owners: dict[TopicPartition, str] = {}
            hosts: dict[str, int] = {}
            clients: dict[str, int] = {}
            for m in g["members"]:
                host = m["client_host"].lstrip("/")
                hosts.setdefault(host, 0)
                clients.setdefault(m["client_id"], 0)
                raw = m.get("member_assignment") or b""
                if not raw:
                    continue
                try:
                    assignment = ConsumerProtocolMemberAssignment.decode(raw)
                except Exception as exc:  # noqa: BLE001 - a non-consumer protocol: no partitions to show
                    log.debug("member %s: assignment not a consumer's (%s)", m["client_id"], exc)
                    continue
                for topic, partitions in assignment.assignment:
                    hosts[host] += len(partitions)
                    clients[m["client_id"]] += len(partitions)
                    for p in partitions:
                        owners[TopicPartition(topic, p)] = m["client_id"]
            out[g["group"]] = GroupState(g["group"], g["state"], len(g["members"]), owners, hosts, clients)
    return out


async def describe(admin: AIOKafkaAdminClient, group: str) -> GroupState:
    """One group as the broker sees it now (raises when the broker does not answer)."""
    found = states(await admin.describe_consumer_groups([group]))
    return found.get(group) or GroupState(group, "Dead", 0, {}, {})


def member_client_id(role: str, pid: int | None = None, host: str | None = None) -> str:
    """A client id no other process shares (`role.pid@host`), so the group's description names this
    consumer, and the supervisor of a process that died finds its members (`evict`)."""
    return f"{role}.{pid or os.getpid()}@{host or socket.gethostname()}"


def of_process(client_id: str, pid: int, host: str | None = None) -> bool:
    """Whether `client_id` (made by `member_client_id`) names a client of process `pid` on `host`."""
    return client_id.endswith(f".{pid}@{host or socket.gethostname()}")


async def evict(bootstrap: str, pid: int, host: str | None = None, timeout_s: float = 5.0) -> list[str]:
    """Take every group membership of process `pid` (on `host`), which its supervisor saw exit; returns
    the groups it was taken from.

    A process killed -9 leaves its groups only when its session times out (3 s): its partitions stand
    still until then, although a standby of the same role is running. Its supervisor knows at once
    (waitpid), so it sends the LeaveGroup the process could not: the coordinator hands the partitions
    to the survivors at their next heartbeat. The session stays the backstop for what no supervisor
    sees (a host lost, a process frozen). Only the dead process's own members are named (the client
    ids of `member_client_id`), each group asked of the node that coordinates it, every node at once.
    """
    admin = AIOKafkaAdminClient(
        bootstrap_servers=bootstrap, **kafka_auth.client_options(), request_timeout_ms=int(timeout_s * 1000)
    )
    try:
        async with asyncio.timeout(timeout_s):
            await admin.start()
            nodes = [b["node_id"] for b in (await admin.describe_cluster())["brokers"]]
            found = await asyncio.gather(*(_evict_on(admin, node, pid, host) for node in nodes))
    finally:
        await admin.close()
    return sorted(g for groups in found for g in groups)


async def evict_and_say(bootstrap: str, pid: int, name: str, say: Callable[[str], object]) -> None:
    """`evict`, for a supervisor: says which groups `name` (the dead process) was taken out of, or why
    it could not be (the broker may be the fault too: its session then ends the membership)."""
    try:
        groups = await evict(bootstrap, pid)
    except Exception as exc:  # noqa: BLE001 - whatever failed, the session is the backstop
        say(f"{name}: could not be taken out of its groups ({type(exc).__name__}: {exc})")
        return
    if groups:
        say(f"{name}: taken out of {', '.join(groups)}")


async def _evict_on(admin: AIOKafkaAdminClient, node: int, pid: int, host: str | None) -> list[str]:
    """`evict` on the groups node `node` coordinates (ListGroups asks one node for exactly those)."""
    groups = [g for g, kind in await admin.list_consumer_groups(broker_ids=[node]) if kind == "consumer"]
    if not groups:
        return []
    # one group per request: aiokafka 0.14 reads DescribeGroups v3 answers with v2's layout, which
    # loses its place after the first group (each group's authorized operations are left unread)
    described = await asyncio.gather(
        *(admin.describe_consumer_groups([g], group_coordinator_id=node) for g in groups)
    )
    left = []
    for [response] in described:
        for g in response.to_object()["groups"]:
            for m in g["members"]:
                if not of_process(m["client_id"], pid, host):
                    continue
                # aiokafka has no public call for another member's LeaveGroup; its own consumer's
                # leave (group_coordinator.py) sends this request
                answer = await admin._send_request(LeaveGroupRequest(g["group"], m["member_id"]), node)
                if answer.error_code == 0:
                    left.append(g["group"])
                else:  # gone already (its session ended) or the group moved: nothing left to take
                    log.info(
                        "LeaveGroup of %s in %s: error %d", m["member_id"], g["group"], answer.error_code
                    )
    return left


@dataclass
class Standing:
    """The last answer about one consumer; `clock` times it."""

    group: str
    client_id: str
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    answered_at: float | None = None  # the broker's last answer
    error: str = ""
    member: bool = False
    partitions: int = 0  # held by this consumer
    members: int = 0
    state: str = ""
    topic_partitions: int = 0  # of the topic the group reads

    def broker_age_s(self) -> float | None:
        return None if self.answered_at is None else self.clock() - self.answered_at

    def should_hold(self) -> bool:
        """A stable group with no more members than partitions gives every member one."""
        return self.state == "Stable" and 0 < self.members <= self.topic_partitions

    def broker_ok(self, broker_stale_s: float) -> bool:
        """The broker answered the group check within `broker_stale_s`."""
        age = self.broker_age_s()
        return age is not None and age <= broker_stale_s

    def problems(self, broker_stale_s: float) -> list[str]:
        """Why this consumer cannot take work now (empty when it can)."""
        age = self.broker_age_s()
        if not self.broker_ok(broker_stale_s):
            since = "never" if age is None else f"for {age:.0f} s"
            return [f"broker: no answer {since}" + (f" ({self.error})" if self.error else "")]
        if not self.member:
            return [f"group {self.group}: this consumer is not a member (group {self.state or 'unknown'})"]
        if self.partitions == 0 and self.should_hold():
            return [
                (
                    f"group {self.group}: this consumer holds no partition although the group is stable "
                    f"with {self.members} member(s) for {self.topic_partitions} partition(s)"
                )
            ]
        return []


class GroupWatch:
    """Describes `group` every `interval_s` and keeps `standing` of the consumer `client_id` up to date."""

    def __init__(
        self,
        bootstrap: str,
        group: str,
        client_id: str,
        topic_partitions: Callable[[], int],
        interval_s: float = 1.0,
        timeout_s: float = 3.0,
    ) -> None:
        self.bootstrap, self.interval_s, self.timeout_s = bootstrap, interval_s, timeout_s
        self.topic_partitions = topic_partitions
        self.standing = Standing(group, client_id)
        self._admin: AIOKafkaAdminClient | None = None

    async def _close(self) -> None:
        admin, self._admin = self._admin, None
        if admin is not None:
            with contextlib.suppress(Exception):  # closing a client of a broker that is gone
                async with asyncio.timeout(self.timeout_s):
                    await admin.close()

    async def check(self) -> Standing:
        s = self.standing
        try:
            async with asyncio.timeout(self.timeout_s):
                if self._admin is None:
                    self._admin = AIOKafkaAdminClient(
                        bootstrap_servers=self.bootstrap,
                        **kafka_auth.client_options(),
                        request_timeout_ms=int(self.timeout_s * 1000),
                    )
                    await self._admin.start()
                state = await describe(self._admin, s.group)
        except (KafkaError, OSError, TimeoutError) as exc:  # down or restarting: start afresh next time
            name, said = type(exc).__name__, str(exc)
            s.error = (said if said.startswith(name) else f"{name}: {said}" if said else name)[:200]
            await self._close()
            return s
        except Exception as exc:  # noqa: BLE001 - it answered, but aiokafka could not read the answer
            log.warning("could not read the description of group %s: %s", s.group, exc)
            s.answered_at, s.error, s.member = s.clock(), "", True  # no way to tell: not held against it
            return s
        s.answered_at, s.error = s.clock(), ""
        s.member = s.client_id in state.clients
        s.partitions = state.clients.get(s.client_id, 0)
        s.members, s.state = state.members, state.state
        s.topic_partitions = self.topic_partitions()
        return s

    async def run(self) -> None:
        try:
            while True:
                await self.check()
                await asyncio.sleep(self.interval_s)
        finally:
            await self._close()
