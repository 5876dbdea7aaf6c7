"""The map: every topic names its writers and readers, the flow covers the registry, and the
contracts the roles share (request ids, headers, Redis keys) live in `schemas/`."""

from __future__ import annotations

import os
import subprocess
import sys

from schemas import headers, keys
from schemas.ids import event_id, new_request_id, parse_request_id
from topics.registry import REGISTRY, Role, all_topics, flow, inference_topic, worker_group

MODELS = ["smollm2", "other-model"]


def test_every_topic_names_who_writes_and_who_reads_it():
    """Roles are data (tests/test_topic_map_code.py holds them against the code); the words beside them
    say when a role writes and how it commits."""
    for spec in all_topics(MODELS):
        assert spec.writers, f"{spec.name} has no writer"
        assert spec.readers, f"{spec.name} has no reader"
        for writer in spec.writers:
            assert isinstance(writer.role, Role) and writer.when, f"{spec.name}: {writer}"
        for reader in spec.readers:
            assert isinstance(reader.role, Role), f"{spec.name}: {reader}"
            assert reader.commit, f"{spec.name}: {reader.role} has no commit rule"
        assert spec.placement in ("key", "reply_partition")


def test_the_groups_are_the_ones_the_roles_join():
    owners: dict[str, set[Role]] = {}
    for spec in all_topics(MODELS):
        for reader in spec.readers:
            if reader.group:
                owners.setdefault(reader.group, set()).add(reader.role)
    assert all(len(roles) == 1 for roles in owners.values()), f"a group shared by roles: {owners}"
    assert inference_topic("smollm2").groups == [worker_group("smollm2")] == ["worker.smollm2"]
    groups = {g for spec in REGISTRY for g in spec.groups}
    assert {"ts-conversation", "ts-safety", "ts-router", "ts-tools", "ts-ingest"} <= groups


def test_the_flow_lists_every_topic_once_in_request_order():
    names = [s.name for s in flow(MODELS)]
    assert sorted(names) == sorted(s.name for s in all_topics(MODELS))
    assert (
        names.index("ts.chat.requests")
        < names.index("ts.requests.prepared")
        < names.index("ts.requests.screened")
        < names.index("ts.inference.smollm2")
        < names.index("ts.tokens")
    )


def test_contracts_keep_their_wire_formats():
    rid = new_request_id(7, 1700000000.123)
    assert parse_request_id(rid) == (7, 1700000000123)
    assert event_id(rid, 3) == f"{rid}:3"
    assert headers.EVENT_TYPE == "event-type" and headers.TRACEPARENT == "traceparent"
    assert keys.gateway_request("r1") == "ts:gateway:req:r1"
    assert keys.gateway_attachment("r1") == "ts:gateway:attach:r1"
    assert keys.effect_done("safety", "input", "r1") == "ts:done:safety:input:r1"
    assert keys.store_file("vs_1", "file-1") == "ts:vs:file:vs_1:file-1"
    assert keys.file_data("file-1") == "ts:file:data:file-1"


def test_roles_use_the_contracts_from_schemas():
    import gateway.resume
    import processors.effects

    assert gateway.resume.parse_request_id is parse_request_id
    assert processors.effects.Ledger("x", "redis://127.0.0.1:1/0")._key("e", "r") == "ts:done:x:e:r"


def test_topics_describe_flow_prints_the_map_without_a_broker():
    out = subprocess.run(
        [sys.executable, "-m", "tokenstream.cli", "topics", "describe", "--flow", "--model", "smollm2"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "250", "TOKENSTREAM_KAFKA_BOOTSTRAP": "127.0.0.1:1"},
        check=False,
    )
    assert out.returncode == 0, out.stderr
    for spec in flow(["smollm2"]):
        assert spec.name in out.stdout
    assert "worker.smollm2" in out.stdout and "group-less" in out.stdout
    for role in Role:
        assert role.title in out.stdout
