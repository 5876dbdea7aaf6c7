"""The routing decision (pure): tier, then canary weights, then overflow on load."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from processors.router.config import Route


@dataclass(frozen=True)
class Decision:
    target: str
    reason: str  # "tier", "weights", "overflow"


def weighted_pick(request_id: str, weights: dict[str, float]) -> str:
    """A target drawn with probability proportional to its weight, fixed by the request id.

    Hashing the id (not a random draw) gives the same answer when a request is processed
    again, so a replay routes exactly as the first run did.
    """
    total = sum(w for w in weights.values() if w > 0)
    if total <= 0:
        raise ValueError("route has no positive weight")
    point = int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "big") / 2**64 * total
    for target, weight in sorted(weights.items()):
        if weight <= 0:
            continue
        if point < weight:
            return target
        point -= weight
    return max(weights, key=weights.get)  # float rounding at the very top


#: A request of the lowest priority overflows to the fallback only while the fallback's own wait is
#: under this share of the budget, so that under sustained load the fallback's room goes to higher tiers.
LOW_PRIORITY_FALLBACK_SHARE = 0.5


def decide(
    request_id: str,
    model: str,
    route: Route | None,
    tier: str,
    waits: dict[str, float],
    budget_s: float,
    priority: int = 0,
) -> Decision:
    route = route or Route()
    fallback_budget = budget_s if priority > 0 else budget_s * LOW_PRIORITY_FALLBACK_SHARE
    if tier in route.tiers:
        target, reason = route.tiers[tier], "tier"
    else:
        target, reason = weighted_pick(request_id, route.weights or {model: 1.0}), "weights"
    fallback = route.fallback
    if (
        fallback
        and fallback != target
        and waits.get(target, 0.0) > budget_s
        and waits.get(fallback, 0.0) <= fallback_budget
    ):
        return Decision(fallback, "overflow")
    return Decision(target, reason)
