"""The output check reads ts.tokens in batches and judges the windows that come due in a batch together.

A batch is what was read while the agent handled the one before (at most `batch_records` records; the
first is waited for, none after it): reading goes on in a task of its own meanwhile (`batches`). Before
handling a batch the agent folds its chunks, in order, into copies of their windows (`due_windows`) and
judges every window that comes due in one classifier call: one forward pass for many windows costs less
than one each (measured in the commit that brought this in). Then it handles each record as if alone
(processors/safety/watch.py), and a window that comes due takes its verdict from that call
(`Prejudged.take`) when its text is the one judged there; otherwise (a rebalance between, a window
evicted and read back differently) it is judged then, on its own. Two due points of one answer in a
batch are two windows, each judged on its own text, their verdicts sent in order. The copies assume
every window allowed: after a block earlier in the batch a later window of that answer is not due
(`windows.due`), so the verdict judged for it ahead is not used, as if never judged.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

from processors.safety.windows import WindowSettings, due, fold, judged
from safety_model.classifier import Judgement
from schemas import Completion, OutputWindow, TokenChunk

T = TypeVar("T")


async def batches(items: AsyncIterator[T], most: int) -> AsyncIterator[list[T]]:
    """Lists of what `items` yields, in order: the first waited for, then what was read meanwhile (at
    most `most` in all). A task of its own reads ahead, at most `most` items, while the caller handles a
    list; an error of `items` is raised here after what was read before it has been handed over."""
    queue: asyncio.Queue[T] = asyncio.Queue(maxsize=most)

    async def read() -> None:
        async for item in items:
            await queue.put(item)

    reader = asyncio.create_task(read())
    try:
        while True:
            if queue.empty():
                getter = asyncio.ensure_future(queue.get())
                await asyncio.wait((getter, reader), return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    reader.result()  # the reader's error, if it ended with one
                    return
                batch = [getter.result()]
            else:
                batch = [queue.get_nowait()]
            while len(batch) < most and not queue.empty():
                batch.append(queue.get_nowait())
            yield batch
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader


@dataclass(frozen=True, slots=True)
class Due:
    """A window that comes due in a batch: its answer, its last chunk, its text."""

    request_id: str
    last_seq: int
    text: str


def due_windows(
    events: list[TokenChunk | Completion],
    window_of: Callable[[str], OutputWindow | None],
    cfg: WindowSettings,
) -> list[Due]:
    """The windows that come due as `events` are folded in order, as the agent will fold them: each
    answer's window starts as `window_of` its request id finds it (None: a new one), and is taken as
    allowed when it comes due."""
    windows: dict[str, OutputWindow] = {}
    out: list[Due] = []
    for event in events:
        key = event.request_id
        window = windows.get(key)
        if window is None:
            window = window_of(key) or OutputWindow(request_id=key)
        final = isinstance(event, Completion)
        if not final:
            window = fold(window, event, cfg) or window
        if due(window, cfg, final=final):
            out.append(Due(key, window.last_seq, window.text))
            window = judged(window, cfg, blocked=False)
        windows[key] = OutputWindow(request_id=key) if final else window  # an ended answer's row is gone
    return out


class Prejudged:
    """The verdicts of a batch's due windows, judged in one call; each is taken once, and only by the
    window it was judged for (the same answer, last chunk and text)."""

    def __init__(self, windows: list[Due], judgements: list[Judgement]) -> None:
        if len(windows) != len(judgements):
            raise ValueError(f"{len(judgements)} judgements for {len(windows)} windows")
        self.ready = {(w.request_id, w.last_seq): (w.text, j) for w, j in zip(windows, judgements)}

    def take(self, window: OutputWindow) -> Judgement | None:
        hit = self.ready.pop((window.request_id, window.last_seq), None)
        return hit[1] if hit is not None and hit[0] == window.text else None
