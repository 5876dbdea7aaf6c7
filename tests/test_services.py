"""The stack's services as tokenstream manages them (tokenstream.stack), and what the roles ask of them:
each reports itself running and ready, environment() points the roles' settings at it, and
common.vectordb says whether Weaviate is ready. `tokenstream stack up | status | down` as a user runs
it is tests/test_stack_cli.py; the Weaviate breaker's timing is tests/test_health_units.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import redis

from common import vectordb
from common.config import Settings, settings
from tokenstream.stack.redis import Redis
from tokenstream.stack.service import free_port, pid_alive


def test_each_service_of_the_session_stack_is_running_and_ready(stack):
    statuses = stack.status()
    assert [s.name for s in statuses] == [s.name for s in stack.services]
    assert len({s.name for s in statuses}) == len(statuses)
    for s in statuses:
        assert s.running and s.ready and s.pid and pid_alive(s.pid), s
        assert s.log.exists(), s


def test_environment_points_the_roles_settings_at_the_stack(stack, monkeypatch):
    for name, value in stack.environment().items():
        monkeypatch.setenv(name, value)
    cfg = Settings()
    assert cfg.kafka_bootstrap == stack.kafka.address
    assert cfg.redis_url == stack.redis.address
    assert (cfg.weaviate_http_port, cfg.weaviate_grpc_port) == (stack.weaviate.port, stack.weaviate.grpc_port)
    assert redis.Redis.from_url(cfg.redis_url, socket_timeout=5).ping()


async def test_vectordb_says_weaviate_is_ready(stack):
    assert os.environ["TOKENSTREAM_WEAVIATE_HTTP_PORT"] == str(stack.weaviate.port)  # (set by the fixture)
    assert vectordb.ready() and await vectordb.aready()


@pytest.fixture
def weaviate_elsewhere(stack, monkeypatch):
    """The roles' settings pointing at a port nobody listens on."""
    monkeypatch.setenv("TOKENSTREAM_WEAVIATE_HTTP_PORT", str(free_port()))
    settings.cache_clear()
    yield
    monkeypatch.undo()
    settings.cache_clear()


async def test_vectordb_says_not_ready_where_no_weaviate_answers(weaviate_elsewhere):
    assert not vectordb.ready(timeout_s=1) and not await vectordb.aready(timeout_s=1)


def test_a_service_started_twice_runs_once_and_stops_cleanly(tmp_path: Path):
    said: list[str] = []
    service = Redis(
        tmp_path / "data",
        tmp_path / "run",
        tmp_path / "logs",
        tmp_path / "cache",
        port=free_port(),
        persistent=False,
    )
    assert not service.status().running
    try:
        assert service.start(said.append) is True
        first = service.status()
        assert first.running and first.ready and pid_alive(first.pid), said
        assert redis.Redis.from_url(service.address, socket_timeout=5).ping()
        assert service.start(said.append) is False  # found running: left alone
        assert service.status().pid == first.pid and any("already running" in s for s in said)
    finally:
        stopped = service.stop(said.append)
    assert stopped and not pid_alive(first.pid)
    after = service.status()
    assert not after.running and not after.ready and after.pid is None
    assert service.stop(said.append) is False  # nothing left to stop
