"""Control-plane events: stopping a request, changing routing at run time."""

from __future__ import annotations

import msgspec

from schemas.base import Event


class Cancel(Event, tag="cancel"):
    """Stop generating for request_id; the worker frees its slot and completes it as cancelled."""

    reason: str = "client_disconnected"


class RouteUpdate(Event, tag="route_update"):
    """New routing weights for a requested model name, e.g. {"smollm2": 0.9, "smollm2-v2": 0.1}.

    request_id identifies the change itself (for idempotence and audit).
    """

    model: str
    weights: dict[str, float] = msgspec.field(default_factory=dict)
    fallback: str | None = None
