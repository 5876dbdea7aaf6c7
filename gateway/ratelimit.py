"""Requests and tokens per minute, per API key and per tenant, shared by every gateway instance.

One Lua script per request (one Redis round trip) checks and takes the request and its token
reservation from up to four counters at once (key RPM, key TPM, tenant RPM, tenant TPM), all or
nothing, so N gateways in front of one Redis together admit exactly the limit. Windows are
fixed minutes of the Redis server's clock (`TIME`), so gateways with skewed clocks agree too.

The token reservation is the prompt estimate plus the requested max output; at completion the
difference to the real usage is given back (`settle`), once per request whichever instance sees
the completion, and the same script adds the real usage to the key's daily totals
(`tokenstream keys usage`).

The same script takes one of the key's open-request slots (`max_streams`): a sorted set of the
key's open requests scored by the end of their lease, lapsed ones dropped first, so all gateway
instances together hold at most N at once. The admitting instance renews its requests' leases
(`renew`) and removes each when it ends (`release`); see gateway/inflight.py.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from common.redis_batch import Batched
from gateway import openai_api as api
from schemas import Completion
from schemas import keys as K

# KEYS: 4 bucket prefixes (key requests, key tokens, tenant requests, tenant tokens), the key's
#       open-streams set
# ARGV: their 4 limits (0 = no limit: not counted), tokens to reserve, most open streams (0 = no limit),
#       request id, lease seconds
# returns {admitted 0|1, index of the limit hit (0 if none, 5: open streams), minute number, seconds to its
#          end, used 1..4, open streams}
TAKE = """
local t = redis.call('TIME')
local now = tonumber(t[1])
local window = math.floor(now / 60)
local reset = 60 - (now % 60)
local cost = {1, tonumber(ARGV[5]), 1, tonumber(ARGV[5])}
local used = {}
for i = 1, 4 do
  local limit = tonumber(ARGV[i])
  if limit > 0 then
    local cur = tonumber(redis.call('GET', KEYS[i] .. ':' .. window) or '0')
    used[i] = cur
    if cur + cost[i] > limit then
      return {0, i, window, reset, used[1] or 0, used[2] or 0, used[3] or 0, used[4] or 0, 0}
    end
  end
end
local streams = tonumber(ARGV[6])
local open = 0
local exact = now + tonumber(t[2]) / 1000000
if streams > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', exact)
  open = redis.call('ZCARD', KEYS[5])
  if open >= streams then
    return {0, 5, window, reset, used[1] or 0, used[2] or 0, used[3] or 0, used[4] or 0, open}
  end
end
for i = 1, 4 do
  if tonumber(ARGV[i]) > 0 then
    local k = KEYS[i] .. ':' .. window
    used[i] = redis.call('INCRBY', k, cost[i])
    redis.call('EXPIRE', k, 120)
  end
end
if streams > 0 then
  local lease = tonumber(ARGV[8])
  redis.call('ZADD', KEYS[5], exact + lease, ARGV[7])
  redis.call('EXPIRE', KEYS[5], math.ceil(lease) + 60)
  open = open + 1
end
return {1, 0, window, reset, used[1] or 0, used[2] or 0, used[3] or 0, used[4] or 0, open}
"""

# KEYS: open-streams sets of some keys; ARGV: lease seconds, then per key: how many ids, the request ids
RENEW = """
local t = redis.call('TIME')
local lease = tonumber(ARGV[1])
local till = tonumber(t[1]) + tonumber(t[2]) / 1000000 + lease
local a = 2
for k = 1, #KEYS do
  local n = tonumber(ARGV[a])
  for i = a + 1, a + n do redis.call('ZADD', KEYS[k], 'XX', till, ARGV[i]) end
  redis.call('EXPIRE', KEYS[k], math.ceil(lease) + 60)
  a = a + n + 1
end
return 1
"""

# KEYS: done flag, key tok prefix, tenant tok prefix, usage hash
# ARGV: window, tokens to give back (may be negative: used more than reserved), prompt, completion,
#       cached, flag ttl, usage ttl
# Settles many requests in one call (common/redis_batch.py): 4 keys and 7 arguments each, one result each.
SETTLE = """
local out = {}
for j = 0, #KEYS / 4 - 1 do
  local k, a = 4 * j, 7 * j
  if redis.call('SET', KEYS[k + 1], '1', 'NX', 'EX', tonumber(ARGV[a + 6])) == false then
    out[j + 1] = 0
  else
    local back = tonumber(ARGV[a + 2])
    if back ~= 0 then
      for i = 2, 3 do
        if KEYS[k + i] ~= '' then
          local b = KEYS[k + i] .. ':' .. ARGV[a + 1]
          if redis.call('EXISTS', b) == 1 then redis.call('DECRBY', b, back) end
        end
      end
    end
    local usage = KEYS[k + 4]
    redis.call('HINCRBY', usage, 'requests', 1)
    redis.call('HINCRBY', usage, 'prompt', tonumber(ARGV[a + 3]))
    redis.call('HINCRBY', usage, 'completion', tonumber(ARGV[a + 4]))
    redis.call('HINCRBY', usage, 'cached', tonumber(ARGV[a + 5]))
    redis.call('EXPIRE', usage, tonumber(ARGV[a + 7]))
    out[j + 1] = 1
  end
end
return out
"""

USAGE_TTL_S = 400 * 86400
KINDS = ("requests", "tokens")


def estimate_prompt_tokens(texts: list[str]) -> int:
    """About 4 characters a token, plus a few for each message's template: an upper-ish estimate."""
    return sum(len(t) // 4 + 4 for t in texts)


@dataclass
class Ticket:
    """A request's take from the limits, carried to its completion (also in the request note)."""

    key_id: str
    tenant: str
    window: int = 0
    reserved: int = 0
    key_tpm: bool = False
    tenant_tpm: bool = False
    slot: bool = False  # holds one of the key's open-stream slots
    headers: dict[str, str] = field(default_factory=dict)

    def note(self) -> dict:
        return {
            "key_id": self.key_id,
            "window": self.window,
            "reserved": self.reserved,
            "key_tpm": self.key_tpm,
            "tenant_tpm": self.tenant_tpm,
            "slot": self.slot,
        }


def _headers(limits: list[int], used: list[int], reset_s: int) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers for the tighter of the key's and the tenant's limits."""
    out: dict[str, str] = {}
    for kind, (a, b) in zip(KINDS, ((0, 2), (1, 3))):
        best = None
        for i in (a, b):
            if limits[i] > 0:
                remaining = max(0, limits[i] - used[i])
                if best is None or remaining < best[1]:
                    best = (limits[i], remaining)
        if best is not None:
            out[f"x-ratelimit-limit-{kind}"] = str(best[0])
            out[f"x-ratelimit-remaining-{kind}"] = str(best[1])
            out[f"x-ratelimit-reset-{kind}"] = f"{reset_s}s"
    return out


class RateLimiter:
    def __init__(self, redis, metrics) -> None:
        self.redis = redis
        self.metrics = metrics
        self._take = redis.register_script(TAKE) if redis is not None else None
        self._settle = Batched(redis.register_script(SETTLE), 4, 7) if redis is not None else None
        self._renew = redis.register_script(RENEW) if redis is not None else None

    async def take(
        self, key: K.ApiKey, tokens: int, request_id: str = "", max_streams: int = 0, lease_s: float = 30.0
    ) -> Ticket:
        """Take one request and `tokens` from the key's and tenant's minute, and one of the key's
        `max_streams` open-request slots for `request_id` (0: no limit); 429 when over a limit."""
        ticket = Ticket(
            key.key_id, key.tenant, reserved=tokens, key_tpm=key.tpm > 0, tenant_tpm=key.tenant_tpm > 0
        )
        limits = [key.rpm, key.tpm, key.tenant_rpm, key.tenant_tpm]
        if not any(limits) and max_streams <= 0:
            return ticket
        if self._take is None:
            raise api.unavailable("Rate limits cannot be checked: the gateway has no Redis.")
        buckets = [
            K.rate_bucket("key", key.key_id, "requests"),
            K.rate_bucket("key", key.key_id, "tokens"),
            K.rate_bucket("tenant", key.tenant, "requests"),
            K.rate_bucket("tenant", key.tenant, "tokens"),
            K.open_streams(key.key_id),
        ]
        started = time.perf_counter()
        try:
            admitted, failed, window, reset, *used, open_now = await self._take(
                keys=buckets, args=[*limits, tokens, max(0, max_streams), request_id, lease_s]
            )
        except Exception:  # noqa: BLE001
            raise api.unavailable("Rate limits cannot be checked right now (Redis unreachable).") from None
        finally:
            self.metrics.ratelimit_seconds.observe(time.perf_counter() - started)
        used = [int(u) for u in used]
        ticket.window, ticket.headers = int(window), _headers(limits, used, int(reset))
        if max_streams > 0 and int(failed) in (0, 5):
            ticket.headers["x-tokenstream-limit-streams"] = str(max_streams)
            ticket.headers["x-tokenstream-open-streams"] = str(int(open_now))
        if int(failed) == 5:
            self.metrics.rate_limited.labels("streams").inc()
            raise api.APIError(
                429,
                f"This API key already has {int(open_now)} requests open, its limit at once "
                f"({max_streams}); retry when one of them has ended.",
                "rate_limit_exceeded",
                code="too_many_concurrent_requests",
                headers={**ticket.headers, "Retry-After": "1"},
            )
        ticket.slot = max_streams > 0
        if not admitted:
            failed = int(failed) - 1
            scope = "API key" if failed < 2 else f"tenant {key.tenant}"
            kind = KINDS[failed % 2]
            self.metrics.rate_limited.labels(kind).inc()
            if kind == "tokens" and tokens > limits[failed]:
                raise api.APIError(
                    429,
                    f"This request needs about {tokens} tokens (prompt estimate plus "
                    f"max_tokens), more than the {scope}'s limit of {limits[failed]} tokens "
                    "per minute; lower max_tokens.",
                    "rate_limit_exceeded",
                    code="rate_limit_exceeded",
                    headers=ticket.headers,
                )
            retry = max(1, math.ceil(int(reset)))
            raise api.APIError(
                429,
                f"Rate limit reached for the {scope}: {limits[failed]} {kind} per minute "
                f"(used {used[failed]}); retry after {retry}s.",
                "rate_limit_exceeded",
                code="rate_limit_exceeded",
                headers={**ticket.headers, "Retry-After": str(retry)},
            )
        return ticket

    async def renew(self, slots: dict[str, list[str]], lease_s: float) -> None:
        """Extend the leases of open requests, {key id: [request id, ...]}, by `lease_s` from now."""
        if self._renew is None or not slots:
            return
        args: list = [lease_s]
        for rids in slots.values():
            args += [len(rids), *rids]
        await self._renew(keys=[K.open_streams(key_id) for key_id in slots], args=args)

    async def release(self, request_id: str, note: dict) -> None:
        """Free the open-request slot `request_id` holds (if it holds one)."""
        if self.redis is not None and note.get("slot") and note.get("key_id"):
            await self.redis.zrem(K.open_streams(note["key_id"]), request_id)

    async def settle_answer(self, request_id: str, note: dict, done: Completion) -> bool:
        """`settle` with the usage of the request's Completion (all of it cached for a cache hit)."""
        usage = done.usage
        return await self.settle(
            request_id,
            note,
            usage.prompt_tokens,
            usage.completion_tokens,
            usage.total_tokens if note.get("cached") else 0,
        )

    async def settle(
        self, request_id: str, note: dict, prompt: int, completion: int, cached: int = 0
    ) -> bool:
        """Give back what was reserved but not used and add the usage to the key's day; once per request."""
        if self._settle is None or not note.get("key_id"):
            return False
        back = int(note.get("reserved", 0)) - (prompt + completion) if note.get("window") else 0
        keys = [
            K.usage_settled(request_id),
            K.rate_bucket("key", note["key_id"], "tokens") if note.get("key_tpm") else "",
            K.rate_bucket("tenant", note.get("tenant", ""), "tokens") if note.get("tenant_tpm") else "",
            K.usage(note["key_id"], K.usage_day()),
        ]
        try:
            return bool(
                await self._settle(
                    keys=keys,
                    args=[note.get("window", 0), back, prompt, completion, cached, 86400, USAGE_TTL_S],
                )
            )
        except Exception:  # noqa: BLE001 - usage is best effort when Redis is away
            return False
