"""Who is asking: the API key of `Authorization: Bearer sk-ts-...`, looked up hashed in Redis.

`principal` is the FastAPI dependency every API route takes; the tenant and tier of a request
come from the key's record only. No key, an unknown, revoked or expired one: 401 in OpenAI's
shape (`invalid_api_key`). Redis unreachable: 503 (a key that cannot be checked is not trusted).
"""

from __future__ import annotations

import asyncio

from fastapi import Depends, Request

from gateway import openai_api as api
from gateway.deps import pipeline
from gateway.pipeline import Gateway
from schemas import keys as K


def invalid_key(message: str) -> api.APIError:
    return api.APIError(
        401, message, "invalid_request_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
    )


def _masked(secret: str) -> str:
    return secret[:8] + "..." + secret[-4:] if len(secret) > 16 else "***"


async def principal(request: Request, gw: Gateway = Depends(pipeline)) -> K.ApiKey:
    return await key_of(request.headers.get("authorization", ""), gw)


async def key_of(header: str, gw: Gateway) -> K.ApiKey:
    """The API key an `Authorization` header names (a 401 or 503 APIError otherwise)."""
    scheme, _, secret = header.partition(" ")
    secret = secret.strip()
    if scheme.lower() != "bearer" or not secret:
        raise invalid_key(
            "You didn't provide an API key. Send it as `Authorization: Bearer sk-ts-...` "
            "(create one with `tokenstream keys create --tenant NAME`)."
        )
    if gw.redis is None:
        raise api.unavailable("API keys cannot be checked: the gateway has no Redis.")
    try:
        raw = await _record(gw, K.digest(secret))
    except Exception:  # noqa: BLE001
        raise api.unavailable("API keys cannot be checked right now (Redis unreachable).") from None
    if not raw:
        raise invalid_key(f"Incorrect API key provided: {_masked(secret)}.")
    record = K.ApiKey.from_redis(raw)
    problem = record.problem()
    if problem is not None:
        state = "been revoked" if problem == "revoked" else "expired"
        raise invalid_key(f"The API key {record.key_id} has {state}.")
    return record


async def _record(gw: Gateway, digest: str) -> dict:
    """The key's record; lookups of one key while another is in flight share its round trip (a burst
    of a thousand requests with one key costs one HGETALL), so the answer is never older than one."""
    pending = gw.key_lookups.get(digest)
    if pending is None:
        pending = asyncio.ensure_future(gw.redis.hgetall(K.api_key(digest)))
        gw.key_lookups[digest] = pending
        pending.add_done_callback(lambda done: _forget(gw, digest, done))
    return await asyncio.shield(pending)  # a waiter that goes away leaves the lookup to the others


def _forget(gw: Gateway, digest: str, done: asyncio.Future) -> None:
    gw.key_lookups.pop(digest, None)
    if not done.cancelled():
        done.exception()  # retrieved here, so a lookup every waiter left is not reported unretrieved


async def admin(key: K.ApiKey = Depends(principal)) -> K.ApiKey:
    """Operator endpoints (/metrics): a key created with --admin."""
    if not key.admin:
        raise api.APIError(
            403,
            "This endpoint needs an admin key (`tokenstream keys create --admin`).",
            "invalid_request_error",
            code="insufficient_permissions",
        )
    return key
