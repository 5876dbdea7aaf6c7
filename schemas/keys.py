"""Redis keys the roles share, with how long each lives.

    ts:gateway:req:<request_id>              JSON notes a resume on any gateway needs (model,
                                             created, include_usage); GATEWAY_META_TTL_S
    ts:gateway:attach:<request_id>           attachment generation of the connection serving the
                                             request (cancel after a disconnect); GATEWAY_ATTACH_TTL_S
    ts:done:<role>:<effect>:<request_id>     an effect a processor has emitted for the request
                                             (idempotence after a restart); EFFECT_TTL_S
"""

from __future__ import annotations

GATEWAY_META_TTL_S = 24 * 3600
GATEWAY_ATTACH_TTL_S = 24 * 3600
EFFECT_TTL_S = 7 * 24 * 3600  # as long as the processors' input topics keep their events


def gateway_request(request_id: str) -> str:
    return f"ts:gateway:req:{request_id}"


def gateway_attachment(request_id: str) -> str:
    return f"ts:gateway:attach:{request_id}"


def effect_done(role: str, effect: str, request_id: str) -> str:
    return f"ts:done:{role}:{effect}:{request_id}"
