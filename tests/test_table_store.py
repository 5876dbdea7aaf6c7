"""The processors' table store (processors/table_store.py): a standby that is up to date takes a
partition over with nothing to read, and an offset never claims rows the store has dropped. The
takeover itself, through real processors and a broker: tests/test_processors.py (kill -9)."""

from __future__ import annotations

import pytest
from faust.events import Event
from faust.tables.recovery import Recovery
from faust.types import TP, Message

from processors.faust_app import make_app
from processors.table_store import Store

CHANGELOG = "ts-safety-windows-changelog"
ACTIVE, STANDBY = TP(CHANGELOG, 0), TP(CHANGELOG, 1)


pytestmark = pytest.mark.usefixtures("no_broker")  # the apps are only built: no broker is reached


@pytest.fixture
def table():
    app = make_app("safety")
    return app.Table("windows", partitions=2, key_type=bytes, value_type=bytes)


def _record(app, tp: TP, offset: int, key: bytes, value: bytes | None) -> Event:
    message = Message(tp.topic, tp.partition, offset, 0.0, 0, {}, key, value, None)
    return Event(app, key, value, {}, message)


async def _generation(table, active: set[TP], standby: set[TP]) -> None:
    """A rebalance that hands this member `active` and `standby`, its recovery ended."""
    await table.on_rebalance(active | standby, set(), set(), 1)
    await table.on_recovery_completed(active, standby)


async def test_the_processors_tables_use_it(table):
    assert isinstance(table.data, Store)


async def test_a_standby_read_to_its_end_takes_over_with_nothing_to_read(table):
    app = table.app
    await table.on_rebalance({ACTIVE, STANDBY}, set(), set(), 1)
    table.apply_changelog_batch(
        [
            _record(app, ACTIVE, 0, b"a", b"1"),
            _record(app, STANDBY, 0, b"b", b"2"),
            _record(app, STANDBY, 1, b"c", b"3"),
        ]
    )
    await table.on_recovery_completed({ACTIVE}, {STANDBY})
    assert table.data.persisted_offset(STANDBY) == 1
    assert table.data[b"c"] == b"3"  # a standby's rows are kept (faust's memory store dropped them)
    table.data.set_persisted_offset(ACTIVE, 4)  # its own write, acknowledged
    table.data.set_persisted_offset(STANDBY, 9)  # not its own partition: not recorded
    assert (table.data.persisted_offset(ACTIVE), table.data.persisted_offset(STANDBY)) == (4, 1)

    recovery = Recovery(app, app.tables)  # the takeover: the standby becomes active
    recovery.add_active(table, STANDBY)
    recovery.active_highwaters[STANDBY] = 1  # faust's "highwater": the last offset in the log
    assert recovery.active_offsets[STANDBY] == 1 and not recovery.need_recovery()
    recovery.active_highwaters[STANDBY] = 3  # two records written since: only those are read
    assert recovery.active_remaining()[STANDBY] == 2


async def test_a_partition_given_up_is_read_from_its_start_when_it_comes_back(table):
    app = table.app
    await table.on_rebalance({ACTIVE, STANDBY}, set(), set(), 1)
    table.apply_changelog_batch([_record(app, STANDBY, 0, b"b", b"2")])
    await _generation(table, {ACTIVE}, set())  # STANDBY moved to other members
    assert table.data.persisted_offset(STANDBY) is None
    assert b"b" not in table.data
    table.data.set_persisted_offset(STANDBY, 7)  # a late acknowledgement of a write made before
    assert table.data.persisted_offset(STANDBY) is None
    recovery = Recovery(app, app.tables)
    recovery.add_active(table, STANDBY)
    assert recovery.active_offsets[STANDBY] is None  # faust starts it at the log's start


async def test_writes_acknowledged_during_a_rebalance_are_read_again_after_it(table):
    """Between a rebalance's start and its recovery's end no partition is this member's to write:
    an acknowledgement then leaves the offset behind the rows, so the record is read (again)."""
    await _generation(table, {ACTIVE}, set())
    table.data.set_persisted_offset(ACTIVE, 3)
    await table.on_rebalance({ACTIVE}, set(), set(), 2)
    table.data.set_persisted_offset(ACTIVE, 4)
    assert table.data.persisted_offset(ACTIVE) == 3


class _Brokers:
    """What faust's Recovery._build_offsets asks of a consumer: each partition's first offset."""

    def __init__(self) -> None:
        self.asked: list[set[TP]] = []

    async def earliest_offsets(self, *tps: TP) -> dict[TP, int]:
        self.asked.append(set(tps))
        return {tp: 0 for tp in tps}


async def test_a_recovery_asks_the_log_start_only_of_partitions_without_an_offset(table):
    from collections import Counter

    app = table.app
    brokers, offsets = _Brokers(), Counter({ACTIVE: 12, STANDBY: None})
    recovery = Recovery(app, app.tables)
    await recovery._build_offsets(brokers, {ACTIVE, STANDBY}, offsets, "active")
    assert brokers.asked == [{STANDBY}] and offsets == {ACTIVE: 12, STANDBY: -1}
    await recovery._build_offsets(brokers, {ACTIVE}, offsets, "active")
    assert brokers.asked == [{STANDBY}]  # nothing to ask: no round trip
