"""The worker's admission order (gpu_workers.priority): higher tiers first, FIFO within a tier, aging."""

from __future__ import annotations

from collections import deque

from gpu_workers.priority import AGING_S, enqueue
from gpu_workers.sequence import Sequence


def seq(name: str, priority: int, arrival: float = 100.0) -> Sequence:
    return Sequence(name, [1, 2, 3], priority=priority, arrival=arrival)


def names(waiting: deque[Sequence]) -> list[str]:
    return [s.request_id for s in waiting]


def test_higher_tiers_go_first_and_each_tier_stays_first_come_first_served():
    waiting: deque[Sequence] = deque()
    for s in (seq("f1", 0), seq("f2", 0), seq("p1", 1), seq("e1", 2), seq("p2", 1), seq("f3", 0)):
        enqueue(waiting, s, now=100.0)
    assert names(waiting) == ["e1", "p1", "p2", "f1", "f2", "f3"]


def test_a_request_that_waited_long_keeps_its_place():
    waiting: deque[Sequence] = deque([seq("old-free", 0, arrival=0.0), seq("new-free", 0, arrival=AGING_S)])
    enqueue(waiting, seq("paid", 1, arrival=AGING_S + 1), now=AGING_S + 1)
    assert names(waiting) == ["old-free", "paid", "new-free"]
