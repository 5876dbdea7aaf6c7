"""Sticky partition assignment for a consumer group whose members hold work in flight (the workers).

aiokafka rebalances eagerly: every member's partitions are revoked before the group re-forms. With
its default round-robin assignor they are then dealt out afresh, so a member joining or leaving moves
almost every partition, and each move aborts the requests generating there. aiokafka's
`StickyPartitionAssignor` (KIP-54) keeps every partition it can with its previous owner, so a rebalance
moves only what balance needs: a survivor keeps its own partitions and gains the dead member's; a member
coming back takes half of them, no more.

That assignor keeps what a member reports (its last assignment and generation) on its class, and
aiokafka never tells it the generation, so every member reported -1 and a conflict between a
member that missed a generation and the partition's present owner was settled by the order of the
members. `StickyAssignor` keeps both per consumer (an instance) and is told the generation by
`remember_generation`, which the worker's rebalance listener calls on each assignment: the present
owner's claim (the higher generation) wins.

    assignor = StickyAssignor(busy=lambda: {partitions with requests in flight})
    consumer = await start_consumer(group=..., partition_assignment_strategy=assignor_strategy(assignor))
    ...on_partitions_assigned: assignor.remember_generation(generation_of(consumer))

Balance alone still moves partitions that have requests in flight: a worker killed and back 15 s later
took half of the survivor's partitions back, the requests the survivor had just taken over with them,
and their streams stalled a second time while the returning worker prefilled them again. So each member
also reports its *busy* partitions (those with requests in flight, held through the revocation:
gpu_workers/handover.py), appended to the sticky assignor's user data, and the leader hands every busy
partition back to the member that reports it (the latest generation's claim, should two report one),
giving the member that sticky balance had chosen one of the busy member's idle partitions instead: the
counts stay balanced and only idle partitions move (`keep_busy`). A busy partition assigned back in the
next generation is *kept* by the handover, its requests going on where they were.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from aiokafka.coordinator.assignors.roundrobin import RoundRobinPartitionAssignor
from aiokafka.coordinator.assignors.sticky.sticky_assignor import StickyAssignorUserDataV1, StickyPartitionAssignor
from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment, ConsumerProtocolMemberMetadata
from aiokafka.protocol.struct import Struct
from aiokafka.protocol.types import Array, Int32, Schema, String
from aiokafka.structs import TopicPartition

NO_GENERATION = -1


class BusyPartitions(Struct):
    """What a member appends to the sticky user data: its partitions with requests in flight."""

    SCHEMA = Schema(("busy", Array(("topic", String("utf-8")), ("partitions", Array(Int32)))))


class StickyAssignor(StickyPartitionAssignor):
    """aiokafka's sticky assignor with this consumer's own state (not the class's), its true generation,
    and busy partitions kept where they are."""

    def __init__(self, busy: Callable[[], set[TopicPartition]] = set) -> None:
        self.member_assignment: list[TopicPartition] | None = None
        self.generation = NO_GENERATION
        self.busy = busy

    def metadata(self, topics) -> ConsumerProtocolMemberMetadata:  # what this member tells the group's leader
        sticky = self._metadata(topics, self.member_assignment, self.generation)
        by_topic: dict[str, list[int]] = {}
        for tp in sorted(self.busy()):
            by_topic.setdefault(tp.topic, []).append(tp.partition)
        if not sticky.user_data or not by_topic:  # no previous assignment: nothing of this member's is busy
            return sticky
        busy = BusyPartitions(list(by_topic.items())).encode()
        return ConsumerProtocolMemberMetadata(sticky.version, sticky.subscription, sticky.user_data + busy)

    def assign(self, cluster, members: Mapping[str, ConsumerProtocolMemberMetadata]
               ) -> dict[str, ConsumerProtocolMemberAssignment]:
        balanced = super().assign(cluster, members)
        claims = {m: _busy_claim(md.user_data) for m, md in members.items()}
        kept = keep_busy({m: set(a.partitions()) for m, a in balanced.items()}, claims)
        return {m: ConsumerProtocolMemberAssignment(self.version, _by_topic(tps), b"") for m, tps in kept.items()}

    def on_assignment(self, assignment: ConsumerProtocolMemberAssignment) -> None:
        self.member_assignment = assignment.partitions()

    def remember_generation(self, generation: int) -> None:
        self.generation = generation


def assignor_strategy(assignor: StickyAssignor) -> tuple:
    """Sticky first; round-robin too, so a group with members of an older release still forms."""
    return (assignor, RoundRobinPartitionAssignor)


def generation_of(consumer) -> int:
    """The group generation `consumer` joined last (NO_GENERATION when not known).

    aiokafka has no public accessor: its group coordinator holds it, set before the assignment
    listener runs. Unknown counts as "not the next generation", the safe answer for a hold
    (gpu_workers/handover.py gives its requests up)."""
    generation = getattr(getattr(consumer, "_coordinator", None), "generation", NO_GENERATION)
    return generation if isinstance(generation, int) else NO_GENERATION


def _busy_claim(user_data: bytes) -> tuple[int, set[TopicPartition]]:
    """(generation, busy partitions) a member reported; nothing for user data without them."""
    if not user_data:
        return NO_GENERATION, set()
    try:
        from io import BytesIO

        data = BytesIO(user_data)
        sticky = StickyAssignorUserDataV1.decode(data)
        if data.tell() == len(user_data):
            return sticky.generation, set()
        busy = BusyPartitions.decode(data).busy
    except Exception:  # noqa: BLE001 - a member of another release: its partitions are balanced as usual
        return NO_GENERATION, set()
    return sticky.generation, {TopicPartition(topic, p) for topic, partitions in busy for p in partitions}


def keep_busy(assigned: dict[str, set[TopicPartition]],
              claims: dict[str, tuple[int, set[TopicPartition]]]) -> dict[str, set[TopicPartition]]:
    """`assigned` with every busy partition back with the member that claims it (the latest generation's
    claim wins), the member it was given to taking one of that member's idle partitions instead."""
    out = {m: set(tps) for m, tps in assigned.items()}
    owner = {tp: m for m, tps in out.items() for tp in tps}
    claimant: dict[TopicPartition, tuple[int, str]] = {}
    for member, (generation, busy) in claims.items():
        for tp in busy:
            if member in out and tp in owner and (generation, member) > claimant.get(tp, (NO_GENERATION - 1, "")):
                claimant[tp] = (generation, member)
    busy_anywhere = set(claimant)
    for tp, (_, member) in sorted(claimant.items()):
        given = owner[tp]
        if given == member:
            continue
        out[given].discard(tp)
        out[member].add(tp)
        owner[tp] = member
        spare = next((p for p in sorted(out[member]) if p not in busy_anywhere), None)
        if spare is not None:  # an idle partition in exchange: the counts stay as balance made them
            out[member].discard(spare)
            out[given].add(spare)
            owner[spare] = given
    return out


def _by_topic(tps: set[TopicPartition]) -> list[tuple[str, list[int]]]:
    by_topic: dict[str, list[int]] = {}
    for tp in sorted(tps):
        by_topic.setdefault(tp.topic, []).append(tp.partition)
    return sorted(by_topic.items())
