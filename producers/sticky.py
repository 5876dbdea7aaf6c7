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

    assignor = StickyAssignor()
    consumer = await start_consumer(group=..., partition_assignment_strategy=assignor_strategy(assignor))
    ...on_partitions_assigned: assignor.remember_generation(generation_of(consumer))
"""

from __future__ import annotations

from aiokafka.coordinator.assignors.roundrobin import RoundRobinPartitionAssignor
from aiokafka.coordinator.assignors.sticky.sticky_assignor import StickyPartitionAssignor
from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment, ConsumerProtocolMemberMetadata
from aiokafka.structs import TopicPartition

NO_GENERATION = -1


class StickyAssignor(StickyPartitionAssignor):
    """aiokafka's sticky assignor with this consumer's own state (not the class's) and its true generation."""

    def __init__(self) -> None:
        self.member_assignment: list[TopicPartition] | None = None
        self.generation = NO_GENERATION

    def metadata(self, topics) -> ConsumerProtocolMemberMetadata:  # what this member tells the group's leader
        return self._metadata(topics, self.member_assignment, self.generation)

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
