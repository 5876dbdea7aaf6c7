"""Readiness as an operator (or Kubernetes) asks it: a processor by its group, any role by its URL.

ok, why = group_ready("ts-router", "10.0.0.7")       # a member there holds a partition, Redis answers
ok, why = url_ready("http://127.0.0.1:9400/health/ready")
"""

from __future__ import annotations

import asyncio
import json

from common.config import settings


def group_ready(group: str, host: str, redis: bool = True) -> tuple[bool, str]:
    """Whether a member of `group` on `host` holds a partition (no broker answer: not ready) and, with
    `redis`, Redis answers (every processor keeps its ledger there and holds its input without it)."""
    from tokenstream.ops.lag import member_of

    try:
        ok, why = asyncio.run(member_of(settings().kafka_bootstrap, group, host))
    except Exception as exc:  # noqa: BLE001 - no broker or no coordinator yet: not ready
        ok, why = False, f"the broker could not say ({type(exc).__name__}: {exc})"
    if ok and redis:
        import redis as redis_client

        try:
            redis_client.Redis.from_url(
                settings().redis_url, socket_timeout=2, socket_connect_timeout=2
            ).ping()
        except redis_client.RedisError as exc:
            ok, why = False, f"{why}, but Redis does not answer ({exc}): its input is held"
    return ok, why


def url_ready(url: str) -> tuple[bool, str]:
    """Whether a role's /health/ready answers 200, and its reasons (`describe`)."""
    import httpx

    try:
        answer = httpx.get(url, timeout=5)
    except httpx.HTTPError as exc:
        return False, f"{url} does not answer ({type(exc).__name__}: {exc})"
    detail = describe(json_body(answer.content))
    ok = answer.status_code == 200
    return ok, ("ready" if ok else f"not ready ({answer.status_code})") + (f": {detail}" if detail else "")


def json_body(raw: bytes) -> dict:
    """A health answer's JSON object ({} when the body is not one)."""
    try:
        body = json.loads(raw)
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def describe(body: dict) -> str:
    """One line from a /health/ready body: what is missing, then what is degraded."""
    parts = [str(d) for d in body.get("detail") or []]
    parts += [f"degraded: {d}" for d in body.get("degraded") or []]
    return "; ".join(parts)
