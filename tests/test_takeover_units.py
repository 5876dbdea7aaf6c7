"""What a takeover depends on, unit by unit: a surviving faust member must live through the rebalance
that a dead member's expiry starts, every group member must show itself alive often enough to be
replaced within seconds, and the chaos drill must measure the stall a fault causes (the drill itself:
tests/test_chaos.py, `tokenstream chaos`)."""

from __future__ import annotations

import pytest
from aiokafka.util import commit_structure_validate
from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread
from faust.types import TP

from common.config import settings
from processors.faust_app import make_app
from producers.settings import faust_liveness, liveness
from tokenstream.chaos.clients import Outcome
from tokenstream.chaos.drill import plan, worst_answer, worst_stall

pytestmark = pytest.mark.usefixtures("no_broker")  # the apps are only built: no broker is reached


class _Consumer:
    """aiokafka's consumer as faust's commit reaches it: the same structure check, which raised
    ValueError({}) when every partition had just been revoked."""

    def __init__(self) -> None:
        self.committed: list[dict] = []

    async def commit(self, offsets) -> None:
        commit_structure_validate(offsets)
        self.committed.append(offsets)


class _Thread:
    def __init__(self, assigned: set[TP]) -> None:
        self.assigned, self.consumer, self.crashes = assigned, _Consumer(), []
        self.tp_last_committed_at: dict = {}

    def assignment(self) -> set[TP]:
        return self.assigned

    def _ensure_consumer(self) -> _Consumer:
        return self.consumer

    async def crash(self, exc: BaseException) -> None:
        self.crashes.append(exc)

    class log:
        @staticmethod
        def exception(*args, **kwargs) -> None:
            pass


async def test_a_survivor_commits_nothing_when_the_rebalance_took_every_partition():
    make_app("conversation")  # installs the fix
    kept, taken = TP("ts.chat.requests", 0), TP("ts.chat.requests", 1)
    thread = _Thread(assigned={TP("ts-conversation-__assignor-__leader", 0)})
    assert await AIOKafkaConsumerThread._commit(thread, {taken: 5}) is False
    assert thread.crashes == [] and thread.consumer.committed == []
    thread.assigned.add(kept)
    assert await AIOKafkaConsumerThread._commit(thread, {taken: 5, kept: 7}) is True
    assert [{tp.partition: o.offset for tp, o in c.items()} for c in thread.consumer.committed] == [{0: 7}]


class _Recovering:
    """What faust's Recovery._seek_offsets asks of a consumer: seek_wait, checked as aiokafka's seek
    checks."""

    def __init__(self) -> None:
        self.sought: dict = {}

    async def seek_wait(self, offsets: dict) -> None:
        for tp, offset in offsets.items():
            if not (isinstance(offset, int) and offset >= 0):
                raise ValueError("Offset must be a positive integer")  # aiokafka's AIOKafkaConsumer.seek
            self.sought[tp] = offset


async def test_recovery_seeks_a_standby_changelog_without_an_offset_from_its_start():
    """faust's table recovery sought a standby partition it had built no offset for to None, and the
    processor crashed (guarantees.md, the recovery crash); now it starts that partition at 0, as faust
    does for -1, and leaves the offsets it knows alone."""
    from collections import Counter

    from faust.tables.recovery import Recovery

    make_app("safety")  # installs the fix
    unread, read, fresh = (TP("ts-safety-windows-changelog", p) for p in (0, 1, 2))
    consumer = _Recovering()
    offsets = Counter({unread: None, read: 41, fresh: -1})
    await Recovery._seek_offsets(object(), consumer, {unread, read, fresh}, offsets, "standby")
    assert consumer.sought == {unread: 0, read: 41, fresh: 0}


def test_every_member_is_replaced_within_the_session_timeout(monkeypatch):
    monkeypatch.setenv("TOKENSTREAM_KAFKA_SESSION_TIMEOUT_S", "3")
    settings.cache_clear()
    assert liveness() == {"session_timeout_ms": 3000, "heartbeat_interval_ms": 500}
    assert faust_liveness() == {"broker_session_timeout": 3.0, "broker_heartbeat_interval": 0.5}
    app = make_app("router")
    assert (app.conf.broker_session_timeout, app.conf.broker_heartbeat_interval) == (3.0, 0.5)
    monkeypatch.setenv("TOKENSTREAM_KAFKA_SESSION_TIMEOUT_S", "6")
    settings.cache_clear()
    assert liveness() == {"session_timeout_ms": 6000, "heartbeat_interval_ms": 1000}


def test_a_stall_counts_from_the_fault_or_from_the_sending():
    in_flight = Outcome("a", sent=10.0, arrivals=[10.5, 11.0, 14.0, 14.2], finished_at=14.3, done=True)
    sent_after = Outcome("b", sent=12.0, arrivals=[16.0], finished_at=16.5, done=True)
    ended_before = Outcome("c", sent=9.0, arrivals=[9.5], finished_at=10.9, done=True)
    never = Outcome("d", sent=11.5)
    assert in_flight.wait_from(11.2) == 14.0 - 11.2
    assert sent_after.wait_from(11.2) == 4.0 and ended_before.wait_from(11.2) is None
    assert worst_stall([in_flight, sent_after, ended_before], 11.2, 13.0) == 4.0
    assert worst_stall([in_flight, sent_after], 11.2, 11.9) == 14.0 - 11.2  # b was sent after the window
    assert worst_stall([never], 11.2, 13.0) == float("inf")


def test_a_drill_plan_holds_exactly_the_faults_asked_spread_over_the_run():
    schedule = plan(1, 1, 0, ("conversation", "worker"), freezes=2)
    assert sorted(schedule) == ["broker", "freeze", "freeze", "kill", "kill"]
    # the freezes at a quarter and three quarters of the run, the broker fault half way, the kills between
    assert schedule == ("kill", "freeze", "broker", "kill", "freeze")
    assert plan(0, 0, 0, ("worker",), freezes=3) == ("freeze",) * 3


def test_the_longest_answer_without_a_fault_counts_only_answers_within_the_window():
    whole = Outcome("a", sent=10.0, arrivals=[10.5], finished_at=13.5, done=True)
    early = Outcome("b", sent=9.0, arrivals=[9.5], finished_at=20.0, done=True)  # sent before the window
    late = Outcome("c", sent=11.0, arrivals=[11.5], finished_at=16.0, done=True)  # ended after it
    cut = Outcome("d", sent=10.5, arrivals=[11.0], finished_at=14.5)  # not answered in full
    assert worst_answer([whole, early, late, cut], 10.0, 15.0) == 3.5
    assert worst_answer([early, late], 10.0, 15.0) is None


def test_a_fault_is_recovered_from_at_a_later_requests_first_token_and_its_end():
    from tokenstream.chaos.drill import Fault, _recoveries

    fault = Fault("kill -9", "router-0", at=9.0, ended_at=10.0)
    before = Outcome("a", sent=9.5, arrivals=[10.2], finished_at=10.4, done=True)  # sent before it ended
    probe = Outcome("b", sent=10.0, arrivals=[12.5, 13.0], finished_at=15.0, done=True)
    next_one = Outcome("c", sent=11.0, arrivals=[12.0], finished_at=14.0, done=True)
    _recoveries([fault], [before, probe, next_one])
    assert (fault.first_token_s, fault.recovery_s) == (2.0, 4.0)
    unanswered = Fault("kill -9", "safety-0", at=20.0, ended_at=20.5)
    _recoveries([unanswered], [Outcome("d", sent=21.0)])
    assert (unanswered.first_token_s, unanswered.recovery_s) == (None, None)


async def test_a_takeover_read_fetches_a_key_not_held_in_a_thread(monkeypatch):
    import threading

    from common.unblocked import needed, unblocked
    from gpu_workers import recovery
    from topics import TOKENS

    fetched_on: list[int] = []

    def fetch() -> bytes:
        fetched_on.append(threading.get_ident())
        return b"key"

    # a decode whose record is sealed with a key the keyring does not hold
    monkeypatch.setattr(recovery, "decode_record", lambda rec, spec: (rec, needed(fetch, "k", fetch)))
    # as the takeover read decodes each record
    assert await unblocked(recovery.decode_record, "record", TOKENS) == ("record", b"key")
    assert fetched_on and threading.get_ident() not in fetched_on  # never on the loop
