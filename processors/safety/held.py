"""The output windows the safety processor holds in memory between checkpoints, and the acknowledgements
they hold back.

The rule: a record on ts.tokens is acknowledged (the consumer may commit past it) only once the windows
table holds a window that covers it. A chunk is acknowledged when its window is checkpointed with it
folded in, or deleted at its answer's end (after the last judgement); a chunk the checkpoint covers
already (a replay) at once. faust flushes the table's changelog writes before it commits offsets, so
after a kill the committed offset never lies past a chunk whose text the table lacks: the restarted
processor reads the checkpoint, then those chunks again, and folds them in (`windows.fold` drops the
chunks folded in before). A chunk of a step record (schemas/steps.py) is acknowledged by the same rule
as a share of that record (processors/shares.py): the record itself once all its chunks are.

A window is checkpointed (its table row written) when it is judged, when it holds `checkpoint_chunks`
chunks unacknowledged, when its oldest unacknowledged chunk is `checkpoint_s` old (a stream that stalls
or never ends holds no acknowledgement longer), and when it is evicted to keep at most `held_windows`
windows in memory; its row is deleted at its answer's end. Between those, a chunk costs a fold in memory.

A window taken in an earlier consumer generation (a rebalance came between) is dropped unwritten: its
partition may be another member's now, its acknowledgements would be refused (processors.delivery), and
faust reads its partitions again from their committed offsets, which lie before its unwritten chunks.

Rows are read and sealed through `sealing.unblocked` (common/unblocked.py): a key not held is fetched in
a thread, so a checkpoint may wait while the agent and the timer go on. A row is written as the window
was when its checkpoint was asked for; of two checkpoints of a window waiting at once, the one asked for
later wins (an earlier one that ends after it writes nothing and acknowledges only what it covered).
"""

from __future__ import annotations

import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import faust
from faust.streams import _current_event
from faust.types import EventT

from common import sealing
from processors.faust_app import get
from processors.safety.windows import WindowSettings
from schemas import Completion, OutputWindow, TokenChunk, encode


@dataclass(slots=True)
class Held:
    """One answer's window as it is now, and what its last checkpoint covers."""

    window: OutputWindow
    generation: int
    checkpointed_seq: int  # the last chunk the table's row holds (-1: none)
    pending: list[EventT] = field(default_factory=list)  # records not acknowledged yet, oldest first
    since: float = 0.0  # when the oldest of them was held (time.monotonic)
    busy: bool = False  # being judged: the agent checkpoints it when the judgement is done
    asked: int = 0  # checkpoints asked for (and ends), in order
    written: int = 0  # the latest of them whose row was written


class HeldWindows:
    """The windows in memory, least recently used first; see the module's docstring for the rule."""

    def __init__(self, table: faust.Table, cfg: WindowSettings, generation: Callable[[], int]) -> None:
        self.table, self.cfg, self.generation = table, cfg, generation
        self.held: OrderedDict[str, Held] = OrderedDict()

    async def take(self, event: TokenChunk | Completion) -> Held:
        """The held window of `event`'s answer: from memory, else from its checkpoint, else a new one."""
        key, now = event.request_id, self.generation()
        held = self.held.get(key)
        if held is not None and held.generation == now:
            self.held.move_to_end(key)
            return held
        if held is not None:
            del self.held[key]  # of an earlier generation: dropped unwritten
        window = await sealing.unblocked(get, self.table, key, OutputWindow)
        if window is None:
            window = OutputWindow(request_id=key, conversation_id=event.conversation_id, tenant=event.tenant)
        held = self.held[key] = Held(window, now, window.last_seq)
        while len(self.held) > self.cfg.held_windows:
            oldest, evicted = next(iter(self.held.items()))
            if evicted.busy:
                break  # the one being judged is never the least recently used for long
            await self.checkpoint(oldest, evicted)
            if self.held.get(oldest) is evicted:
                del self.held[oldest]
        return held

    async def peek(self, key: str) -> OutputWindow | None:
        """`key`'s window as `take` would find it now, without taking it (None: there is none yet)."""
        held = self.held.get(key)
        if held is not None and held.generation == self.generation():
            return held.window
        return await sealing.unblocked(get, self.table, key, OutputWindow)

    async def hold(self, key: str, held: Held, raw: EventT, seq: int) -> None:
        """Chunk `seq` (`raw`) is folded into `held`: acknowledge it once a checkpoint covers it."""
        if seq <= held.checkpointed_seq:
            raw.ack()  # a replay of what the checkpoint holds
            return
        if not held.pending:
            held.since = time.monotonic()
        held.pending.append(raw)
        if len(held.pending) >= self.cfg.checkpoint_chunks:
            await self.checkpoint(key, held)

    async def checkpoint(self, key: str, held: Held, *also: EventT) -> None:
        """Write `held`'s window to the table, then acknowledge what it covers (`also` too). A window
        with nothing unacknowledged is what its row holds already: nothing is written."""
        if not self._ours(key, held):
            return
        if not held.pending and not also:
            return
        window, covered = held.window, list(held.pending)
        held.asked += 1
        asked = held.asked
        row = await _sealed(window)  # may wait for a key: the window may change meanwhile
        if not self._ours(key, held):
            return
        if asked > held.written:  # else a later checkpoint wrote a newer window already
            _write(self.table, key, row, (covered or also)[0])
            held.written = asked
            held.checkpointed_seq = max(held.checkpointed_seq, window.last_seq)
        _ack(held, covered, also)

    async def end(self, key: str, held: Held, raw: EventT) -> None:
        """The answer ended (its Completion, `raw`, handled): delete its row, acknowledge everything."""
        if self.held.get(key) is held:
            del self.held[key]
        if held.generation != self.generation():
            held.pending.clear()
            return
        held.asked += 1
        held.written = held.asked  # a checkpoint still waiting for its key writes nothing after this
        _write(self.table, key, None, raw)
        _ack(held, list(held.pending), (raw,))

    async def overdue(self, now: float | None = None) -> int:
        """Checkpoint each window whose oldest unacknowledged chunk is `checkpoint_s` old; how many."""
        cutoff = (time.monotonic() if now is None else now) - self.cfg.checkpoint_s
        late = [(k, h) for k, h in self.held.items() if h.pending and h.since <= cutoff and not h.busy]
        for key, held in late:
            await self.checkpoint(key, held)
        return len(late)

    def _ours(self, key: str, held: Held) -> bool:
        """Whether `held` was taken in this consumer generation; if not, it is dropped unwritten."""
        if held.generation == self.generation():
            return True
        held.pending.clear()  # not ours to write (see the module's docstring)
        if self.held.get(key) is held:
            del self.held[key]
        return False


async def _sealed(window: OutputWindow) -> bytes:
    """A window's row; a key not held is fetched off the loop (common/unblocked.py)."""
    return await sealing.unblocked(encode, window)


def _write(table: faust.Table, key: str, row: bytes | None, source: EventT) -> None:
    """Write (None: delete) a row as if while `source` (a record of its answer) were being handled: faust
    writes a row's changelog record to the partition of the record in hand (the tables are co-partitioned
    with ts.tokens), which for a checkpoint made by the timer, or for a window evicted while another
    answer's record is handled, is the wrong one or none."""
    token = _current_event.set(weakref.ref(source))
    try:
        if row is None:
            table.pop(key.encode(), None)
        else:
            table[key.encode()] = row
    finally:
        _current_event.reset(token)


def _ack(held: Held, covered: list[EventT], also) -> None:
    """Acknowledge `covered` (those of them still pending: another checkpoint may have meanwhile) and
    `also`."""
    if covered:
        done = {id(raw) for raw in covered}
        for raw in held.pending:
            if id(raw) in done:
                raw.ack()
        held.pending = [raw for raw in held.pending if id(raw) not in done]
    for raw in also:
        raw.ack()
