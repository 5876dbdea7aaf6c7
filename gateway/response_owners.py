"""Whose a response is: the owner checks of every route that names a response id, and the one answer
for an id the caller does not own (gateway/routes/responses.py, response_inputs.py, responses_ws.py).

A response's owner is the tenant noted at admission (Gateway.admitted); nothing tells an id no gateway
made from another tenant's, an expired or a deleted one: each is the same 404, and as
`previous_response_id` the same 400 `previous_response_not_found`.
"""

from __future__ import annotations

from gateway import openai_api as api
from gateway.pipeline import Gateway
from schemas.ids import run_id_of


def no_response(response: str) -> api.APIError:
    """The one answer for a response id the caller does not own, whatever its shape: an id no gateway
    made, another tenant's, an expired or deleted one alike (nothing tells them apart)."""
    return api.not_found(f"No response with id {response!r}.")


def no_previous_response(response: str) -> api.APIError:
    """`previous_response_id` naming a response the caller cannot continue (unknown, not its own, or
    made with store false): the specification's previous_response_not_found, the same for each."""
    return api.APIError(
        400,
        f"Previous response with id {response!r} not found.",
        "invalid_request_error",
        param="previous_response_id",
        code="previous_response_not_found",
    )


def response_run_id(response: str) -> str:
    try:
        return run_id_of(response)
    except ValueError:
        raise no_response(response) from None


async def owned_response(gw: Gateway, rid: str, response: str, tenant: str) -> dict:
    meta = await gw.recall(rid)
    if meta == {}:
        raise api.unavailable("The owner of this response cannot be checked right now (Redis unreachable).")
    if meta is None or meta.get("tenant") != tenant or "run" not in meta:
        raise no_response(response)
    return meta


async def previous_response(gw: Gateway, response: str, tenant: str, unstored: frozenset[str]) -> dict:
    """The response a request continues: the caller's own, stored, or one of `unstored` (store false
    responses its WebSocket connection made); any other is previous_response_not_found."""
    try:
        before = await owned_response(gw, response_run_id(response), response, tenant)
    except api.APIError as exc:
        if exc.status == 404:
            raise no_previous_response(response) from None
        raise
    if not before.get("store") and response not in unstored:
        raise no_previous_response(response)
    return before
