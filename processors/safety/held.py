"""The output windows the safety processor holds in memory between checkpoints, and the acknowledgements
they hold back.

The rule: a record on ts.tokens is acknowledged (the consumer may commit past it) only once the windows
table holds a window that covers it. A chunk is acknowledged when its window is checkpointed with it
folded in, or deleted at its answer's end (after the last judgement); a chunk the checkpoint covers
already (a replay) at once. faust flushes the table's changelog writes before it commits offsets, so
after a kill the committed offset never lies past a chunk whose text the table lacks: the restarted
processor reads the checkpoint, then those chunks again, and folds them in (`windows.fold` drops the
chunks folded in before).

A window is checkpointed (its table row written) when it is judged, when it holds `checkpoint_chunks`
chunks unacknowledged, when its oldest unacknowledged chunk is `checkpoint_s` old (a stream that stalls
or never ends holds no acknowledgement longer), and when it is evicted to keep at most `held_windows`
windows in memory; its row is deleted at its answer's end. Between those, a chunk costs a fold in memory.

A window taken in an earlier consumer generation (a rebalance came between) is dropped unwritten: its
partition may be another member's now, its acknowledgements would be refused (processors.delivery), and
faust reads its partitions again from their committed offsets, which lie before its unwritten chunks.
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

from processors.faust_app import get, put
from processors.safety.windows import WindowSettings
from schemas import Completion, OutputWindow, TokenChunk


@dataclass(slots=True)
class Held:
    """One answer's window as it is now, and what its last checkpoint covers."""

    window: OutputWindow
    generation: int
    checkpointed_seq: int  # the last chunk the table's row holds (-1: none)
    pending: list[EventT] = field(default_factory=list)  # records not acknowledged yet, oldest first
    since: float = 0.0  # when the oldest of them was held (time.monotonic)
    busy: bool = False  # being judged: the agent checkpoints it when the judgement is done


class HeldWindows:
    """The windows in memory, least recently used first; see the module's docstring for the rule."""

    def __init__(self, table: faust.Table, cfg: WindowSettings, generation: Callable[[], int]) -> None:
        self.table, self.cfg, self.generation = table, cfg, generation
        self.held: OrderedDict[str, Held] = OrderedDict()

    def take(self, event: TokenChunk | Completion) -> Held:
        """The held window of `event`'s answer: from memory, else from its checkpoint, else a new one."""
        key, now = event.request_id, self.generation()
        held = self.held.get(key)
        if held is not None and held.generation == now:
            self.held.move_to_end(key)
            return held
        if held is not None:
            del self.held[key]  # of an earlier generation: dropped unwritten
        window = get(self.table, key, OutputWindow)
        if window is None:
            window = OutputWindow(request_id=key, conversation_id=event.conversation_id, tenant=event.tenant)
        held = self.held[key] = Held(window, now, window.last_seq)
        while len(self.held) > self.cfg.held_windows:
            oldest, evicted = next(iter(self.held.items()))
            if evicted.busy:
                break  # the one being judged is never the least recently used for long
            self.checkpoint(oldest, evicted)
            self.held.pop(oldest, None)
        return held

    def peek(self, key: str) -> OutputWindow | None:
        """`key`'s window as `take` would find it now, without taking it (None: there is none yet)."""
        held = self.held.get(key)
        if held is not None and held.generation == self.generation():
            return held.window
        return get(self.table, key, OutputWindow)

    def hold(self, key: str, held: Held, raw: EventT, seq: int) -> None:
        """Chunk `seq` (`raw`) is folded into `held`: acknowledge it once a checkpoint covers it."""
        if seq <= held.checkpointed_seq:
            raw.ack()  # a replay of what the checkpoint holds
            return
        if not held.pending:
            held.since = time.monotonic()
        held.pending.append(raw)
        if len(held.pending) >= self.cfg.checkpoint_chunks:
            self.checkpoint(key, held)

    def checkpoint(self, key: str, held: Held, *also: EventT) -> None:
        """Write `held`'s window to the table, then acknowledge what it covers (`also` too). A window
        with nothing unacknowledged is what its row holds already: nothing is written."""
        if held.generation != self.generation():
            held.pending.clear()  # not ours to write (see the module's docstring)
            self.held.pop(key, None)
            return
        if not held.pending and not also:
            return
        _put(self.table, key, held.window, (held.pending or also)[0])
        held.checkpointed_seq = held.window.last_seq
        _ack(held.pending, also)

    def end(self, key: str, held: Held, raw: EventT) -> None:
        """The answer ended (its Completion, `raw`, handled): delete its row, acknowledge everything."""
        self.held.pop(key, None)
        if held.generation != self.generation():
            held.pending.clear()
            return
        _put(self.table, key, None, raw)
        _ack(held.pending, (raw,))

    def overdue(self, now: float | None = None) -> int:
        """Checkpoint each window whose oldest unacknowledged chunk is `checkpoint_s` old; how many."""
        cutoff = (time.monotonic() if now is None else now) - self.cfg.checkpoint_s
        late = [(k, h) for k, h in self.held.items() if h.pending and h.since <= cutoff and not h.busy]
        for key, held in late:
            self.checkpoint(key, held)
        return len(late)


def _put(table: faust.Table, key: str, window: OutputWindow | None, source: EventT) -> None:
    """Write a row as if while `source` (a record of its answer) were being handled: faust writes a row's
    changelog record to the partition of the record in hand (the tables are co-partitioned with
    ts.tokens), which for a checkpoint made by the timer, or for a window evicted while another answer's
    record is handled, is the wrong one or none."""
    token = _current_event.set(weakref.ref(source))
    try:
        put(table, key, window)
    finally:
        _current_event.reset(token)


def _ack(pending: list[EventT], also) -> None:
    for raw in pending:
        raw.ack()
    pending.clear()
    for raw in also:
        raw.ack()
