"""The keyring every role seals and opens a tenant's content with (crypto-shredding; schemas/sealing.py).

Keys: one random AES-256 key per (tenant, conversation), or per tenant for content outside any
conversation, made by the first writer and held in the durable Redis (noeviction, append-only):

    ts:seal:key:<key id>          hash: tenant, scope, key (32 bytes), created_at
    ts:seal:current:<tenant>:<scope>  the key id new content of that scope is sealed with
    ts:seal:tenant:<tenant>       set: every key id of the tenant (what `erase --tenant` destroys)

A sealed value is `s1.<key id>.<base64url(nonce | AES-GCM ciphertext and tag)>`: AES-GCM from the
`cryptography` package (OpenSSL), a 96-bit random nonce per value. Destroying the key hash erases every
value sealed with it, wherever copies of it lie; the key id is never reused.

A process keeps the keys it used or was sent: the maker publishes each new key and `erase` each destroyed
one (common/key_feed.py), so a role usually holds a conversation's key before its first event arrives, and
drops a destroyed one at once. A key taken in while that feed is live is held for as long as it stays live
(up to `HELD_S`); any other for `KEY_TTL_S` seconds, so a key destroyed by `tokenstream erase` stops
opening anything in every running role at once, or within that TTL where a role's feed was down; a new
process never sees it again. A key nobody sent is fetched: one round trip to the durable Redis (then
held); a Redis outage raises SealingUnavailable, which a reader treats as the outage it is (never as bad
input).

No fetch runs on an event loop (common/unblocked.py): code on a loop seals and opens through
`unblocked(work, ...)` (or `patiently`, which uses it), where a key not held is fetched in a thread while
the loop goes on, then the work runs again with it; a loop reading a batch of records calls `hold_keys`
first, which fetches every key the batch lacks in one thread hop. Code off any loop (threads, CLIs,
tests) fetches where it stands. A fetch still made on a loop, outside both, is logged once per process.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import redis
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from common.config import settings
from common.key_feed import CHANNEL, KeyFeed, destroyed_message, made_message
from common.unblocked import held_only, needed, unblocked  # noqa: F401 - held_only re-exported
from schemas.codec import sealer as installed_sealer
from schemas.codec import use_sealer
from schemas.errors import MalformedEvent
from schemas.sealing import SEALED_PREFIX, KeyNotHeld, SealingUnavailable  # noqa: F401 - re-exported

log = logging.getLogger(__name__)
T = TypeVar("T")

KEY_TTL_S = 10.0  # a key held outside a live feed: how late an erasure may reach a running role
HELD_S = 600.0  # a key taken in while the feed is live, for as long as it stays live
MAX_HELD = 100_000  # keys a process holds at most (the oldest go first)
PREFIX = "s1"

# One round trip: the scope's current key (made and published if there is none) and its material. (The key
# hash of an existing current key is named inside the script: fine on one Redis, not on a Redis Cluster.)
_MAKE = """
local current = redis.call('GET', KEYS[1])
if current then return {current, redis.call('HGET', 'ts:seal:key:' .. current, 'key')} end
redis.call('HSET', KEYS[2], 'tenant', ARGV[2], 'scope', ARGV[3], 'key', ARGV[4], 'created_at', ARGV[5])
redis.call('SET', KEYS[1], ARGV[1])
redis.call('SADD', KEYS[3], ARGV[1])
redis.call('PUBLISH', ARGV[6], ARGV[7])
return {ARGV[1], ARGV[4]}
"""


def key_hash(key_id: str) -> str:
    return f"ts:seal:key:{key_id}"


def current_key(tenant: str, scope: str) -> str:
    return f"ts:seal:current:{tenant}:{scope}"


def tenant_keys(tenant: str) -> str:
    return f"ts:seal:tenant:{tenant}"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class Keyring:
    """Seals and opens values with keys held in the durable Redis (the codec's `Sealer`).

    `feed=False` leaves out the key feed: every key then holds for `ttl_s` only (tests of the TTL)."""

    def __init__(self, url: str, ttl_s: float = KEY_TTL_S, timeout_s: float = 2.0, feed: bool = True) -> None:
        self.redis = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.ttl_s = ttl_s
        self._make = self.redis.register_script(_MAKE)
        self._writing: dict[tuple[str, str], tuple[str, AESGCM, float]] = {}
        self._reading: dict[str, tuple[AESGCM | None, float]] = {}
        self._erased: dict[
            str, None
        ] = {}  # key ids destroyed (never reused): a late fetch must not revive one
        self._lock = threading.Lock()  # sealing runs on event loops, in worker threads and in the feed's
        self.feed = KeyFeed(self.redis, self._pushed, self._destroyed) if feed else None

    def close(self) -> None:
        if self.feed is not None:
            self.feed.close()

    # -- the codec's Sealer --------------------------------------------------------------------------

    def seal(self, tenant: str, scope: str, plaintext: bytes) -> str:
        key_id, aead = self._write_key(tenant, scope)
        nonce = os.urandom(12)
        return f"{PREFIX}.{key_id}.{_b64(nonce + aead.encrypt(nonce, plaintext, key_id.encode()))}"

    def open(self, token: str) -> bytes | None:
        parts = token.split(".", 2)
        if len(parts) != 3 or parts[0] != PREFIX:
            raise MalformedEvent(f"malformed event: {token[:24]!r} is not a sealed value")
        _, key_id, body = parts
        aead = self._read_key(key_id)
        if aead is None:
            return None
        try:
            raw = _unb64(body)
            return aead.decrypt(raw[:12], raw[12:], key_id.encode())
        except (ValueError, InvalidTag) as exc:  # altered or cut: bad input, dead-lettered like any other
            raise MalformedEvent(
                f"malformed event: a sealed value under key {key_id} does not open ({type(exc).__name__})"
            ) from exc

    # -- keys ------------------------------------------------------------------------------------------

    def _fresh(self, stamp: float, now: float) -> bool:
        """Whether a key held since `stamp` may still be used without asking the store."""
        if now - stamp < self.ttl_s:
            return True
        since = self.feed.live_since() if self.feed is not None else None
        return since is not None and stamp >= since and now - stamp < HELD_S

    def _write_key(self, tenant: str, scope: str) -> tuple[str, AESGCM]:
        held = self._writing.get((tenant, scope))
        if held is not None and self._fresh(held[2], time.monotonic()):
            return held[0], held[1]
        return needed(self, (tenant, scope), lambda: self._fetch_write(tenant, scope))

    def _fetch_write(self, tenant: str, scope: str) -> tuple[str, AESGCM]:
        """The current key of (tenant, scope) from the store, made there if there is none (blocking)."""
        now = time.monotonic()
        held = self._writing.get((tenant, scope))
        fresh_id, material = os.urandom(8).hex(), os.urandom(32)
        try:
            key_id, material = self._make(
                keys=[current_key(tenant, scope), key_hash(fresh_id), tenant_keys(tenant)],
                args=[
                    fresh_id,
                    tenant,
                    scope,
                    material,
                    str(time.time()),
                    CHANNEL,
                    made_message(fresh_id, tenant, scope, material),
                ],
            )
            key_id = key_id.decode() if isinstance(key_id, bytes) else key_id
        except redis.RedisError as exc:
            if held is not None:  # nobody can destroy a key while the store is away: keep using it
                return held[0], held[1]
            raise SealingUnavailable(f"the keyring (durable Redis) is unreachable: {exc}") from exc
        if (
            material is None or key_id in self._erased
        ):  # destroyed while fetched: the next seal makes a new one
            raise SealingUnavailable(
                f"the key {key_id} of {tenant}/{scope} was destroyed while it was fetched"
            )
        aead = AESGCM(material)
        with self._lock:
            self._hold(key_id, tenant, scope, aead, now)
        return key_id, aead

    def _read_key(self, key_id: str) -> AESGCM | None:
        held = self._reading.get(key_id)
        if held is not None and self._fresh(held[1], time.monotonic()):
            return held[0]
        return needed(self, key_id, lambda: self._fetch_read(key_id))

    def _fetch_read(self, key_id: str) -> AESGCM | None:
        """The key `key_id` from the store, None when destroyed (blocking)."""
        now = time.monotonic()
        held = self._reading.get(key_id)
        try:
            material, tenant, scope = self.redis.hmget(key_hash(key_id), "key", "tenant", "scope")
        except redis.RedisError as exc:
            if held is not None:  # as in _write_key: a key held stays usable while the store is away
                return held[0]
            raise SealingUnavailable(f"the keyring (durable Redis) is unreachable: {exc}") from exc
        with self._lock:
            if material is None or key_id in self._erased:
                _put(self._reading, key_id, (None, now))
                return None
            aead = AESGCM(material)
            # a live key is its scope's current one: a role answering what it read seals with it without
            # asking again (the worker's tokens, the router's forward)
            self._hold(key_id, tenant.decode(), scope.decode(), aead, now, replace=False)
        return aead

    def _hold(
        self, key_id: str, tenant: str, scope: str, aead: AESGCM, now: float, replace: bool = True
    ) -> None:
        """Keep a live key for reading, and as its scope's key for writing (under the lock)."""
        _put(self._reading, key_id, (aead, now))
        held = self._writing.get((tenant, scope))
        if replace or held is None or not self._fresh(held[2], now):
            _put(self._writing, (tenant, scope), (key_id, aead, now))

    def _pushed(self, key_id: str, tenant: str, scope: str, material: bytes) -> None:
        """The feed heard a new key: its scope's current one from now on."""
        with self._lock:
            if key_id not in self._erased:
                self._hold(key_id, tenant, scope, AESGCM(material), time.monotonic())

    def _destroyed(self, key_ids: list[str]) -> None:
        """The feed heard keys destroyed: nothing they sealed opens here any more."""
        now = time.monotonic()
        with self._lock:
            for key_id in key_ids:
                _put(self._erased, key_id, None)
                _put(self._reading, key_id, (None, now))
            for scope, held in list(self._writing.items()):
                if held[0] in key_ids:
                    del self._writing[scope]

    def not_held(self, values: Iterable[bytes | None]) -> set[str]:
        """The key ids the sealed events among `values` are sealed with and this process does not hold."""
        now, wanted = time.monotonic(), set()
        for value in values:
            if not value or not value.startswith(SEALED_PREFIX):
                continue
            parts = value[len(SEALED_PREFIX) : len(SEALED_PREFIX) + 64].split(b".", 2)
            if len(parts) < 3 or parts[0] != PREFIX.encode():
                continue  # not a sealed value: its decode says so
            key_id = parts[1].decode("ascii", "replace")
            held = self._reading.get(key_id)
            if held is None or not self._fresh(held[1], now):
                wanted.add(key_id)
        return wanted

    def fetch(self, key_ids: Iterable[str]) -> None:
        """Fetch the keys `key_ids` from the store (blocking: off the loop), then hold them."""
        for key_id in key_ids:
            self._fetch_read(key_id)


async def hold_keys(records: Iterable[Any]) -> None:
    """Hold the keys of the sealed events among `records` (Kafka records), each one not held fetched in
    one thread hop: the batch then decodes on the loop without a round trip (a scan that decodes every
    record). An unreachable store raises SealingUnavailable, as the decode would; nothing to do without a
    keyring installed (the codec's)."""
    keys = installed_sealer()
    if not isinstance(keys, Keyring):
        return
    wanted = keys.not_held(r.value for r in records)
    if wanted:
        await asyncio.to_thread(keys.fetch, wanted)


def _put(held: dict, key, value) -> None:
    """`held[key] = value` as the newest entry, the oldest dropped past MAX_HELD."""
    held.pop(key, None)
    held[key] = value
    while len(held) > MAX_HELD:
        del held[next(iter(held))]


# -- values kept in the stores (not events): file and audio bytes, stored responses, cache entries -----

STORED = b"\x00sealed:"  # what a sealed stored value starts with (no text, JSON or media file does)


def seal_stored(tenant: str, scope: str, data: bytes) -> bytes:
    """`data` as a store keeps it: sealed with the key of (tenant, scope) when sealing is on."""
    keys = keyring()
    return data if keys is None else STORED + keys.seal(tenant, scope, data).encode("ascii")


def open_stored(value: bytes | None) -> bytes | None:
    """A value written by `seal_stored` (or before sealing was on), None when absent or erased."""
    if value is None or not value.startswith(STORED):
        return value
    keys = keyring()
    if keys is None:
        raise SealingUnavailable("a sealed value was read with sealing off (TOKENSTREAM_SEALING)")
    return keys.open(value[len(STORED) :].decode("ascii", "replace"))


def seal_json(tenant: str, scope: str, value: Any) -> bytes:
    """`seal_stored` of a JSON value (compact), for the records the durable store keeps as JSON."""
    return seal_stored(tenant, scope, json.dumps(value, separators=(",", ":")).encode())


def open_json(value: bytes | None) -> Any:
    """A value written by `seal_json` (or plain JSON before sealing was on), None when absent or erased."""
    plain = open_stored(value)
    return json.loads(plain) if plain is not None else None


def seal_text(tenant: str, scope: str, text: str) -> str:
    """`seal_stored` for a store that keeps text (the semantic cache's properties)."""
    keys = keyring()
    return text if keys is None else keys.seal(tenant, scope, text.encode())


def open_text(value: str) -> str | None:
    if not value.startswith(f"{PREFIX}."):
        return value
    keys = keyring()
    if keys is None:
        raise SealingUnavailable("a sealed value was read with sealing off (TOKENSTREAM_SEALING)")
    plain = keys.open(value)
    return None if plain is None else plain.decode()


async def patiently(work: Callable[[], T], role: str) -> T:
    """`work()` (a decode or an encode) run `unblocked` (a key not held is fetched in a thread at once,
    no wait, no warning), tried again while the keyring is unreachable: back-off from 0.1 s doubling to
    1 s for up to the Redis outage budget (TOKENSTREAM_REDIS_OUTAGE_S), the input held meanwhile, as
    every role rides out its Redis; past it SealingUnavailable, which ends the role for its supervisor to
    restart. (Only a conversation's first event in a process needs the store: keys held are used on
    through an outage.)"""
    budget = settings().redis_outage_s
    deadline, delay, warned = time.monotonic() + budget, 0.1, False
    while True:
        try:
            result = await unblocked(work)
        except SealingUnavailable as exc:
            if time.monotonic() + delay > deadline:
                raise SealingUnavailable(f"{exc} (for {budget:.0f} s)") from exc
            if not warned:
                log.warning(
                    "%s: redis unreachable (keyring: %s); retrying for up to %.0fs, input held",
                    role,
                    exc,
                    budget,
                )
                warned = True
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)
            continue
        if warned:
            log.warning("%s: redis reachable again (keyring)", role)
        return result


def destroy(client: redis.Redis, tenant: str, conversation: str | None = None) -> list[tuple[str, str]]:
    """Destroy the keys of a tenant (every scope) or of one of its conversations: what they sealed is erased.

    Returns (key id, scope) for each key destroyed. The key material also leaves the store's files only
    once its append-only file is rewritten (tokenstream/erase.py does that after calling this)."""
    members = [m.decode() if isinstance(m, bytes) else m for m in client.smembers(tenant_keys(tenant))]
    gone = []
    for key_id in members:
        scope = client.hget(key_hash(key_id), "scope")
        scope = scope.decode() if isinstance(scope, bytes) else (scope or "")
        if conversation is not None and scope != conversation:
            continue
        pipe = client.pipeline(transaction=True)
        pipe.delete(key_hash(key_id))
        pipe.srem(tenant_keys(tenant), key_id)
        pipe.publish(CHANNEL, destroyed_message([key_id]))  # running roles drop it at once
        pipe.execute()
        gone.append((key_id, scope))
    scopes = {scope for _, scope in gone} | ({conversation} if conversation is not None else set())
    for scope in scopes:  # the next content of a scope is sealed with a new key
        client.delete(current_key(tenant, scope))
    return gone


def install(redis_url: str | None = None) -> Keyring | None:
    """Seal this process's events with the durable store's keyring (idempotent: the first call's store
    wins; None when sealing is off). Every Kafka client of producers/clients.py installs it."""
    current = installed_sealer()
    if isinstance(current, Keyring):
        return current
    cfg = settings()
    if not cfg.sealing:
        return None
    keyring = Keyring(redis_url or cfg.redis_url)
    use_sealer(keyring)
    return keyring


def keyring() -> Keyring | None:
    """The installed keyring (installing it on first use), None when sealing is off."""
    return install()
