"""The worker's side of a rebalance: a revoked partition's requests are held, then kept or given up.

Rule: nothing is written for a revoked partition until the next assignment decides. `revoked` marks
its requests held before it awaits anything (not even the step running now); `assigned` keeps a
partition no other member can have owned meanwhile (the very next generation, or a skipped one whose
tokens topic holds exactly what this worker wrote) and writes what its requests produced while held,
in order; any other partition's requests are aborted unwritten, and their new owner takes them over
from the tokens topic. Of a partition new here the end offset is read: a request below it may have
been started by a previous owner (gpu_workers/intake.py looks such requests up before starting them).
"""

from __future__ import annotations

import logging

from aiokafka import ConsumerRebalanceListener
from aiokafka.structs import TopicPartition

from producers.sticky import StickyAssignor, generation_of

log = logging.getLogger(__name__)


class Rebalancer(ConsumerRebalanceListener):
    """The consumer's rebalance listener, working on the state of `worker` (a gpu_workers.service.Worker)."""

    def __init__(self, worker) -> None:
        self.worker = worker
        self.assignor = StickyAssignor()

    async def on_partitions_revoked(self, revoked) -> None:
        await self.revoked(set(revoked))

    async def on_partitions_assigned(self, assigned) -> None:
        await self.assigned(set(assigned))

    async def assigned(self, tps: set[TopicPartition]) -> None:
        """Settle the held partitions (gpu_workers/handover.py): write what the kept ones waited to
        write, give up the requests of those that moved; read the end of each partition new here."""
        w = self.worker
        generation = generation_of(w.consumer)
        self.assignor.remember_generation(generation)
        async with w.publish_lock:
            kept, check = w.handover.sort(tps, generation)
            if check:
                kept |= await self._untouched(check)
            settled = w.handover.settle(tps, generation, kept)
            self._give_up(settled.lost)
            await w.publisher.publish_locked(settled.waiting)
            # Given up but still ours: their records may have been fetched (and passed over as running)
            # while this settled, so they are read again from the commit and taken over from the log.
            for tp in settled.lost & tps:
                committed = await w.consumer.committed(tp)
                if committed is None:
                    await w.consumer.seek_to_beginning(tp)
                else:
                    w.consumer.seek(tp, committed)
        fresh = tps - settled.kept
        if fresh:
            ends = await w.consumer.end_offsets(list(fresh))
            w.takeover_below.update(ends)  # anything below may have been started by a previous owner
        w.settled = set(tps)
        log.info(
            "worker %s assigned %d partitions of %s (generation %d, %d kept through the rebalance)",
            w.worker_id,
            len(tps),
            w.spec.name,
            generation,
            len(settled.kept),
        )
        if not w.ready.is_set():
            log.info("worker ready: %s in group %s", w.worker_id, w.group)
            if w.watch is not None:
                w.health.standing = w.watch.standing
            w.ready.set()

    async def revoked(self, tps: set[TopicPartition]) -> None:
        """Hold the partitions' requests until the new assignment: nothing more is written for them.

        They stop writing before anything is awaited, not even what the step running now produces: a
        revocation that outlasts the group's rebalance timeout (a slow step on a loaded host) gets
        this member expelled and the partitions handed to another worker meanwhile; a token written
        after that came behind the new owner's takeover read, which had started the request afresh,
        and the log held two versions of its answer (the chaos drill saw a chunk "A" and then a
        Completion with seq 0 from the new owner). The assignment then keeps them or gives them up.
        """
        w = self.worker
        for tp in tps:
            w.epoch[tp] = w.epoch.get(tp, 0) + 1
        w.settled -= tps
        w.handover.hold(tps)
        # Not waiting for the running step (seconds on a loaded host, which made the member miss the
        # rebalance timeout): only for a publish under way, so that what it queued is flushed too.
        async with w.publish_lock:
            await w.producer.flush()

    async def _untouched(self, tps: set[TopicPartition]) -> set[TopicPartition]:
        """Of held partitions assigned back after a skipped generation, those whose requests nobody else
        continued: the tokens topic holds exactly the chunks this worker wrote for each, and no end."""
        w = self.worker
        held = [(rid, tp, request) for rid, (tp, _, request, _) in w.owned.items() if tp in tps]
        emitted = (
            await w.tokens.emitted(
                [
                    (rid, request.reply_partition, request.created_at - w.cfg.takeover_margin_s)
                    for rid, _, request in held
                ]
            )
            if held
            else {}
        )
        moved = {
            tp
            for rid, tp, _ in held
            if emitted[rid].completion is not None or len(emitted[rid].chunks) != w.chunks_written.get(rid, 0)
        }
        return tps - moved

    def _give_up(self, tps: set[TopicPartition]) -> None:
        """Abort the requests of partitions that moved: their new owner takes them over."""
        w = self.worker
        lost = [rid for rid, (tp, *_) in w.owned.items() if tp in tps]
        for rid in lost:
            w.engine.abort(w.owned.pop(rid)[3])
            w.chunks_written.pop(rid, None)
            w.resuming.pop(rid, None)
            w.parsers.pop(rid, None)
            w.publisher.end_span(rid, {"tokenstream.handed_over": True})
        for tp in tps:
            w.tracker.drop(tp)
            w.takeover_below.pop(tp, None)
        if lost:
            log.info("worker %s gave up %d in-flight requests on rebalance", w.worker_id, len(lost))
