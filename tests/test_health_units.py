"""Health rules, timeouts and back-offs, each on its own: the breaker's pauses, ingestion's retry policy
(held through an outage, given up on a file's own failure), a semantic-cache lookup and a file_search
call against a Weaviate that is not there or never answers (a real socket), the worker's readiness
rules, and the health server. No broker, no model; the whole-chain tests are in test_full_chain.py
and test_worker_health.py."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.error
import urllib.request
from types import SimpleNamespace
from typing import Self

import pytest

from common.health import HealthServer, Report
from common.vectordb import Breaker
from gateway.cache import Entry
from gateway.semantic import STORE_TIMEOUT_S, SemanticCache
from gpu_workers.config import WorkerConfig
from gpu_workers.health import WorkerHealth
from producers.membership import Standing
from tools.search.retry import IndexRetry, IndexUnavailable


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds

    slept: list[float]


def clock() -> Clock:
    c = Clock()
    c.slept = []
    return c


# ---------------------------------------------------------------- the breaker


def test_the_breaker_pauses_a_quarter_second_doubling_to_two_and_closes_on_success():
    c = clock()
    b = Breaker(clock=c)
    assert b.allow() and b.up
    pauses = [b.failed(OSError("refused")) for _ in range(6)]
    assert pauses == [0.25, 0.5, 1.0, 2.0, 2.0, 2.0]
    assert not b.allow() and not b.up and b.last_error == "OSError: refused"
    c.now += 1.99
    assert not b.allow()
    c.now += 0.02
    assert b.allow()
    b.succeeded()
    assert b.up and b.allow() and b.last_error == "" and b.down_since is None
    assert b.failed("again") == 0.25  # a new outage starts from the shortest pause


# ---------------------------------------------------------------- ingestion's retries


def retry(c: Clock, reachable: list[bool], attempts: int = 3, outage_s: float = 30.0) -> IndexRetry:
    answers = iter(reachable)

    async def is_reachable() -> bool:
        return next(answers)

    return IndexRetry(attempts, outage_s, is_reachable, permanent=(ValueError,), clock=c, sleep=c.sleep)


def failing(times: int, result: str = "indexed"):
    calls = []

    async def work() -> str:
        calls.append(1)
        if len(calls) <= times:
            raise ConnectionError(f"try {len(calls)}")
        return result

    return work, calls


async def test_an_outage_holds_the_work_and_it_is_done_within_two_seconds_of_weaviate_returning():
    c = clock()
    work, calls = failing(7)
    r = retry(c, [False] * 7)
    assert await r.run(work) == "indexed"
    assert len(calls) == 8
    assert c.slept == [0.25, 0.5, 1.0, 2.0, 2.0, 2.0, 2.0]  # never more than 2 s between tries
    assert r.outage_since is None


async def test_an_outage_longer_than_the_budget_raises_index_unavailable():
    c = clock()
    work, _calls = failing(10_000)
    r = retry(c, [False] * 10_000, outage_s=30.0)
    with pytest.raises(IndexUnavailable, match="budget 30 s"):
        await r.run(work)
    assert 30.0 <= sum(c.slept) <= 32.0


async def test_a_failure_while_weaviate_answers_is_tried_attempts_times_one_two_four_seconds_apart():
    c = clock()
    work, calls = failing(10)
    r = retry(c, [True] * 10, attempts=3)
    with pytest.raises(ConnectionError, match="try 3"):
        await r.run(work)
    assert len(calls) == 3 and c.slept == [1.0, 2.0]


async def test_a_failure_of_the_file_itself_is_raised_at_once():
    c = clock()

    async def work():
        raise ValueError("too large")

    with pytest.raises(ValueError):
        await retry(c, []).run(work)
    assert c.slept == []


async def test_the_outage_state_is_visible_while_the_event_is_held():
    c = clock()
    seen = []
    work, _ = failing(2)
    r = retry(c, [False, False])
    r.on_retry = lambda: seen.append(r.outage_since)
    await r.run(work)
    assert seen == [1000.0, 1000.0]


# ---------------------------------------------------------------- Weaviate away, for real sockets


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Silent:
    """A TCP server that accepts connections and never answers (a Weaviate that hangs)."""

    async def __aenter__(self) -> Self:
        self.held: list = []

        async def hold(reader, writer) -> None:
            self.held.append(writer)

        self.server = await asyncio.start_server(hold, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        for w in self.held:
            w.close()
        self.server.close()


def semantic_cache(http_port: int, grpc_port: int, timeout_s: float):
    from gateway.metrics import Metrics

    return SemanticCache("127.0.0.1", http_port, grpc_port, 0.9, 3600, 1000, Metrics(), timeout_s=timeout_s)


async def timed(coro) -> tuple[object, float]:
    started = time.monotonic()
    result = await coro
    return result, time.monotonic() - started


@pytest.mark.parametrize("away", ["refusing", "silent"])
async def test_a_semantic_lookup_without_weaviate_is_a_miss_within_its_timeout_then_at_once(away):
    import weaviate  # noqa: F401 - the first import is slow; not what is measured

    async with Silent() as silent:
        port = closed_port() if away == "refusing" else silent.port
        cache = semantic_cache(port, port, timeout_s=0.5)
        try:
            hit, took = await timed(cache.lookup("t", "m", "", [0.1] * 384))
            assert hit is None and took < 0.5 + 1.0, took
            assert not cache.breaker.up
            hit, again = await timed(cache.lookup("t", "m", "", [0.1] * 384))  # the breaker is open: no try
            assert hit is None and again < 0.05, again
            entry = Entry(
                chunks=["a"], finish_reason="stop", prompt_tokens=1, completion_tokens=1, request_id="r"
            )
            _, took = await timed(cache.store("t", "m", "", "q", [0.1] * 384, entry=entry))
            assert took < STORE_TIMEOUT_S + 1.0, took  # skipped, refused, or given up on: never a hang
            unavailable = cache.metrics.cache.labels("semantic", "unavailable")._value.get()
            assert unavailable == 2
        finally:
            await cache.close()


@pytest.mark.parametrize("away", ["refusing", "silent"])
async def test_file_search_without_weaviate_is_a_clear_tool_error_within_its_timeout(monkeypatch, away):
    from common.config import settings
    from schemas import ToolCall
    from tools.base import ToolUnavailable
    from tools.builtin.file_search import FileSearch
    from tools.config import tool_settings

    async with Silent() as silent:
        port = closed_port() if away == "refusing" else silent.port
        monkeypatch.setenv("TOKENSTREAM_WEAVIATE_HTTP_PORT", str(port))
        monkeypatch.setenv("TOKENSTREAM_WEAVIATE_GRPC_PORT", str(port))
        monkeypatch.setenv("TOKENSTREAM_TOOLS_INDEX_TIMEOUT_S", "1")
        settings.cache_clear()
        tool_settings.cache_clear()
        try:
            tool = FileSearch()
            call = ToolCall(
                request_id="r", call_id="c", tenant="t", conversation_id="", name="file_search", arguments=""
            )
            args = {"query": "ferry", "vector_store_ids": ["vs_1"]}
            started = time.monotonic()
            with pytest.raises(ToolUnavailable, match=r"Weaviate\) is unavailable") as caught:
                await tool.run(call, args)
            took = time.monotonic() - started
            assert took < 1 + 1 + 1 + 1.0, took  # its timeout, the margin around it, the readiness check
            assert caught.value.dependency == "weaviate"
            started = time.monotonic()
            with pytest.raises(ToolUnavailable):
                await tool.run(call, args)  # at once while the breaker is open
            assert time.monotonic() - started < 0.05
        finally:
            monkeypatch.undo()
            settings.cache_clear()
            tool_settings.cache_clear()


async def test_a_tool_unavailable_result_names_the_dependency():
    from schemas import ToolCall
    from tools.base import Outcome, ToolUnavailable
    from tools.processor import run_tool

    class Away:
        name = "file_search"

        async def run(self, call, args) -> Outcome:
            raise ToolUnavailable("the file index (Weaviate) is unavailable", "weaviate")

    call = ToolCall(
        request_id="r", call_id="c", tenant="t", conversation_id="", name="file_search", arguments="{}"
    )
    result = await run_tool(Away(), call, 5)
    assert not result.ok and result.meta == {"unavailable": "weaviate"} and "unavailable" in result.error


# ---------------------------------------------------------------- the worker's readiness rules


def worker_health(c: Clock, *, has_work: bool = False) -> tuple[WorkerHealth, Standing]:
    h = WorkerHealth(WorkerConfig(broker_stale_s=5.0, stuck_s=30.0), clock=c)
    h.engine = SimpleNamespace(has_work=has_work, running=[1, 2], queued=3)
    s = Standing(
        "worker.m",
        "worker-host-1",
        clock=c,
        answered_at=c.now,
        member=True,
        partitions=4,
        members=3,
        state="Stable",
        topic_partitions=12,
    )
    return h, s


def test_a_worker_is_not_ready_while_it_loads_or_joins():
    h, _ = worker_health(clock())
    assert h.report().ready is False and h.report().detail == ["loading the model"]
    h.phase = "joining group worker.m"
    assert h.report().detail == ["joining group worker.m"]


def test_a_worker_in_its_group_with_partitions_and_a_broker_that_answers_is_ready():
    h, s = worker_health(clock())
    h.standing = s
    report = h.report()
    assert report.ready and report.live and report.detail == []
    assert report.checks["broker"] is True and report.checks["partitions"] == 4


def test_a_worker_whose_broker_has_not_answered_for_five_seconds_is_not_ready():
    c = clock()
    h, s = worker_health(c)
    h.standing = s
    c.now += 4.9
    assert h.report().ready
    s.error = "KafkaConnectionError: refused"
    c.now += 0.2
    report = h.report()
    assert not report.ready and report.live
    assert report.detail == ["broker: no answer for 5 s (KafkaConnectionError: refused)"]


def test_a_worker_out_of_its_group_or_without_partitions_when_it_should_have_some_is_not_ready():
    h, s = worker_health(clock())
    h.standing = s
    s.member, s.partitions = False, 0
    assert "not a member" in h.report().detail[0]
    s.member = True
    assert "holds no partition" in h.report().detail[0]
    s.state = "PreparingRebalance"  # partitions are being handed out: not held against it
    assert h.report().ready
    s.state, s.members = "Stable", 13  # more members than the 12 partitions: an idle extra is ready
    assert h.report().ready


def test_a_worker_whose_engine_made_no_step_with_work_in_it_is_neither_ready_nor_live():
    c = clock()
    h, s = worker_health(c, has_work=True)
    h.standing = s
    h.step_loop_turned()
    c.now += 29
    s.answered_at = c.now  # the broker keeps answering
    assert h.report().ready
    c.now += 2
    s.answered_at = c.now
    report = h.report()
    assert not report.ready and not report.live
    assert report.detail == ["engine: no step for 31 s with 2 running and 3 waiting"]
    c.now += 10  # the broker away too: the loop may be waiting on it, so not a fault a restart cures
    report = h.report()
    assert not report.ready and report.live and len(report.detail) == 2
    s.answered_at = c.now
    h.engine.has_work = False  # idle: no step is due
    assert h.report().ready and h.report().live
    h.engine.has_work = True
    h.step_loop_turned()
    assert h.report().ready


# ---------------------------------------------------------------- the health server


def test_the_health_server_answers_ready_live_and_metrics():
    from prometheus_client import CollectorRegistry, Counter

    registry = CollectorRegistry()
    Counter("probe_total", "a counter", registry=registry).inc()
    state = {"report": Report(ready=False, detail=["broker: no answer for 9 s"], degraded=["weaviate: away"])}
    port = closed_port()
    server = HealthServer(port, lambda: state["report"], registry, host="127.0.0.1")
    base = f"http://127.0.0.1:{port}"
    try:
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(base + "/health/ready", timeout=5)
        assert caught.value.code == 503
        body = json.loads(caught.value.read())
        assert body["ready"] is False and body["detail"] == ["broker: no answer for 9 s"]
        assert body["degraded"] == ["weaviate: away"]
        with urllib.request.urlopen(base + "/health/live", timeout=5) as r:
            assert r.status == 200
        with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
            assert b"probe_total 1.0" in r.read()
        state["report"] = Report(ready=True)
        with urllib.request.urlopen(base + "/health/ready", timeout=5) as r:
            assert r.status == 200 and json.loads(r.read())["ready"] is True
    finally:
        server.close()


def test_system_status_shows_why_and_what_is_degraded():
    from tokenstream.ops.probe import describe

    assert (
        describe({"detail": ["broker: no answer for 7 s"], "degraded": ["weaviate: no answer"]})
        == "broker: no answer for 7 s; degraded: weaviate: no answer"
    )
    assert describe({"ready": True}) == ""
