"""processors.recovery_watch at unit level: which stalled recovery ends a processor, and which does not.

faust's own Recovery object is used, its progress set as a recovery leaves it (no broker needed).
"""

from __future__ import annotations

import uuid

import faust
from faust.types import TP

from processors.recovery_watch import stalled

LOG = "ts-conversation-history-changelog"


def recovery(highwaters: dict[int, int], offsets: dict[int, int], received: dict[int, float]):
    app = faust.App(f"t-{uuid.uuid4().hex[:8]}", broker="kafka://127.0.0.1:1", store="memory://")
    r = app.tables.recovery
    r.in_recovery, r._recovery_started_at = True, 100.0  # started at t=100 (faust's monotonic clock)
    for p, highwater in highwaters.items():
        r.active_highwaters[TP(LOG, p)] = highwater
        r.active_offsets[TP(LOG, p)] = offsets[p]
    r._active_events_received_at.update({TP(LOG, p): at for p, at in received.items()})
    return r


def test_partitions_that_read_nothing_since_the_start_stall_the_recovery():
    # what the scale-out run showed: 6 and 7 sought to their start, nothing arrived; 0 was read to its end
    r = recovery({0: 7, 6: 14, 7: 9}, {0: 7, 6: -1, 7: -1}, {0: 100.2})
    assert stalled(r, now=131.0, stall_s=30) == {TP(LOG, 6): 15, TP(LOG, 7): 10}
    assert stalled(r, now=129.0, stall_s=30) == {}  # not yet


def test_a_recovery_still_reading_or_done_is_left_alone():
    reading = recovery({6: 1000}, {6: 400}, {6: 150.0})  # a long changelog, its last record read at t=150
    assert stalled(reading, now=170.0, stall_s=30) == {}
    assert stalled(reading, now=181.0, stall_s=30) == {TP(LOG, 6): 600}  # then nothing for 31 s
    done = recovery({6: 14}, {6: 14}, {})  # read to its end: nothing left to wait for
    assert stalled(done, now=1000.0, stall_s=30) == {}
    over = recovery({6: 14}, {6: -1}, {})  # records left, but the recovery is over (no longer waited on)
    over.in_recovery = False
    assert stalled(over, now=1000.0, stall_s=30) == {}
