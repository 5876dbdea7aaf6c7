"""Operators' tools against the real broker: lag per group, local scaling with a supervisor that
restarts a crashed processor, the partition ceiling, and growing co-partitioned topics."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from aiokafka.structs import OffsetAndMetadata, TopicPartition

from producers import publish, start_consumer, start_producer
from schemas import ChatMessage, InferenceRequest
from tests.kafka_support import group_settled, wait_for
from tokenstream.stack.scale import (
    ScaleError,
    Supervisor,
    Wanted,
    _changed,
    check_ceiling,
    instances,
    parse_targets,
)
from tokenstream.stack.service import free_port
from topics import inference_topic, processor_group, worker_group
from topics.admin import apply, partition_counts
from topics.registry import all_topics, co_partitioned


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tokenstream.cli", *args],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "COLUMNS": "220", **(env or {})},
        check=False,
    )


def folders(root: Path) -> tuple[Path, Path, Path, Path]:
    return root / "data", root / "run", root / "logs", root / "cache"


def test_targets_parse_and_the_partition_ceiling_is_refused_clearly():
    assert parse_targets(["worker=2", "safety=3", "worker:other=1"], "smollm2") == {
        "worker": 2,
        "safety": 3,
        "worker:other": 1,
    }
    with pytest.raises(ScaleError, match="ROLE=N"):
        parse_targets(["painter=2"], "smollm2")
    with pytest.raises(ScaleError, match="ts.inference.smollm2 has 12 partitions, so at most 12 worker"):
        check_ceiling({"worker": 13}, {"ts.inference.smollm2": 12}.get, "smollm2")
    check_ceiling({"worker": 12}, {"ts.inference.smollm2": 12}.get, "smollm2")


def test_instances_get_their_own_names_ports_and_gateway_partitions(tmp_path):
    wanted = Wanted(tmp_path / "scale.json", {"worker": 2, "gateway": 2, "router": 0})
    roles = {r.name: r for r in instances(folders(tmp_path), ["smollm2"], 8000, 9400, wanted)}
    assert set(roles) == {
        "conversation",
        "safety",
        "tools",
        "notary",
        "worker",
        "worker-2",
        "gateway",
        "gateway-2",
    }
    assert roles["notary"].args == ["audit", "notarize", "--follow"]
    assert roles["tools"].args == ["tools", "--health-port", "9450"]
    assert roles["tools"].probe_url == "http://127.0.0.1:9450/health/ready"
    assert roles["worker"].probe_url == "http://127.0.0.1:9400/health/ready"
    share = str(max(1, (os.cpu_count() or 1) // 2))  # two workers on this host: each half the cores
    shared = [
        "--threads",
        share,
        "--no-spin-wait",
    ]  # and threads that sleep, not spin, beside the other roles
    assert roles["worker"].args == ["worker", "--model", "smollm2", "--metrics-port", "9400", *shared]
    assert roles["worker-2"].args == ["worker", "--model", "smollm2", "--metrics-port", "9401", *shared]
    one = {
        r.name: r
        for r in instances(folders(tmp_path), ["smollm2"], 8000, 9400, Wanted(tmp_path / "s.json", {}))
    }
    assert (
        "--threads" not in one["worker"].args and "--no-spin-wait" in one["worker"].args
    )  # alone: every core
    # scaling down does not restart a survivor for its thread share (its streams would be cut); an
    # argument that matters does restart it
    assert not _changed(roles["worker"].args, one["worker"].args) and not _changed(None, one["worker"].args)
    assert _changed(roles["worker"].args, [*roles["worker"].args[:-4], "9499", *shared])
    regional = instances(
        folders(tmp_path), ["smollm2"], 8000, 9400, Wanted(tmp_path / "s.json", {}), systems=2
    )
    assert (
        regional[[r.name for r in regional].index("worker")].args[-3:] == shared
    )  # two regions share the host
    assert roles["gateway-2"].args == [
        "gateway",
        "--port",
        "8001",
        "--instance-index",
        "1",
        "--instance-count",
        "2",
    ]


async def test_ops_lag_shows_a_groups_lag_per_partition(bootstrap):
    model = f"lag-{uuid.uuid4().hex[:6]}"
    spec, group = inference_topic(model), worker_group(model)
    await apply([spec], bootstrap)
    tps = [TopicPartition(spec.name, p) for p in range(spec.partitions)]
    consumer = await start_consumer(group=group, bootstrap=bootstrap)
    consumer.assign(tps)
    await consumer.commit({tp: OffsetAndMetadata(0, "") for tp in tps})
    producer = await start_producer(bootstrap)
    try:
        for i in range(7):
            await publish(
                producer,
                spec,
                InferenceRequest(
                    request_id=f"r{i}", model=model, messages=[ChatMessage(role="user", content="x")]
                ),
                partition=2,
            )
    finally:
        await producer.stop()
        await consumer.stop()
    out = await asyncio.to_thread(cli, "ops", "lag", "--model", model, "--group", group, "--interval", "0.5")
    assert out.returncode == 0, out.stderr
    rows = [
        [cell.strip() for cell in line.split("│")[1:-1]]
        for line in out.stdout.splitlines()
        if line.startswith("│") and spec.name in line
    ]
    # the partitions table: group, topic, partition, committed, end, lag, owner, drain/s, est. wait
    assert [group, spec.name, "2", "0", "7", "7", "-", "0.0", "stalled"] in rows, out.stdout
    assert len([r for r in rows if len(r) == 9]) == 1  # only the partition with lag is listed


def test_supervisor_scales_a_processor_restarts_it_after_a_crash_and_scales_down(stack, tmp_path):
    asyncio.run(apply(all_topics(["smollm2"]), stack.kafka.address))
    run_dir = tmp_path / "run"
    wanted = Wanted.load(run_dir)
    wanted.counts = {
        "conversation": 0,
        "safety": 0,
        "tools": 0,
        "notary": 0,
        "worker": 0,
        "gateway": 0,
        "router": 2,
    }
    wanted.save()
    said: list[str] = []
    sup = Supervisor(
        run_dir,
        lambda: instances(folders(tmp_path), ["smollm2"], 18000, 19400, Wanted.load(run_dir)),
        said.append,
    )
    try:
        assert sorted(sup.reconcile(wait=True)) == ["started router", "started router-2"]
        roles = {r.name: r for r in sup.make()}
        old = roles["router-2"].pid()
        asyncio.run(group_settled(stack.kafka.address, processor_group("router"), 2))
        os.killpg(old, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while roles["router-2"].pid() in (None, old) and time.monotonic() < deadline:
            sup.reconcile(wait=False)
            time.sleep(0.2)
        assert roles["router-2"].pid() not in (None, old), said
        assert any("router-2: exited; restart in 1s (restart 1)" in s for s in said)
        # its member was taken out of the group when it was seen dead, not when its session ended
        assert f"router-2: taken out of {processor_group('router')}" in said
        wanted = Wanted.load(run_dir)
        wanted.counts["router"] = 1
        wanted.save()
        assert sup.reconcile(wait=True) == ["stopped router-2"]
        assert roles["router"].pid() is not None and roles["router-2"].pid() is None
    finally:
        for role in sup.make():
            role.stop(lambda _m: None)
        for name in ("router-2",):
            pid_file = run_dir / f"{name}.pid"
            if pid_file.exists():
                os.killpg(int(pid_file.read_text()), signal.SIGKILL)


async def test_topics_grow_grows_co_partitioned_topics_together_and_guards_keyed_state(bootstrap):
    assert co_partitioned("ts.chat.requests") == (
        "ts.chat.requests",
        "ts.conversation.turns",
        "ts-conversation-history-changelog",
    )
    assert co_partitioned("ts.tokens") == ("ts.tokens", "ts-safety-windows-changelog")
    await apply(all_topics(["smollm2"]), bootstrap)
    refused = await asyncio.to_thread(cli, "topics", "grow", "ts.chat.requests", "--partitions", "16")
    assert refused.returncode == 2 and "refused" in refused.stdout
    assert (await partition_counts(bootstrap))["ts.chat.requests"] == 12
    spec = inference_topic(f"grow-{uuid.uuid4().hex[:6]}")
    await apply([spec], bootstrap)
    grown = await asyncio.to_thread(cli, "topics", "grow", spec.name, "--partitions", "14")
    assert grown.returncode == 0, grown.stdout + grown.stderr
    assert (await partition_counts(bootstrap))[spec.name] == 14
    shrink = await asyncio.to_thread(cli, "topics", "grow", spec.name, "--partitions", "13")
    assert shrink.returncode == 2 and "cannot shrink" in shrink.stdout


async def test_ops_probe_says_whether_this_hosts_member_holds_partitions(bootstrap):
    model = f"probe-{uuid.uuid4().hex[:6]}"
    spec, group = inference_topic(model), worker_group(model)
    await apply([spec], bootstrap)
    absent = await asyncio.to_thread(cli, "ops", "probe", "--group", group, "--host", "127.0.0.1")
    assert absent.returncode == 1, absent.stdout  # no members (or, on a fresh broker, no coordinator yet)
    consumer = await start_consumer(spec, group=group, bootstrap=bootstrap)
    try:
        await wait_for(consumer.assignment, 60, "the consumer's partitions")
        ready = await asyncio.to_thread(cli, "ops", "probe", "--group", group, "--host", "127.0.0.1")
        assert ready.returncode == 0, ready.stdout + ready.stderr
        assert "holds 12 partition(s)" in ready.stdout
        elsewhere = await asyncio.to_thread(cli, "ops", "probe", "--group", group, "--host", "10.9.9.9")
        assert elsewhere.returncode == 1 and "no member" in elsewhere.stdout
        no_redis = await asyncio.to_thread(
            cli,
            "ops",
            "probe",
            "--group",
            group,
            "--host",
            "127.0.0.1",
            env={"TOKENSTREAM_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"},
        )
        assert no_redis.returncode == 1 and "Redis does not answer" in no_redis.stdout, no_redis.stdout
    finally:
        await consumer.stop()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """The tiny random Llama (gpu_workers.random_model): real model code, fast on a CPU."""
    from gpu_workers.random_model import build

    return build(tmp_path_factory.mktemp("tiny-ops-model"))


@pytest.mark.heavy  # a kill -9 / scale drill: make test-all, beside the chaos drill (test_chaos.py)
async def test_scaling_the_worker_group_up_and_down_keeps_every_stream_intact(
    stack, bootstrap, tmp_path, monkeypatch, tiny_model
):
    """ops scale worker=2, then worker=1 while both stream: the stopped worker hands its requests over
    and every answer ends gap-free and duplicate-free (the tiny random Llama keeps it fast)."""
    import socket

    from gpu_workers.startup import needed_topics
    from tests.test_worker_kafka import TokenReader, assert_gap_free, request

    model = f"tiny-scale-{uuid.uuid4().hex[:6]}"
    await apply(needed_topics(model), bootstrap)  # every topic a worker checks for at start
    monkeypatch.setenv("TOKENSTREAM_WORKER_MODEL_PATH", str(tiny_model))
    monkeypatch.setenv("TOKENSTREAM_WORKER_STEP_DELAY_S", "0.05")
    run_dir = tmp_path / "run"
    wanted = Wanted(
        run_dir / "scale.json",
        {"conversation": 0, "safety": 0, "router": 0, "tools": 0, "notary": 0, "gateway": 0, "worker": 2},
    )
    wanted.save()
    port = free_port_pair()
    sup = Supervisor(
        run_dir,
        lambda: instances(folders(tmp_path), [model], 18500, port, Wanted.load(run_dir)),
        lambda _m: None,
    )
    producer = await start_producer(bootstrap)
    try:
        assert sorted(await asyncio.to_thread(sup.reconcile, True)) == ["started worker", "started worker-2"]
        roles = {r.name: r for r in sup.make()}
        second = f"{socket.gethostname()}-{roles['worker-2'].pid()}"
        await group_settled(bootstrap, worker_group(model), members=2)
        async with TokenReader(bootstrap) as reader:
            reqs = [request(model, f"question {i}", 200) for i in range(8)]
            for r in reqs:
                await publish(producer, inference_topic(model), r)
            rids = [r.request_id for r in reqs]
            await reader.until(lambda rd: all(len(rd.chunks(x)) >= 5 for x in rids), timeout=120)
            on_second = [x for x in rids if reader.chunks(x)[-1].worker_id == second]
            assert on_second, "the second worker serves none of the requests"
            wanted = Wanted.load(run_dir)
            wanted.counts["worker"] = 1
            wanted.save()
            assert await asyncio.to_thread(sup.reconcile, True) == ["stopped worker-2"]
            await reader.until(lambda rd: rd.all_complete(rids), timeout=180)
        for x in rids:
            assert_gap_free(reader, x)  # one chunk per seq, no duplicate, exactly one completion
        for x in on_second:  # begun by the second worker, finished by the first
            assert reader.completion(x).worker_id != second
    finally:
        await producer.stop()
        for role in sup.make():
            role.stop(lambda _m: None)
        extra = run_dir / "worker-2.pid"
        if extra.exists():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.killpg(int(extra.read_text()), signal.SIGKILL)


def free_port_pair() -> int:
    """A port p with p + 1 free too (the workers' metrics ports)."""
    from tokenstream.stack.service import free_port, port_open

    while True:
        p = free_port()
        if not port_open(p + 1):
            return p
