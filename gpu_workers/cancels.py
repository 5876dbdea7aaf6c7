"""Cancels: the control topic, read without a group, each Cancel handed to Engine.cancel.

Rule: a cancel sent while no worker held its request still stops it. A starting worker reads the
control topic from CANCELS_KEPT_S ago, up to its end, before it takes in its first request (the
engine keeps recent cancels and ends such a request as soon as it arrives); from then on it follows
the topic from where that read stopped, so no cancel sent after start is missed.
"""

from __future__ import annotations

import asyncio

from aiokafka.structs import TopicPartition

from producers import decode_record
from schemas import Cancel, DecodeError
from topics import CONTROL

CANCELS_KEPT_S = 600.0  # a starting worker reads the cancels of this long ago (a request's whole life)


class Cancels:
    """The control topic -> `worker.engine` (`worker`: a gpu_workers.service.Worker, consumer `control`)."""

    def __init__(self, worker) -> None:
        self.worker = worker

    async def read_since(self, since: float) -> None:
        """Read the control topic from `since`: a cancel sent while no worker held its request (this
        one starting, the group rebalancing) still stops it here (the engine keeps recent cancels
        and ends such a request as soon as it arrives); otherwise a request the gateway had ended
        with its progress deadline was generated in full by the worker that took it over."""
        control = self.worker.control
        # assigned here, not subscribed: a subscription's assignment can still be empty right after
        # start, and its partitions then began at "latest" later, past the cancels looked for
        tps = [TopicPartition(CONTROL.name, p) for p in range(CONTROL.partitions)]
        control.assign(tps)
        for tp in tps:
            await control.position(tp)  # fixes "latest" now, so no cancel sent after start is missed
        found = await control.offsets_for_times({tp: int(since * 1000) for tp in tps})
        for tp, at in found.items():
            if at is not None:
                control.seek(tp, at.offset)
        # taken in before the first request is: read by the running task, they raced the requests
        # they cancel, which then began generating
        ends = await control.end_offsets(tps)
        while [tp for tp in tps if await control.position(tp) < ends[tp]]:
            self._take(await control.getmany(timeout_ms=200))

    async def follow(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self._take(await self.worker.control.getmany(timeout_ms=200))

    def _take(self, batches: dict) -> None:
        for records in batches.values():
            for rec in records:
                try:
                    event = decode_record(rec, CONTROL)
                except DecodeError:
                    continue
                if isinstance(event, Cancel):
                    self.worker.engine.cancel(event.request_id)
                    self.worker.work.set()
