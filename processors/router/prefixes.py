"""Prefix-aware routing (pure): which partition of a model's inference topic a conversation's next turn
goes to, from what the workers announce on ts.kv.prefixes (schemas/routing.py).

A request whose messages before its last one name a prefix some worker holds goes to one of that
worker's partitions, unless the worker is overloaded (as many requests waiting as it runs at most)
or silent (no heartbeat for `stale_s`: dead, or cut off); otherwise, and for every first turn, the
partition is left to the key (the request id), as without this. Which of the holder's partitions
is fixed by the request id, so a replay routes as the first run did while the map is the same.

A request with a cache key (the client's prompt_cache_key) that no known prefix places goes to the
partition its tenant, model and key name: requests sharing a key (a long common system prompt, a
document asked about many times) meet on one worker, whose prefix cache holds that prompt once.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass

from schemas import InferenceRequest, PrefixHeld, WorkerLoad, conversation_digest


@dataclass(frozen=True)
class Placement:
    partition: int | None  # None: the key decides
    # "prefix", "cache-key", "no-prefix", "holder-overloaded", "holder-silent", "first-turn", "off"
    reason: str
    worker_id: str = ""


class PrefixMap:
    def __init__(self, max_prefixes: int = 200_000, stale_s: float = 5.0) -> None:
        self.holders: OrderedDict[str, tuple[str, str]] = OrderedDict()  # digest -> (model, worker_id)
        self.loads: dict[
            tuple[str, str], tuple[WorkerLoad, float]
        ] = {}  # (model, worker) -> (load, heard at)
        self.max_prefixes, self.stale_s = max_prefixes, stale_s

    def apply(self, event: PrefixHeld | WorkerLoad, now: float | None = None) -> None:
        if isinstance(event, PrefixHeld):
            self.holders[event.digest] = (event.model, event.worker_id)
            self.holders.move_to_end(event.digest)
            while len(self.holders) > self.max_prefixes:
                self.holders.popitem(last=False)
        else:
            self.loads[(event.model, event.worker_id)] = (event, now if now is not None else time.time())

    def place(self, request: InferenceRequest, target: str, now: float | None = None) -> Placement:
        """Where `request`, routed to model `target`, should go by the prefixes held."""
        if len(request.messages) < 3:  # no earlier answer: nothing of it can be cached anywhere
            return Placement(None, "first-turn")
        digest = conversation_digest(request.tenant, target, list(request.messages[:-1]))
        holder = self.holders.get(digest)
        if holder is None or holder[0] != target:
            return Placement(None, "no-prefix")
        seen = self.loads.get(holder)
        now = now if now is not None else time.time()
        if seen is None or now - seen[1] > self.stale_s or not seen[0].partitions:
            return Placement(None, "holder-silent", holder[1])
        load = seen[0]
        if load.waiting >= load.max_running:
            return Placement(None, "holder-overloaded", holder[1])
        pick = int.from_bytes(hashlib.sha256(request.request_id.encode()).digest()[:8], "big")
        return Placement(load.partitions[pick % len(load.partitions)], "prefix", holder[1])


def by_cache_key(place: Placement, request: InferenceRequest, target: str, partitions: int) -> Placement:
    """`place`, or where the request's cache key sends it when no prefix placed it: the partition its
    tenant, model and key name (keys of different tenants meet only by chance)."""
    if place.partition is not None or not request.cache_key or partitions < 1:
        return place
    name = hashlib.sha256(b"\0".join(part.encode() for part in (request.tenant, target, request.cache_key)))
    return Placement(int.from_bytes(name.digest()[:8], "big") % partitions, "cache-key", place.worker_id)
