"""The requests this instance admitted, followed to their end on the log, with or without a client.

Every request a gateway instance admits answers on one of that instance's own tokens partitions,
which its fan-out reads whole, so the instance sees each of its requests end (the Completion:
finished, cancelled, failed or filtered) whether a client is still attached or left long ago.
At that moment, once per request:

- its usage is counted and its unused token reservation given back (`RateLimiter.settle`, which
  also runs at most once per request id whichever instance calls it);
- its open-request slot (the key's `max_streams`) is released.

A slot is also released as soon as the request is cancelled (by its client, after a disconnect
and the resume grace period, or for a deadline): the worker's cancelled Completion only settles
the usage. While a request is open the instance renews its slot's lease every lease/3; the slots
of an instance that dies lapse after the lease. A request of which nothing was heard for
`progress_timeout_s` while no client waits on it here is cancelled (deadline); one that was
cancelled is forgotten after `progress_timeout_s` even if no Completion ever comes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway.cancel import Canceller
from gateway.ratelimit import RateLimiter
from schemas import Completion

log = logging.getLogger(__name__)


@dataclass
class Open:
    note: dict  # the request note (tenant, key id, window, reservation, slot, cached)
    heard: float  # monotonic time of its admission or latest event
    cancelled: float | None = None


class Inflight:
    def __init__(
        self, limiter: RateLimiter, canceller: Canceller, *, lease_s: float, progress_timeout_s: float
    ) -> None:
        self.limiter = limiter
        self.canceller = canceller
        self.lease_s = lease_s
        self.progress_timeout_s = progress_timeout_s
        self.open: dict[str, Open] = {}
        self.attached: Callable[[str], bool] = lambda rid: False  # a client's connection waits on it here
        self._tasks: set[asyncio.Task] = set()
        canceller.on_cancel = self.cancelled

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.open

    def track(self, request_id: str, note: dict) -> None:
        self.open[request_id] = Open(note, time.monotonic())

    def heard(self, request_id: str, event: Completion | None) -> None:
        """An event of a tracked request went by on this instance's partitions (the fan-out's hook);
        `event` is the decoded Completion, None for any other event."""
        entry = self.open.get(request_id)
        if entry is None:
            return
        entry.heard = time.monotonic()
        if event is not None and not entry.note.get("run"):
            # a response run goes on after its first step's Completion: its route finishes it at the run's end
            self._spawn(self.finish(request_id, event))

    async def finish(self, request_id: str, done: Completion | None) -> None:
        """The request ended: count its usage (when `done` says what it used) and free its slot; once."""
        entry = self.open.pop(request_id, None)
        if entry is None:
            return
        if entry.cancelled is None:
            await self._release(request_id, entry.note)
        if done is not None:
            await self.limiter.settle_answer(request_id, entry.note, done)

    def cancelled(self, request_id: str) -> None:
        """A Cancel for the request was written (Canceller's hook): its slot is free from now."""
        entry = self.open.get(request_id)
        if entry is not None and entry.cancelled is None:
            entry.cancelled = time.monotonic()
            self._spawn(self._release(request_id, entry.note))

    async def _release(self, request_id: str, note: dict) -> None:
        try:
            await self.limiter.release(request_id, note)
        except Exception as exc:  # noqa: BLE001 - Redis away: the lease lapses instead
            log.warning(
                "open-request slot of %s not released (%s); it lapses with its lease", request_id, exc
            )

    async def run(self) -> None:
        """Renew the leases of open requests' slots; cancel and forget what went quiet."""
        renewed = 0.0
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for rid, entry in list(self.open.items()):
                if entry.cancelled is not None:
                    if now - entry.cancelled > self.progress_timeout_s:
                        self.open.pop(rid, None)  # no Completion came: its reservation lapses with the minute
                elif now - entry.heard > self.progress_timeout_s and not self.attached(rid):
                    log.info(
                        "no event of %s for %.0fs and no client here: cancelling it", rid, now - entry.heard
                    )
                    with contextlib.suppress(Exception):
                        await self.canceller.cancel(rid, "deadline")
                    self.cancelled(rid)
            if now - renewed >= self.lease_s / 3:
                renewed = now
                slots: dict[str, list[str]] = {}
                for rid, entry in self.open.items():
                    if entry.cancelled is None and entry.note.get("slot"):
                        slots.setdefault(entry.note["key_id"], []).append(rid)
                try:
                    await self.limiter.renew(slots, self.lease_s)
                except Exception as exc:  # noqa: BLE001
                    log.warning("open-request leases not renewed: %s", exc)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
