"""At-least-once delivery across rebalances: every record faust fetches reaches an agent.

faust discards records that are in flight while a rebalance finishes and counts on seeking
back to the committed offsets to fetch them again. Four gaps in that, each of which lost
requests when a processor was killed and restarted under load (tests/test_processors.py,
kill -9 test; traced with per-record logging of fetch, delivery, commit and seek):

1. `flow_control.resume()` (mode) empties every agent's queue. faust calls it *after* its
   seek, so records fetched between the seek and the resume were thrown away and never
   fetched again. -> `refetch_discarded`: rewind each partition to the oldest record the
   resume throws away, at the same instant. Only ever back: the queues may still hold
   records fetched before faust's seek to the committed offsets, and moving a partition
   forward to them skipped the records between, never acknowledged, so `commit_contiguous`
   (4) held that partition's commits for good (seen as lag left after a member joined and
   another left under load: tests/test_processors.py, scale-out; traced with the fetch
   position logged beside each re-fetch).
2. aiokafka's `seek_to_committed` leaves a partition alone when the group has no committed
   offset for it (or offset 0), so its fetch position stayed past whatever was discarded:
   typically the partitions a killed member had not committed yet. -> `rewind_uncommitted`.
3. faust drops a fetched record whose offset is below the last one it read (meant for
   re-fetches after a seek), which also dropped the records re-fetched for 1 and 2.
   -> `_NoReadOffsets`.
4. faust commits past a single missing offset at the head of a partition (its check is off
   by one), so a record discarded and not yet re-fetched could be skipped for good by the
   next commit. -> `commit_contiguous`: never commit past an offset that was not acked.
5. faust commits backwards when an ack below the committed offset is in its list (one taken
   while the committed offset was unknown, around a rebalance). -> `commit_contiguous` drops
   such acks first (`_forget_committed`).
6. faust records a commit's offsets as the partition's committed offset even when the commit
   failed (`already rebalanced`); one that hung across a rebalance (10 s while a broker
   restarted) then overwrote the offset the new generation had just read from the group, and a
   stale lower value held `commit_contiguous` for good. -> `record_only_done_commits`.

And one that the compiled (Cython) stream iterator we install does not have: faust's
pure-Python iterator acknowledges the records it skips during a rebalance, as if processed.
-> `ack_only_processed`, which also fetches again a record of an earlier generation handed to an
agent once the rebalance is over (its ack refused, nothing else would fetch it again).

Re-delivery is harmless because every agent is idempotent by request id
(processors.effects.Ledger, table rows, sequence numbers). Our input topics have no offset
gaps (no transactional producers, no compaction); were that to change, `commit_contiguous`
would hold a partition's commits at its first gap, so it would have to learn the gaps.
"""

from __future__ import annotations

import logging

import faust

log = logging.getLogger(__name__)


class _NoReadOffsets(dict):
    """Replaces faust's per-partition "last read offset", so a re-fetched record is delivered."""

    def __getitem__(self, tp):
        return None

    def __setitem__(self, tp, offset) -> None:
        pass


def refetch_discarded(app: faust.App) -> None:
    """When flow control resumes and empties the agents' queues, fetch those records again."""
    flow, consumer = app.flow_control, app.consumer
    resume = flow.resume

    def resume_and_refetch() -> None:
        oldest: dict = {}
        for queue in list(flow._queues):
            for item in list(queue._queue):
                message = getattr(item, "message", None)
                if message is not None:
                    oldest[message.tp] = min(message.offset, oldest.get(message.tp, message.offset))
        resume()
        if not oldest:
            return
        log.info(
            "fetching again what flow control discarded: %s",
            ", ".join(f"{tp.topic}[{tp.partition}]@{offset}" for tp, offset in sorted(oldest.items())),
        )
        assigned = consumer.assignment()
        for tp, offset in oldest.items():
            at = _position(consumer, tp)
            if tp in assigned and at is not None and offset < at:
                # synchronously, as faust's own Consumer.seek does: no record of this partition
                # can be delivered between the queue being emptied and the position moving back
                consumer._thread.seek(tp, offset)

    flow.resume = resume_and_refetch


def _position(consumer, tp) -> int | None:
    """The partition's fetch position now; None while it waits for a reset (to the committed offset,
    which is no later than anything queued)."""
    kafka = consumer._thread._ensure_consumer()
    try:
        state = kafka._subscription.subscription.assignment.state_value(tp)
    except (AttributeError, KeyError):
        return None
    return state.position if state is not None and state.has_valid_position else None


def rewind_uncommitted(app: faust.App) -> None:
    """Make faust's "seek to committed offsets" also rewind partitions with no commit yet."""
    consumer = app.consumer
    thread = consumer._thread
    inputs = app.topics.acks_enabled_for  # the agents' input topics, not changelogs

    async def seek_in_thread() -> dict:
        kafka = thread._ensure_consumer()
        committed = await kafka.seek_to_committed()
        for tp, offset in committed.items():
            if not offset and inputs(tp.topic):
                kafka.seek(tp, 0)  # the earliest reset policy moves a truncated log to its start
        return committed

    async def seek_to_committed() -> dict:
        return await thread.call_thread(seek_in_thread)

    consumer.seek_to_committed = seek_to_committed


def commit_contiguous(app: faust.App) -> None:
    """Commit a partition only up to its first offset that was not acked, and never backwards."""
    consumer = app.consumer
    new_offset = consumer._new_offset

    def contiguous_offset(tp):
        acked, committed = consumer._acked[tp], consumer._committed_offset[tp]
        if acked and committed is not None:
            if min(acked) < committed:
                _forget_committed(consumer, tp, acked, committed)
            if acked and min(acked) > committed:
                return None  # the record at `committed` was not processed yet: wait for it
        return new_offset(tp)

    consumer._new_offset = contiguous_offset


def _forget_committed(consumer, tp, acked: list[int], committed: int) -> None:
    """Drop acknowledgements of records below the group's committed offset (5).

    Such an ack is taken while the partition's committed offset is unknown: between a rebalance's
    revocation and the seek to the committed offsets, a record delivered again (or late, from the
    generation before) finishes, and faust records its ack against no committed offset. faust
    would then commit just past it, moving the group's offset backwards, and `commit_contiguous`
    held that partition's commits there for good: the records between were already committed,
    so nothing delivered them again (lag left after a member joined and another left under load).
    """
    stale = [offset for offset in acked if offset < committed]
    acked[:] = [offset for offset in acked if offset >= committed]
    consumer._acked_index[tp].difference_update(stale)
    log.info(
        "dropped acks of %s[%d] below its committed offset %d: %s",
        tp.topic,
        tp.partition,
        committed,
        ", ".join(map(str, stale[:10])),
    )


def record_only_done_commits(app: faust.App) -> None:
    """A commit that did not happen is not recorded as the partitions' committed offsets (6).

    faust's `_commit_offsets` hands `_commit` the offsets and then records that very mapping as
    committed, whatever `_commit` answered: emptied when the commit failed, it records nothing.
    A commit fails when the group has rebalanced, and the seek to the committed offsets that ends
    the rebalance sets them from the group (before this answer or after it; either way right)."""
    consumer = app.consumer
    commit = consumer._commit

    async def commit_or_record_nothing(offsets) -> bool:
        done = await commit(offsets)
        if not done and isinstance(offsets, dict):
            offsets.clear()
        return done

    consumer._commit = commit_or_record_nothing


def ack_only_processed(app: faust.App) -> None:
    """Refuse an acknowledgement given while a rebalance is in progress (the record was skipped).

    The condition is the one under which faust's streams skip a record; a record that *was*
    processed but acknowledged in that moment is simply delivered again after the rebalance.
    """
    consumer = app.consumer
    ack = consumer.ack

    def checked_ack(message) -> bool:
        if not app.flow_control.is_active():
            return False  # a rebalance is on: faust seeks back to the committed offsets at its end
        if message.generation_id != app.consumer_generation_id:
            _fetch_again(consumer, message)
            return False
        return ack(message)

    consumer.ack = checked_ack


def _fetch_again(consumer, message) -> None:
    """A record of an earlier generation, handed to an agent after the rebalance ended: its
    acknowledgement is refused, so fetch it again (under this generation) if the partition is still
    ours and its position has moved past it. Without this nothing fetched it again (the seek to the
    committed offsets was done already), `commit_contiguous` held the partition's commits at it, and
    as the partition's last record it stayed as lag (seen after a scale-out under load)."""
    tp, offset = message.tp, message.offset
    at = _position(consumer, tp)
    if tp in consumer.assignment() and at is not None and offset < at:
        log.info(
            "fetching again %s[%d]@%d, handed over from an earlier generation", tp.topic, tp.partition, offset
        )
        consumer._thread.seek(tp, offset)


def at_least_once(app: faust.App) -> None:
    """Apply all of the above to `app` (before its worker starts)."""
    app.consumer._read_offset = _NoReadOffsets()
    refetch_discarded(app)
    rewind_uncommitted(app)
    commit_contiguous(app)
    record_only_done_commits(app)
    ack_only_processed(app)
