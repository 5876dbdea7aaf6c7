"""The classifier's turns: one call at a time, a request's input before any answer's windows.

Rule. The input check stands between a request and its first token (the gateway holds an answer until
its input verdict), the output check only trails an answer already streaming; both share one model.
So calls take turns: a waiting input call goes before every waiting output call, and an output batch
is judged in pieces of at most `piece` texts, so an input that arrives during a batch waits for one
piece at most, not for the whole batch. Calls of one kind keep their order. Each call runs in a thread
(the model's forward holds no event loop).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable

from safety_model.classifier import Judgement

INPUT, OUTPUT = 0, 1


class Turns:
    def __init__(self, judge: Callable[[list[str]], list[Judgement]], piece: int) -> None:
        self.judge = judge  # one blocking classifier call
        self.piece = piece
        self.busy = False
        self.waiting: list[tuple[int, int, asyncio.Future]] = []  # (kind, arrival, wake-up)
        self.arrivals = itertools.count()
        self.calls = 0

    async def inputs(self, texts: list[str]) -> list[Judgement]:
        return await self._call(INPUT, texts)

    async def outputs(self, texts: list[str]) -> list[Judgement]:
        out: list[Judgement] = []
        for start in range(0, len(texts), self.piece):
            out += await self._call(OUTPUT, texts[start : start + self.piece])
        return out

    async def _call(self, kind: int, texts: list[str]) -> list[Judgement]:
        if self.busy or self.waiting:
            turn = asyncio.get_running_loop().create_future()
            heapq.heappush(self.waiting, (kind, next(self.arrivals), turn))
            try:
                await turn  # handed the turn by the call before (busy stays set for it)
            except asyncio.CancelledError:
                if turn.done() and not turn.cancelled():  # handed over as it was cancelled: pass it on
                    self._next()
                raise
        self.busy = True
        try:
            self.calls += 1
            return await asyncio.to_thread(self.judge, texts)
        finally:
            self._next()

    def _next(self) -> None:
        """Hand the turn to the first waiting call still waiting, else free it."""
        while self.waiting:
            _, _, turn = heapq.heappop(self.waiting)
            if not turn.done():
                turn.set_result(None)
                return
        self.busy = False
