"""Who may write what: the broker's SASL users and ACLs are the registry's writers and readers.

On the test stack (SASL/SCRAM and the StandardAuthorizer, as `make run`'s), each role's credentials
may write the topics the registry names it a writer of and nothing else; a client without
credentials, or with a wrong password, is not let in; and the one topic where a tenant enters the
log (ts.chat.requests, a ChatRequest's tenant) takes records from the gateway's user alone.
"""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.errors import KafkaConnectionError, KafkaError, TopicAuthorizationFailedError

from common import kafka_auth
from schemas import ChatMessage, ChatRequest, encode
from topics import CHAT_REQUESTS, REGISTRY, TOOL_RESULTS, inference_topic
from topics.access import USERS, Grant, by_user, grants
from topics.access_admin import broker_grants
from topics.admin import apply
from topics.registry import Role

MODEL = "access-model"
SPECS = [*REGISTRY, inference_topic(MODEL)]


def test_only_the_gateway_may_write_requests_and_only_the_tool_processor_tool_results():
    writers = {g.user for g in grants(SPECS) if g.operation == "write" and g.name == CHAT_REQUESTS.name}
    assert writers == {"gateway"}
    writers = {g.user for g in grants(SPECS) if g.operation == "write" and g.name == TOOL_RESULTS.name}
    assert writers == {"tools"}


def test_every_grant_comes_from_the_registry_or_is_listed_with_its_reason():
    named = {s.name for s in SPECS}
    for grant in grants(SPECS):
        if grant.resource == "topic" and grant.pattern == "literal":
            assert grant.name in named, grant
    # A role's user may write a topic only if the registry names the role among its writers.
    for spec in SPECS:
        allowed = {w.role.value for w in spec.writers}
        assert {g.user for g in grants(SPECS) if g.name == spec.name and g.operation == "write"} == allowed
    assert set(by_user(SPECS)) == {r.value for r in Role} | {"autoscaler"}
    assert {(g.operation, g.resource) for g in by_user(SPECS)["autoscaler"]} == {
        ("describe", "topic"),
        ("describe", "group"),
    }


async def _produce(bootstrap: str, user: str, password: str, topic: str) -> str:
    """'ok', or the name of the error that refused the write."""
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        security_protocol="SASL_PLAINTEXT",
        sasl_mechanism=kafka_auth.MECHANISM,
        sasl_plain_username=user,
        sasl_plain_password=password,
        acks="all",
        enable_idempotence=True,
        request_timeout_ms=10_000,
        metadata_max_age_ms=1000,
    )
    try:
        await producer.start()
        request = ChatRequest(
            request_id=f"forged-{user}",
            tenant="victim",
            conversation_id="c1",
            model=MODEL,
            messages=[ChatMessage(role="user", content="forged")],
        )
        await asyncio.wait_for(producer.send_and_wait(topic, encode(request), key=b"victim:c1"), 15)
        return "ok"
    except (KafkaError, TimeoutError) as exc:
        return type(exc).__name__
    finally:
        await producer.stop()


async def _written_ids(bootstrap: str, spec) -> set[str]:
    """The request ids of every record on `spec`'s topic, read as admin up to its end offsets."""
    from aiokafka.structs import TopicPartition

    from schemas import decode

    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False, **kafka_auth.client_options()
    )
    await consumer.start()
    try:
        tps = [TopicPartition(spec.name, p) for p in range(spec.partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        ids: set[str] = set()

        async def behind() -> bool:
            return any([await consumer.position(tp) < ends[tp] for tp in tps])

        while await behind():
            for records in (await consumer.getmany(timeout_ms=1000)).values():
                ids |= {decode(r.value, *spec.events).request_id for r in records}
        return ids
    finally:
        await consumer.stop()


@pytest.mark.asyncio
async def test_a_roles_credentials_write_what_the_registry_says_and_nothing_else(stack, bootstrap):
    await apply(SPECS, bootstrap)
    on_broker = await broker_grants(bootstrap)
    assert set(grants(SPECS)) <= on_broker
    passwords = {user: kafka_auth.password(user) for user in USERS}
    # Where a tenant enters the log: every role but the gateway is refused, and the gateway's record,
    # written last, is the only one the topic holds.
    others = [r.value for r in Role if r is not Role.GATEWAY]
    for user in others:
        assert (
            await _produce(bootstrap, user, passwords[user], CHAT_REQUESTS.name)
            == "TopicAuthorizationFailedError"
        ), user
    assert await _produce(bootstrap, "gateway", passwords["gateway"], CHAT_REQUESTS.name) == "ok"
    forged = {i for i in await _written_ids(bootstrap, CHAT_REQUESTS) if i.startswith("forged-")}
    assert forged == {"forged-gateway"}  # (other tests of the session write their own requests there)
    # And a topic each role does own takes its records.
    assert await _produce(bootstrap, "tools", passwords["tools"], TOOL_RESULTS.name) == "ok"
    assert (
        await _produce(bootstrap, "worker", passwords["worker"], TOOL_RESULTS.name)
        == "TopicAuthorizationFailedError"
    )


@pytest.mark.asyncio
async def test_a_role_cannot_read_or_join_what_it_does_not_own(stack, bootstrap):
    await apply(SPECS, bootstrap)
    worker = dict(
        security_protocol="SASL_PLAINTEXT",
        sasl_mechanism=kafka_auth.MECHANISM,
        sasl_plain_username="worker",
        sasl_plain_password=kafka_auth.password("worker"),
    )
    # ts.chat.requests holds every tenant's messages: the worker has no business reading it.
    consumer = AIOKafkaConsumer(
        CHAT_REQUESTS.name, bootstrap_servers=bootstrap, group_id=None, auto_offset_reset="earliest", **worker
    )
    try:
        with pytest.raises(TopicAuthorizationFailedError):
            await asyncio.wait_for(consumer.start(), 20)
            await asyncio.wait_for(consumer.getmany(timeout_ms=5000), 20)
    finally:
        await consumer.stop()
    # Nor may it join the conversation processor's group (and take its partitions).
    consumer = AIOKafkaConsumer(
        inference_topic(MODEL).name, bootstrap_servers=bootstrap, group_id="ts-conversation", **worker
    )
    try:
        with pytest.raises(KafkaError) as refused:
            await asyncio.wait_for(consumer.start(), 20)
            await asyncio.wait_for(consumer.getmany(timeout_ms=5000), 20)
        assert "GroupAuthorizationFailed" in type(refused.value).__name__, refused.value
    finally:
        await consumer.stop()


@pytest.mark.asyncio
async def test_no_credentials_or_a_wrong_password_are_not_let_in(stack, bootstrap):
    assert (
        await _produce(bootstrap, "gateway", "not-its-password", CHAT_REQUESTS.name) == "KafkaConnectionError"
    )
    anonymous = AIOKafkaProducer(bootstrap_servers=bootstrap, request_timeout_ms=5000)
    with pytest.raises(KafkaConnectionError):
        await asyncio.wait_for(anonymous.start(), 30)
    await anonymous.stop()


def test_grants_print_as_acls():
    assert (
        str(Grant("audit", "group", "ts-audit-rescreen.", "read", "prefixed"))
        == "User:audit read group ts-audit-rescreen.*"
    )


@pytest.mark.asyncio
async def test_topics_describe_access_shows_each_users_grants_held(stack, bootstrap):
    import os
    import subprocess
    import sys

    await apply(SPECS, bootstrap)
    out = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "tokenstream.cli", "topics", "describe", "--access", "--model", MODEL],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **stack.environment(), "COLUMNS": "200"},
    )
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if "ts.chat.requests" in line]
    assert any("gateway" in r and "write" in r and "yes" in r for r in rows), out.stdout
    assert "missing" not in out.stdout
