"""How ingestion retries its index (tenacity strategies): hold the event through a Weaviate outage,
give up on a file only for failures of its own.

After a failed try, Weaviate's readiness endpoint says which it was:
- Weaviate does not answer: an outage. The event is held and tried again 0.25 s, 0.5 s, 1 s, then
  every 2 s, so it is indexed within about 2 s of Weaviate's return; after `outage_s` of outage
  `IndexUnavailable` is raised, which ends the process for its supervisor (the event, never
  committed, is read again by the next one).
- Weaviate answers: the failure is the file's (or a passing one): tried `attempts` times in all,
  1, 2, 4 ... s apart, then the last error is raised (the file is recorded as failed).
Failures that are the file's for certain (`permanent`) are raised at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from tenacity import AsyncRetrying, RetryCallState

from common.vectordb import BACKOFF_FIRST_S, BACKOFF_MOST_S, backoff_s

log = logging.getLogger(__name__)
T = TypeVar("T")


class IndexUnavailable(RuntimeError):
    """Weaviate stayed away longer than the outage budget: the process should exit."""


class IndexRetry:
    def __init__(
        self,
        attempts: int,
        outage_s: float,
        reachable: Callable[[], Awaitable[bool]],
        permanent: tuple[type[BaseException], ...] = (),
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        on_retry: Callable[[], None] | None = None,
    ) -> None:
        self.attempts, self.outage_s, self.reachable, self.permanent = (
            attempts,
            outage_s,
            reachable,
            permanent,
        )
        self.clock, self.sleep, self.on_retry = clock, sleep, on_retry
        self.outage_since: float | None = None  # while the index is away: since when (this call)
        self._outage_tries = self._failures = 0

    async def run(self, work: Callable[[], Awaitable[T]]) -> T:
        self.outage_since, self._outage_tries, self._failures = None, 0, 0
        try:
            async for attempt in AsyncRetrying(
                retry=self._retry,
                stop=self._stop,
                wait=self._wait,
                sleep=self.sleep,
                before_sleep=self._before_sleep,
                reraise=True,
            ):
                with attempt:
                    result = await work()
                    self.outage_since = None
                    return result
        except self.permanent:
            raise
        except Exception as exc:
            if self.outage_since is not None:
                raise IndexUnavailable(
                    f"Weaviate unreachable for {self.clock() - self.outage_since:.0f} s "
                    f"(budget {self.outage_s:.0f} s): {exc}"
                ) from exc
            raise
        raise AssertionError("unreachable")

    async def _retry(self, state: RetryCallState) -> bool:
        exc = state.outcome.exception() if state.outcome is not None else None
        if exc is None or isinstance(exc, self.permanent):
            return False
        if await self.reachable():
            self.outage_since, self._outage_tries = None, 0
            self._failures += 1
        else:
            if self.outage_since is None:
                self.outage_since = self.clock()
            self._outage_tries += 1
        return True

    def _stop(self, state: RetryCallState) -> bool:
        if self.outage_since is not None:
            return self.clock() - self.outage_since >= self.outage_s
        return self._failures >= self.attempts

    def _wait(self, state: RetryCallState) -> float:
        if self.outage_since is not None:
            return backoff_s(self._outage_tries - 1)  # as the breakers pace their tries (common/vectordb.py)
        return float(2 ** (self._failures - 1))

    def _before_sleep(self, state: RetryCallState) -> None:
        exc = state.outcome.exception()
        if self.outage_since is not None:
            if self._outage_tries == 1:
                log.warning(
                    "the index (Weaviate) is unreachable (%s): the event is held and tried again every "
                    "%.2f-%.0f s for up to %.0f s",
                    exc,
                    BACKOFF_FIRST_S,
                    BACKOFF_MOST_S,
                    self.outage_s,
                )
        else:
            log.warning(
                "the index failed (%s); attempt %d of %d in %.0f s",
                exc,
                self._failures + 1,
                self.attempts,
                state.upcoming_sleep,
            )
        if self.on_retry is not None:
            self.on_retry()
