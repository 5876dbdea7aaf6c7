"""What a worker does with its requests while its group rebalances: hold them, then keep or give up.

aiokafka rebalances eagerly: each member's partitions are revoked before the group re-forms, also
those the sticky assignor (producers/sticky.py) then hands straight back. Aborting a revoked
partition's requests made every rebalance (a worker killed, one coming back) re-prefill every
request of every survivor. So a revoked partition is *held* instead:

- its requests go on generating, but nothing of theirs is written: each output waits, in order;
- when the new assignment comes, a partition assigned back in the generation right after the one it
  was last assigned in is *kept*: no other member can have owned it in between (every generation
  since had this member), so its waiting outputs are written and its requests go on;
- a partition assigned back after a skipped generation (a join whose first sync failed bumps the
  generation twice; or this member was expelled for silence) is *checked* against the log: kept if
  the tokens topic holds, for each of its requests, exactly the chunks this worker wrote and no
  completion (nobody else continued them), else lost. Sound because an eager rebalance assigns only
  after every member's revocation returned, and a member's revocation flushes what it wrote: any
  other owner's writes are on the log by then;
- any other held partition is *lost*: it moved. Its requests are aborted and their outputs
  dropped unwritten; the new owner takes them over from the tokens topic, and since nothing was
  written after the revocation began, what it reads there is all there is.

Holding writes nothing for a revoked partition, the guarantee the worker had when it aborted at
once (a token written after the new owner's takeover read gave the log two versions of an answer).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aiokafka.structs import TopicPartition

from gpu_workers.sequence import Output
from producers.sticky import NO_GENERATION


@dataclass
class Settled:
    kept: set[TopicPartition]
    lost: set[TopicPartition]
    waiting: list[Output]  # the kept partitions' held outputs, in the order they were made


@dataclass
class Handover:
    assigned_in: dict[TopicPartition, int] = field(default_factory=dict)  # partition -> its generation
    held: set[TopicPartition] = field(default_factory=set)
    waiting: list[tuple[TopicPartition, Output]] = field(default_factory=list)

    def hold(self, tps: set[TopicPartition]) -> None:
        self.held |= tps

    def holds(self, tp: TopicPartition) -> bool:
        return tp in self.held

    def wait(self, tp: TopicPartition, output: Output) -> None:
        """Keep a held partition's output until the assignment says whether it is written."""
        self.waiting.append((tp, output))

    def sort(self, assigned: set[TopicPartition], generation: int) -> tuple[set, set]:
        """The held partitions assigned back, by what the new assignment (joined in `generation`) makes of
        them: (kept, to check against the log); every other held partition is lost."""
        back = self.held & assigned
        kept = {
            tp
            for tp in back
            if generation != NO_GENERATION and self.assigned_in.get(tp, NO_GENERATION) + 1 == generation
        }
        return kept, back - kept

    def settle(self, assigned: set[TopicPartition], generation: int, kept: set[TopicPartition]) -> Settled:
        """End the hold: `kept` partitions' waiting outputs, in order, to be written; the rest given up."""
        lost = self.held - kept
        waiting = [out for tp, out in self.waiting if tp in kept]
        self.held, self.waiting = set(), []
        self.assigned_in = {tp: generation for tp in assigned}
        return Settled(kept, lost, waiting)
