"""A processor whose table recovery stops reading ends, for its supervisor to restart it.

After every rebalance faust rebuilds a processor's tables from their changelog partitions and holds
the agents until each active one is read to its end. Seen once in 37 runs of the scale-out
test (tests/test_processors.py, 2026-12-06): after a member left, the survivor sought the six
changelog partitions it took over to their start and no record of them ever arrived. faust warned
"No event received" every 5 s and went on waiting; the process, a live group member holding every
partition, processed nothing until the next rebalance (none came: no other member). Nothing in faust
restarts a recovery from inside, so one that has read nothing for `recovery_stall_s`
(TOKENSTREAM_RECOVERY_STALL_S) while records are left ends the process with EXIT_RECOVERY_STALLED,
after logging what it waited for; restarted, it recovers afresh (its ledger makes the replay harmless).
"""

from __future__ import annotations

import asyncio
import logging
import os
from time import monotonic  # faust's recovery clock

import faust
from faust.types import TP

log = logging.getLogger(__name__)

EXIT_RECOVERY_STALLED = 71


def stalled(recovery, now: float, stall_s: float) -> dict[TP, int]:
    """The active changelog partitions with records left to read and none read for `stall_s` (records
    left)."""
    if not recovery.in_recovery:
        return {}
    started = recovery._recovery_started_at
    received = recovery._active_events_received_at
    return {
        tp: left
        for tp, left in recovery.active_remaining().items()
        if left > 0 and now - received.get(tp, started) >= stall_s
    }


def watch_recovery(app: faust.App, stall_s: float) -> None:
    """End the process when `app`'s table recovery stalls (see the module's docstring)."""

    @app.task
    async def recovery_watch() -> None:
        while True:
            await asyncio.sleep(min(5.0, stall_s / 3))
            late = stalled(app.tables.recovery, monotonic(), stall_s)
            if late:
                log.critical(
                    "table recovery read nothing for %.0fs with records left (%s): exiting with %d for "
                    "the supervisor to restart this processor",
                    stall_s,
                    ", ".join(f"{tp.topic}[{tp.partition}] {left} left" for tp, left in sorted(late.items())),
                    EXIT_RECOVERY_STALLED,
                )
                logging.shutdown()
                os._exit(EXIT_RECOVERY_STALLED)
