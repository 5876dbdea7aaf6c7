"""The map cannot drift: which role writes and reads each topic is derived from the code of each
role's package (tests/topic_map_ast.py) and must be what topics/registry.py says, both ways."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.topic_map_ast import ANY, MODEL, SHARED, Flow, compare, derive, registry_flows
from topics.registry import (
    CONTROL,
    CONVERSATIONS,
    DEAD_LETTER,
    REGISTRY,
    TOKENS,
    Reader,
    Role,
    TopicSpec,
    Writer,
    all_topics,
    inference_topic,
    worker_group,
)

#: Sites whose topic is known only at run time, and why they are not drawn in the map.
UNRESOLVED_IN_ROLES = {
    (
        "audit/notary.py",
        "TopicPartition(s.name, p)",
    ): "the notary's topics, audit.notary.ledgered(): the audited topics of the registry",
    ("audit/notary.py", "TopicPartition(topic, partition)"): "the partition a checkpoint it read attests",
    (
        "audit/proof.py",
        "TopicPartition(topic, partition)",
    ): "the partition a checkpoint attests, or its copy's",
    (
        "audit/usage.py",
        "TopicPartition(s.name, p)",
    ): "every partition of the transcripts and tokens topics (a tuple)",
    (
        "audit/run.py",
        "TopicPartition(n, p)",
    ): "the audited topics, which audit.sources.audited() takes from the registry (a registry-driven read)",
    (
        "gateway/key_homes.py",
        "TopicPartition(copy, p)",
    ): (
        "the other regions' copies of ts.key.homes (<region>.ts.key.homes, MirrorMaker 2's), read as the "
        "registry's reader of the mirrored topic reads it (TopicSpec.mirrored; topics/access.py grants them)"
    ),
    (
        "tokenstream/chaos/verify.py",
        "sampler.sample(group, topic)",
    ): "the drill waits out the lag of every group of the registry: offsets only, of whatever it is given",
    (
        "tokenstream/ops/autoscale.py",
        "self.sampler.sample(self.group, self.topic)",
    ): "`tokenstream ops autoscale`: the lag of the group and topic it is given, offsets only",
    (
        "tokenstream/ops/lag.py",
        "TopicPartition(spec.name, p)",
    ): "`tokenstream ops lag`: the end offsets of every topic of the registry",
    (
        "tokenstream/ops/lag.py",
        "TopicPartition(r.topic, r.partition)",
    ): "`tokenstream ops lag`: the owner of a partition it already listed",
}
UNRESOLVED_IN_SHARED = {
    (
        "producers/clients.py",
        "AIOKafkaConsumer(*(s.name for s in specs), **options)",
    ): "start_consumer's specs",
    ("producers/lag.py", "TopicPartition(topic, p)"): "LagSampler.sample's topic",
    (
        "producers/membership.py",
        "TopicPartition(topic, p)",
    ): "a group member's assignment, as the broker says it",
    (
        "producers/publish.py",
        "producer.send(spec.name, await unblocked(encode, event), ...",
    ): "publish's spec",
}
#: The shared functions whose writes the derivation attributes to their callers.
ON_CALLERS_BEHALF = {"typed", "dead_letter", "events"}


def _listing(flows: set[Flow], sites: dict[Flow, list[str]] | None = None) -> str:
    return "\n".join(
        f"  {f}" + (f"  at {', '.join(sites[f][:3])}" if sites and f in sites else "")
        for f in sorted(flows, key=str)
    )


def test_the_map_and_the_code_agree_both_ways():
    derived = derive()
    in_code, in_map = compare(set(derived.flows), registry_flows(all_topics([MODEL])))
    assert not in_code, "the code does what topics/registry.py does not say:\n" + _listing(
        in_code, derived.flows
    )
    assert not in_map, "topics/registry.py says what no code does:\n" + _listing(in_map)


def test_the_derivation_sees_every_role_and_every_topic():
    flows = set(derive().flows)
    assert {f.role for f in flows if f.kind == "writes"} == set(Role)
    assert {f.role for f in flows if f.kind == "reads"} == set(Role)
    touched = {f.topic for f in flows}
    assert {s.name for s in all_topics([MODEL])} <= touched
    # a few sites by the way they are written: a subscription after start, a faust agent, a table
    assert Flow("reads", inference_topic(MODEL).name, Role.WORKER, worker_group(MODEL)) in flows
    assert Flow("reads", TOKENS.name, Role.SAFETY, "ts-safety") in flows
    assert Flow("reads", ANY, Role.AUDIT) in flows


def test_every_site_the_derivation_cannot_resolve_is_known():
    found = {(path, source) for path, _, source in derive().unresolved}
    assert found == set(UNRESOLVED_IN_ROLES), (
        "a write or read whose topic or group the derivation cannot tell: make it name its registry "
        f"topic, or add it here with why: {sorted(found - set(UNRESOLVED_IN_ROLES))}; "
        f"gone: {sorted(set(UNRESOLVED_IN_ROLES) - found)}"
    )


def test_the_shared_libraries_write_only_on_their_callers_behalf():
    shared = derive(only=SHARED)
    assert set(shared.flows) == {Flow("writes", DEAD_LETTER.name, None)}
    for where in shared.flows[Flow("writes", DEAD_LETTER.name, None)]:
        assert where.rpartition(" in ")[2] in ON_CALLERS_BEHALF, where
    assert {(path, source) for path, _, source in shared.unresolved} == set(UNRESOLVED_IN_SHARED)


# ---- the derivation on small sources


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, source in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    return root


def test_a_new_dead_letter_writer_is_caught(tmp_path):
    root = _tree(
        tmp_path,
        {
            "newrole/__init__.py": "",
            "newrole/names.py": "from topics import DEAD_LETTER\nPOISON = DEAD_LETTER\n",
            "newrole/handler.py": """
            from producers import publish
            from newrole.names import POISON
            from topics import DEAD_LETTER, TOKENS


            async def handle(producer, event):
                await publish(producer, TOKENS, event)
                await publish(producer, DEAD_LETTER, event)


            class Handler:
                def __init__(self):
                    self.spec = POISON

                async def again(self, producer, event):
                    await producer.send(self.spec.name, b"")
            """,
        },
    )
    derived = derive(root, {Role.GATEWAY: ("newrole",)})
    assert derived.flows[Flow("writes", DEAD_LETTER.name, Role.GATEWAY)] == [
        "newrole/handler.py:9 in handle",
        "newrole/handler.py:17 in Handler.again",
    ]
    in_code, _ = compare(set(derived.flows), registry_flows(all_topics([MODEL])))
    # the gateway writes ts.tokens (answers from the cache), but the map names no dead letters of it
    assert in_code == {Flow("writes", DEAD_LETTER.name, Role.GATEWAY)}
    assert not derived.unresolved


def test_consumers_agents_and_tables_are_derived_with_their_groups(tmp_path):
    root = _tree(
        tmp_path,
        {
            "role/agent.py": """
        from processors.faust_app import make_app, table, topic, typed
        from producers import start_consumer
        from topics import CONTROL, CONVERSATIONS, DEAD_LETTER, TOKENS, inference_topic, worker_group

        app = make_app("probe")
        inbox = app.topic(TOKENS.name, CONTROL.name)
        history = table(app, CONVERSATIONS, "history")
        dead_letters = topic(app, DEAD_LETTER)


        @app.agent(inbox)
        async def agent(stream):
            async for event, raw in typed(stream, {}, dead_letters):
                pass


        async def serve(model):
            consumer = await start_consumer(group=worker_group(model))
            consumer.subscribe([inference_topic(model).name])
            follower = await start_consumer(CONTROL, group=None)
        """
        },
    )
    flows = set(derive(root, {Role.TOOLS: ("role",)}).flows)
    assert flows == {
        Flow("reads", TOKENS.name, Role.TOOLS, "ts-probe"),
        Flow("reads", CONTROL.name, Role.TOOLS, "ts-probe"),
        Flow("writes", CONVERSATIONS.name, Role.TOOLS),
        Flow("reads", CONVERSATIONS.name, Role.TOOLS, None),
        Flow("writes", DEAD_LETTER.name, Role.TOOLS),
        Flow("reads", inference_topic(MODEL).name, Role.TOOLS, worker_group(MODEL)),
        Flow("reads", CONTROL.name, Role.TOOLS, None),
    }


def test_a_reader_the_code_lost_is_caught_and_an_unknown_topic_is_reported(tmp_path):
    root = _tree(
        tmp_path,
        {
            "role/mod.py": """
        from producers import publish
        from topics import CONTROL


        async def cancel(producer, event, spec):
            await publish(producer, CONTROL, event)
            await publish(producer, spec, event)
        """
        },
    )
    derived = derive(root, {Role.SAFETY: ("role",)})
    mapped = TopicSpec(
        CONTROL.name,
        3,
        "request_id",
        CONTROL.events,
        "test",
        writers=(Writer(Role.SAFETY, "x"),),
        readers=(Reader(Role.WORKER, None, "nothing committed"),),
    )
    in_code, in_map = compare(set(derived.flows), registry_flows([mapped]))
    assert in_code == set() and in_map == {Flow("reads", CONTROL.name, Role.WORKER, None)}
    assert [(p, line, src) for p, line, src in derived.unresolved] == [
        ("role/mod.py", 8, "publish(producer, spec, event)")
    ]


def test_roles_are_data():
    with pytest.raises(TypeError):
        Writer("gateway", "a role spelt as text")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Reader("auditor (`tokenstream audit`)", None, "nothing committed")  # type: ignore[arg-type]
    assert all(isinstance(w.role, Role) for s in REGISTRY for w in s.writers)
