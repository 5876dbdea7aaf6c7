"""Control-plane events: stopping a request, changing routing at run time, a candidate model's shadow gate."""

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


class ShadowGate(Event, tag="shadow_gate"):
    """The outcome of a shadow evaluation (`tokenstream shadow`): `candidate` answered the requests
    `served` answered between `since` and `until` (seconds since the epoch; `tenant` "" for every
    tenant), never to a client, and agreed with what was served as `figures` say (agreement,
    similarity, tool_agreement, safety_changes, ttft_ratio, tokens_per_s_ratio). `passed`: every
    condition of `require` (e.g. "agreement>=0.9") held. `tokenstream route set` asks for a passed
    gate before it sends any traffic to a model other than the requested one.

    request_id identifies the evaluation (its replayed requests name it in `shadow_of`'s run).
    """

    candidate: str
    served: str
    since: float
    until: float
    requests: int
    figures: dict[str, float] = msgspec.field(default_factory=dict)
    require: list[str] = msgspec.field(default_factory=list)
    passed: bool = False
