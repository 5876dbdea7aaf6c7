"""Redis keys the roles share, with how long each lives.

    ts:gateway:req:<request_id>              JSON notes a resume on any gateway needs (model,
                                             created, include_usage); GATEWAY_META_TTL_S
    ts:gateway:attach:<request_id>           attachment generation of the connection serving the
                                             request (cancel after a disconnect); GATEWAY_ATTACH_TTL_S
    ts:done:<role>:<effect>:<request_id>     an effect a processor has emitted for the request
                                             (idempotence after a restart); EFFECT_TTL_S
    ts:tool:{claim,result,published}:<call_id>
                                             the tool processor's once-per-call record (below)
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


# The tool processor (tools/ledger.py): one call id, run to completion at most once.
#   ts:tool:claim:<call_id>       the processor running the call (its instance id); a lease of
#                                 TOKENSTREAM_TOOLS_CLAIM_LEASE_S,
#                                 renewed while it runs, so a dead processor's claim lapses
#   ts:tool:result:<call_id>      the encoded ToolResult once the call completed; EFFECT_TTL_S
#   ts:tool:published:<call_id>   set once that result is acknowledged on ts.tool.results; EFFECT_TTL_S
def tool_claim(call_id: str) -> str:
    return f"ts:tool:claim:{call_id}"


def tool_result(call_id: str) -> str:
    return f"ts:tool:result:{call_id}"


def tool_published(call_id: str) -> str:
    return f"ts:tool:published:{call_id}"
