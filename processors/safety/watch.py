"""The output check over a batch of ts.tokens records: each chunk folded into its answer's window in
order, the windows due judged together (processors/safety/batch.py), each verdict sent in order, and
each window checkpointed, held or ended as the acknowledgement rule says (processors/safety/held.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from faust.types import EventT

from processors.safety.batch import Prejudged, due_windows
from processors.safety.held import HeldWindows
from processors.safety.windows import WindowSettings, due, fold, judged
from safety_model.classifier import Judgement
from schemas import Completion, OutputWindow, TokenChunk

Event = TokenChunk | Completion
Judge = Callable[[list[str]], Awaitable[list[Judgement]]]  # one classifier call for all the texts
Screen = Callable[[Event, OutputWindow, EventT, Judgement], Awaitable[None]]  # send a window's verdict
Finish = Callable[[Completion, OutputWindow, EventT], Awaitable[None]]  # an answer's end, before its row goes


class OutputWatch:
    """`batch` handles records in order as the agent reads them; `current` says whether a record may
    be handled (not of an earlier consumer generation): one that may not is acknowledged unhandled,
    an acknowledgement processors.delivery refuses, so that the record is fetched again."""

    def __init__(
        self,
        windows: HeldWindows,
        cfg: WindowSettings,
        judge: Judge,
        screen: Screen,
        finish: Finish,
        current: Callable[[EventT], bool] = lambda raw: True,
    ) -> None:
        self.windows, self.cfg = windows, cfg
        self.judge, self.screen, self.finish, self.current = judge, screen, finish, current
        self.calls = 0  # classifier calls made

    async def batch(self, records: list[tuple[Event, EventT]]) -> None:
        ready = await self.ahead([event for event, _ in records])
        for event, raw in records:
            if self.current(raw):
                await self.one(event, raw, ready)
            else:
                raw.ack()

    async def ahead(self, events: list[Event]) -> Prejudged:
        """Every window that comes due in `events`, judged in one call."""
        found = {key: await self.windows.peek(key) for key in dict.fromkeys(e.request_id for e in events)}
        coming = due_windows(events, found.get, self.cfg)
        if not coming:
            return Prejudged([], [])
        self.calls += 1
        return Prejudged(coming, await self.judge([w.text for w in coming]))

    async def one(self, event: Event, raw: EventT, ready: Prejudged) -> None:
        key = event.request_id
        held = await self.windows.take(event)
        final = isinstance(event, Completion)
        if not final:
            folded = fold(held.window, event, self.cfg)
            if folded is None:  # a replayed chunk
                await self.windows.hold(key, held, raw, event.seq)
                return
            held.window = folded
        judged_now = due(held.window, self.cfg, final=final)
        if judged_now:
            held.busy = True
            try:
                window = held.window
                result = ready.take(window)
                if result is None:
                    self.calls += 1
                    result = (await self.judge([window.text]))[0]
                await self.screen(event, window, raw, result)
                held.window = judged(window, self.cfg, result.blocked, result.scores)
            finally:
                held.busy = False
        if final:
            await self.finish(event, held.window, raw)
            await self.windows.end(key, held, raw)
        elif judged_now:
            await self.windows.checkpoint(key, held, raw)
        else:
            await self.windows.hold(key, held, raw, event.seq)
