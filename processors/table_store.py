"""The processors' table store: faust's in-memory store, plus how far into each changelog partition
its rows go, so that a takeover reads only what its standby has not seen.

After every rebalance faust rebuilds each table partition handed to a member from the partition's
changelog, starting at the offset the store says its rows reflect (`persisted_offset`). faust's
memory store answers "none" for every partition and drops standby partitions' rows once a recovery
ends. So with two members, the survivor of a kill -9 read every changelog partition from its start
again although it held each of its rows as a standby replica, and a takeover's time grew with the
changelog; in a chaos drill (2026-12-07) one such read stalled for 12.5 s with nothing arriving,
the longest wait of the run (processors/recovery_watch.py ends a process after a longer one).

This store keeps what faust's RocksDB store keeps on disk, in memory: the last offset applied per
changelog partition (read from the changelog, or acknowledged for the member's own writes), and the
rows of standby partitions as well as active ones. A standby that is up to date becomes active
with nothing to read; one behind reads only the records after its offset.

An offset is only ever recorded for rows this member holds: one read from a partition assigned to
it, or acknowledged for a partition it is active for. Rows and offsets of a partition it no longer
holds are dropped together when a recovery ends, so a later assignment reads it from the start
(rows the member wrote itself, which faust's memory store knows by key only, stay until that read
overwrites or deletes them, as in faust's own store).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from faust.stores import STORES, memory
from faust.types import TP, EventT

SCHEME = "ts-memory"  # the store URL's scheme: "ts-memory://"


class Store(memory.Store):
    """An in-memory table store that knows which changelog offset each partition's rows reflect."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._applied: dict[TP, int] = {}  # changelog partition -> last offset its rows reflect
        self._assigned: set[TP] = set()  # this generation's partitions (read into the rows)
        self._active: set[TP] = set()  # changelog partitions this member writes, between recoveries

    def apply_changelog_batch(
        self, batch: Iterable[EventT], to_key: Callable[[Any], Any], to_value: Callable[[Any], Any]
    ) -> None:
        batch = list(batch)
        super().apply_changelog_batch(batch, to_key, to_value)
        for event in batch:
            tp = event.message.tp
            if tp in self._assigned:
                self._advance(tp, event.message.offset)

    def persisted_offset(self, tp: TP) -> int | None:
        return self._applied.get(tp)

    def set_persisted_offset(self, tp: TP, offset: int) -> None:
        """The broker acknowledged this member's own write at `offset` (faust calls this per write).
        An acknowledgement arriving after the partition was taken away is not recorded: its rows may
        be dropped meanwhile, and the offset would claim rows the store no longer has."""
        if tp in self._active:
            self._advance(tp, offset)

    async def on_rebalance(
        self, assigned: set[TP], revoked: set[TP], newly_assigned: set[TP], generation_id: int = 0
    ) -> None:
        await super().on_rebalance(assigned, revoked, newly_assigned, generation_id)
        self._active = set()  # nothing is written until the recovery ends
        self._assigned = set(assigned)

    async def on_recovery_completed(self, active_tps: set[TP], standby_tps: set[TP]) -> None:
        """Keep the rows and offsets of every partition held, active or standby; drop the rest."""
        held = active_tps | standby_tps
        await super().on_recovery_completed(held, standby_tps)  # faust drops rows of partitions not in `held`
        partitions = {tp.partition for tp in held}
        for tp in [tp for tp in self._applied if tp.partition not in partitions]:
            del self._applied[tp]
        self._active = set(active_tps)

    def _advance(self, tp: TP, offset: int) -> None:
        if offset > self._applied.get(tp, -1):
            self._applied[tp] = offset


def _ask_log_starts_only_when_unknown() -> None:
    """faust asks the brokers for each changelog partition's first offset before a recovery, to
    start past records compaction removed, even for a partition whose offset the store knows: a
    round trip of 1.2-1.4 s on three loaded brokers, half of a takeover's recovery (chaos drill,
    2026-12-07). A known offset needs no log start (were the records after it deleted, the consumer's
    `earliest` reset moves the read to the log's start), so only unknown partitions are asked."""
    from faust.tables.recovery import Recovery

    build = Recovery._build_offsets
    if getattr(build, "only_unknown", False):
        return

    async def _build_offsets(self, consumer, tps, destination, title):
        unknown = {tp for tp in tps if destination.get(tp) is None}
        if unknown:
            await build(self, consumer, unknown, destination, title)

    _build_offsets.only_unknown = True
    Recovery._build_offsets = _build_offsets


def register() -> str:
    """Make the store known to faust by its URL scheme; returns the URL to configure."""
    STORES.aliases.setdefault(SCHEME, f"{__name__}:Store")
    _ask_log_starts_only_when_unknown()
    return f"{SCHEME}://"
