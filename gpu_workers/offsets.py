"""Which inference-topic offset may be committed, per partition.

Requests of one partition finish out of order. The committed offset of a partition is the
lowest offset whose request has not written its completion yet (or one past the highest
offset seen when none is in flight): everything before it is durable, so a restart from
there redoes only unfinished requests.
"""

from __future__ import annotations

from aiokafka.structs import TopicPartition


class OffsetTracker:
    def __init__(self) -> None:
        self._inflight: dict[TopicPartition, set[int]] = {}
        self._next: dict[TopicPartition, int] = {}
        self._committed: dict[TopicPartition, int] = {}

    def add(self, tp: TopicPartition, offset: int) -> None:
        self._inflight.setdefault(tp, set()).add(offset)
        self._next[tp] = max(self._next.get(tp, 0), offset + 1)

    def done(self, tp: TopicPartition, offset: int) -> None:
        if tp in self._inflight:
            self._inflight[tp].discard(offset)

    def tracks(self, tp: TopicPartition, offset: int) -> bool:
        """Whether `offset` is in flight here (read again after a rebalance that kept its partition)."""
        return offset in self._inflight.get(tp, ())

    def owns(self, tp: TopicPartition) -> bool:
        return tp in self._inflight

    def inflight(self, tp: TopicPartition) -> set[int]:
        return set(self._inflight.get(tp, ()))

    def drop(self, tp: TopicPartition) -> None:
        self._inflight.pop(tp, None)
        self._next.pop(tp, None)
        self._committed.pop(tp, None)

    def committable(self) -> dict[TopicPartition, int]:
        """Partitions whose commit point moved since the last `mark_committed`."""
        out = {}
        for tp, nxt in self._next.items():
            pending = self._inflight.get(tp)
            point = min(pending) if pending else nxt
            if point > self._committed.get(tp, -1):
                out[tp] = point
        return out

    def mark_committed(self, offsets: dict[TopicPartition, int]) -> None:
        for tp, off in offsets.items():
            if tp in self._next:
                self._committed[tp] = max(self._committed.get(tp, -1), off)
