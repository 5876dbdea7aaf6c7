"""API key administration in Redis: create, list, revoke, read usage (the `tokenstream keys` commands).

Keys are stored hashed (sha256); the secret is returned once by `create` and never again.
"""

from __future__ import annotations

import datetime as dt
import re
import time

import redis

from common.config import settings
from schemas import keys as K

_DURATION = re.compile(r"^(\d+)([smhdw])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_expiry(value: str | None, now: float | None = None) -> float:
    """'30d', '12h', '90m' (from now) or an ISO date/time (UTC if no zone) -> epoch seconds; None/'' -> 0."""
    if not value:
        return 0.0
    now = time.time() if now is None else now
    m = _DURATION.match(value.strip())
    if m:
        return now + int(m.group(1)) * _UNITS[m.group(2)]
    try:
        when = dt.datetime.fromisoformat(value.strip())
    except ValueError:
        raise ValueError(f"--expires: {value!r} is neither a duration like 30d/12h nor an ISO date") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.timestamp()


class KeyStore:
    def __init__(self, redis_url: str) -> None:
        self.r = redis.Redis.from_url(redis_url, socket_timeout=5, socket_connect_timeout=5)

    def create(
        self,
        tenant: str,
        *,
        tier: str = "free",
        name: str = "",
        rpm: int = 0,
        tpm: int = 0,
        tenant_rpm: int = 0,
        tenant_tpm: int = 0,
        max_streams: int = 0,
        expires: str | None = None,
        admin: bool = False,
        exact_cache: bool = True,
        semantic_cache: bool = False,
    ) -> tuple[str, K.ApiKey]:
        """A new key: (the secret, shown once; its record), at home in this deployment's region (the
        store is the region's: TOKENSTREAM_REDIS_URL)."""
        if not K.TENANT_PATTERN.match(tenant):
            raise ValueError("tenant: 1-64 characters of letters, digits, '_', '.', '-'")
        if tier not in K.TIERS:
            raise ValueError(f"tier: one of {', '.join(K.TIERS)}")
        if min(rpm, tpm, tenant_rpm, tenant_tpm) < 0:
            raise ValueError("limits must be >= 0 (0: unlimited)")
        if max_streams < -1:
            raise ValueError(
                "max_streams: a number of open requests, 0 for the tier's default, -1 for no limit"
            )
        secret = K.new_secret()
        h = K.digest(secret)
        record = K.ApiKey(
            key_id=h[:16],
            tenant=tenant,
            tier=tier,
            name=name,
            rpm=rpm,
            tpm=tpm,
            tenant_rpm=tenant_rpm,
            tenant_tpm=tenant_tpm,
            max_streams=max_streams,
            expires_at=parse_expiry(expires),
            created_at=time.time(),
            admin=admin,
            exact_cache=exact_cache,
            semantic_cache=semantic_cache,
            region=settings().region,
        )
        pipe = self.r.pipeline()
        pipe.hset(K.api_key(h), mapping=record.to_redis())
        pipe.sadd(K.API_KEYS, h)
        pipe.execute()
        return secret, record

    def get(self, secret: str) -> K.ApiKey | None:
        raw = self.r.hgetall(K.api_key(K.digest(secret)))
        return K.ApiKey.from_redis(raw) if raw else None

    def all(self) -> list[tuple[str, K.ApiKey]]:
        """(sha256, record) of every key, oldest first."""
        hashes = sorted(h.decode() for h in self.r.smembers(K.API_KEYS))
        pipe = self.r.pipeline()
        for h in hashes:
            pipe.hgetall(K.api_key(h))
        out = [(h, K.ApiKey.from_redis(raw)) for h, raw in zip(hashes, pipe.execute()) if raw]
        return sorted(out, key=lambda item: item[1].created_at)

    def find(self, key_id: str) -> str | None:
        """The sha256 of the key whose id (or secret) is given."""
        if key_id.startswith(K.KEY_PREFIX):
            h = K.digest(key_id)
            return h if self.r.exists(K.api_key(h)) else None
        matches = [h for h, rec in self.all() if rec.key_id == key_id]
        return matches[0] if len(matches) == 1 else None

    def revoke(self, key_id: str) -> K.ApiKey | None:
        h = self.find(key_id)
        if h is None:
            return None
        self.r.hset(K.api_key(h), "revoked_at", str(time.time()))
        return K.ApiKey.from_redis(self.r.hgetall(K.api_key(h)))

    def usage(self, days: int = 7, now: float | None = None) -> list[tuple[str, K.ApiKey, dict[str, int]]]:
        """(day, key, counts) for each key with any use on the last `days` days, newest day first."""
        now = time.time() if now is None else now
        day_names = [K.usage_day(now - i * 86400) for i in range(days)]
        records = [rec for _, rec in self.all()]
        pipe = self.r.pipeline()
        for day in day_names:
            for rec in records:
                pipe.hgetall(K.usage(rec.key_id, day))
        raws = iter(pipe.execute())
        out = []
        for day in day_names:
            for rec in records:
                raw = next(raws)
                if raw:
                    out.append((day, rec, {k.decode(): int(v) for k, v in raw.items()}))
        return out
