"""Admission order of waiting requests: higher tiers first, first come first served within a tier.

The engine queues every request it takes in with `enqueue` and admits from the front. A request
goes in front of waiting requests of a lower priority (the API key's tier, carried by
InferenceRequest.priority), so a paid request is admitted at the next free batch slot however many
free-tier requests wait. To keep a flood of high-priority requests from starving the rest forever,
a request that has waited `AGING_S` keeps its place: nothing more is queued ahead of it.
"""

from __future__ import annotations

import time
from collections import deque

from gpu_workers.sequence import Sequence

AGING_S = 30.0


def enqueue(waiting: deque[Sequence], seq: Sequence, now: float | None = None) -> None:
    now = time.time() if now is None else now
    for i, other in enumerate(waiting):
        if other.priority < seq.priority and now - other.arrival < AGING_S:
            waiting.insert(i, seq)
            return
    waiting.append(seq)
