"""processors.delivery at unit level: what faust throws away around a rebalance is fetched again.

The consumer thread is replaced by a recorder of seeks (no broker needed); each test also runs
stock faust on the same input to show the hole being closed. The end-to-end proof against the
real broker is the kill -9 test in tests/test_processors.py.
"""

from __future__ import annotations

import asyncio
import uuid
from types import SimpleNamespace

import faust
from faust.events import Event
from faust.types import TP
from faust.types.tuples import Message

from processors.delivery import at_least_once

PREPARED = "ts.requests.prepared"


class FakeKafka:
    """Stands in for the aiokafka consumer: committed offsets and fetch positions in, seeks recorded."""

    def __init__(self, committed: dict[TP, int | None]) -> None:
        self.committed = committed
        self.positions: dict[TP, int] = {}  # no entry: the position awaits a reset
        self.seeks: list[tuple[TP, int]] = []

    @property
    def _subscription(self):  # aiokafka's subscription state, as far as processors.delivery reads it
        def state_value(tp):
            at = self.positions.get(tp)
            return SimpleNamespace(has_valid_position=at is not None, position=at)

        return SimpleNamespace(
            subscription=SimpleNamespace(assignment=SimpleNamespace(state_value=state_value))
        )

    async def seek_to_committed(self) -> dict[TP, int | None]:
        # as aiokafka does: no seek for a partition whose committed offset is None or 0
        self.seeks += [(tp, offset) for tp, offset in self.committed.items() if offset]
        return dict(self.committed)

    def seek(self, tp: TP, offset: int) -> None:
        self.seeks.append((tp, offset))


class FakeThread:
    """Stands in for faust's consumer thread (the part processors.delivery calls)."""

    def __init__(self, assigned: set[TP], committed: dict[TP, int | None] | None = None) -> None:
        self.assigned = assigned
        self.kafka = FakeKafka(committed or {})

    def assignment(self) -> set[TP]:
        return self.assigned

    def seek(self, tp: TP, offset: int) -> None:
        self.kafka.seek(tp, offset)

    def _ensure_consumer(self) -> FakeKafka:
        return self.kafka

    async def seek_to_committed(self) -> dict[TP, int | None]:
        return await self.kafka.seek_to_committed()

    async def call_thread(self, fun, *args):
        return await fun(*args)

    async def commit(self, offsets) -> bool:  # what the broker answered: "already rebalanced"
        return False


def make(thread: FakeThread, *, hardened: bool) -> faust.App:
    app = faust.App(f"test-{uuid.uuid4().hex[:8]}", broker="kafka://127.0.0.1:1")
    app.consumer._thread = thread
    if hardened:
        at_least_once(app)
    return app


def message(app: faust.App, tp: TP, offset: int) -> Message:
    return Message(
        tp.topic,
        tp.partition,
        offset,
        0.0,
        0,
        [],
        b"k",
        b"v",
        None,
        tp=tp,
        generation_id=app.consumer_generation_id,
    )


def event(app: faust.App, tp: TP, offset: int) -> Event:
    return Event(app, b"k", b"v", [], message(app, tp, offset))


def queued_then_resumed(hardened: bool, position: int | None = 9) -> tuple[faust.App, FakeThread]:
    """Records 7 and 8 of an assigned partition (and 2 of one no longer assigned) sit in an
    agent's queue when flow control resumes at the end of a rebalance; the partition's fetch
    position is `position` (9: past them)."""
    mine, gone = TP(PREPARED, 3), TP(PREPARED, 5)
    thread = FakeThread(assigned={mine})
    if position is not None:
        thread.kafka.positions[mine] = position
    app = make(thread, hardened=hardened)
    queue = app.topic(PREPARED).queue
    for tp, offset in ((mine, 7), (mine, 8), (gone, 2)):
        queue.put_nowait(event(app, tp, offset))
    app.flow_control.suspend()
    app.flow_control.resume()
    assert queue.empty()  # resume empties the agents' queues (mode's FlowControlEvent)
    return app, thread


def test_records_emptied_from_the_queues_on_resume_are_fetched_again():
    _, thread = queued_then_resumed(hardened=True)
    assert thread.kafka.seeks == [(TP(PREPARED, 3), 7)]  # the oldest discarded, assigned only


def test_a_partition_is_never_moved_forward_to_what_the_queues_held():
    """Queued records fetched before faust's seek to the committed offsets: the position (6, or one
    awaiting its reset) is already before them. Seeking forward to 7 skipped 6, never acknowledged,
    and commit_contiguous then held the partition's commits for good (lag left after a rebalance)."""
    for position in (6, 7, None):
        _, thread = queued_then_resumed(hardened=True, position=position)
        assert thread.kafka.seeks == [], position


def test_stock_faust_loses_the_records_emptied_on_resume():
    _, thread = queued_then_resumed(hardened=False)
    assert thread.kafka.seeks == []  # nothing would fetch 7 and 8 again


def rewound(hardened: bool) -> list[tuple[TP, int]]:
    none, zero, five = TP(PREPARED, 0), TP(PREPARED, 1), TP(PREPARED, 2)
    changelog = TP("ts-safety-windows-changelog", 0)
    thread = FakeThread(
        assigned={none, zero, five, changelog}, committed={none: None, zero: 0, five: 5, changelog: None}
    )
    app = make(thread, hardened=hardened)
    app.topics._acking_topics.add(PREPARED)  # what subscribing the agent does
    asyncio.run(app.consumer.perform_seek())
    return sorted(thread.kafka.seeks)


def test_partitions_without_a_committed_offset_are_rewound_too():
    assert rewound(hardened=True) == [(TP(PREPARED, 0), 0), (TP(PREPARED, 1), 0), (TP(PREPARED, 2), 5)]


def test_stock_seek_to_committed_skips_partitions_without_a_commit():
    assert rewound(hardened=False) == [(TP(PREPARED, 2), 5)]


def first_commit(hardened: bool, acked: list[int]) -> int | None:
    tp = TP(PREPARED, 4)
    app = make(FakeThread(assigned={tp}), hardened=hardened)
    app.consumer._committed_offset[tp] = 3  # the next record to process is 3
    app.consumer._acked[tp] = list(acked)
    return app.consumer._new_offset(tp)


def test_no_commit_past_a_record_that_was_not_processed():
    assert first_commit(hardened=True, acked=[4, 5]) is None
    assert first_commit(hardened=True, acked=[3, 4, 5]) == 6
    assert first_commit(hardened=False, acked=[4, 5]) == 6  # stock faust skips record 3


def test_an_ack_below_the_committed_offset_never_moves_the_commit_backwards():
    """An ack taken while the committed offset was unknown (around a rebalance) of a record below
    it: stock faust commits just past it, backwards, and the records between are never delivered
    again, so commit_contiguous held the partition there for good (lag left after a scale-out)."""
    assert first_commit(hardened=False, acked=[1]) == 2  # stock faust: 3 -> 2, backwards
    assert first_commit(hardened=True, acked=[1]) is None
    assert first_commit(hardened=True, acked=[1, 3, 4]) == 5
    assert first_commit(hardened=True, acked=[1, 4]) is None  # still waits for 3


def after_a_failed_commit(hardened: bool) -> int | None:
    """The group has rebalanced while a commit of 15 was in flight (it hung while a broker restarted);
    the new generation read 10 from the group. (The consumer's committed offset afterwards.)"""
    tp = TP(PREPARED, 4)
    app = make(FakeThread(assigned={tp}), hardened=hardened)
    app.consumer.assignment = lambda: {tp}
    app._producer = SimpleNamespace(flush=lambda: asyncio.sleep(0))  # nothing buffered
    app.consumer._committed_offset[tp] = 10
    assert asyncio.run(app.consumer._commit_offsets({tp: 15})) is False
    return app.consumer._committed_offset[tp]


def test_a_commit_that_failed_is_not_recorded_as_done():
    assert after_a_failed_commit(hardened=False) == 15  # stock faust: recorded whatever the answer
    assert after_a_failed_commit(hardened=True) == 10


def ack(hardened: bool, *, during_rebalance: bool) -> list[int]:
    tp = TP(PREPARED, 6)
    app = make(FakeThread(assigned={tp}), hardened=hardened)
    app.topics._acking_topics.add(PREPARED)
    app.flow_control.resume()  # a running app (flow control starts suspended)
    if during_rebalance:
        app.flow_control.suspend()  # what faust does when partitions are revoked
    app.consumer.ack(message(app, tp, 9))
    return list(app.consumer._acked[tp])


def test_a_record_skipped_during_a_rebalance_is_not_acknowledged():
    assert ack(hardened=True, during_rebalance=True) == []
    assert ack(hardened=True, during_rebalance=False) == [9]
    assert ack(hardened=False, during_rebalance=True) == [9]  # stock faust would commit it


def stale_ack(hardened: bool, position: int) -> tuple[list[int], list[tuple[TP, int]]]:
    """A record of generation N reaches an agent after the rebalance to N+1 has ended (flow control
    active again); the partition is still ours, fetched up to `position`. (acked, seeks)."""
    tp = TP(PREPARED, 6)
    thread = FakeThread(assigned={tp})
    thread.kafka.positions[tp] = position
    app = make(thread, hardened=hardened)
    app.topics._acking_topics.add(PREPARED)
    app.flow_control.resume()
    stale = message(app, tp, 9)
    app.consumer_generation_id += 1  # the rebalance that ended
    app.consumer.ack(stale)
    return list(app.consumer._acked[tp]), thread.kafka.seeks


def test_a_record_of_an_earlier_generation_is_fetched_again_not_left_behind():
    assert stale_ack(hardened=True, position=12) == ([], [(TP(PREPARED, 6), 9)])
    assert stale_ack(hardened=True, position=9) == ([], [])  # (not fetched yet: it comes anyway)
