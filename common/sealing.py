"""The keyring every role seals and opens a tenant's content with (crypto-shredding; schemas/sealing.py).

Keys: one random AES-256 key per (tenant, conversation), or per tenant for content outside any
conversation, made by the first writer and held in the durable Redis (noeviction, append-only):

    ts:seal:key:<key id>          hash: tenant, scope, key (32 bytes), created_at
    ts:seal:current:<tenant>:<scope>  the key id new content of that scope is sealed with
    ts:seal:tenant:<tenant>       set: every key id of the tenant (what `erase --tenant` destroys)

A sealed value is `s1.<key id>.<base64url(nonce | AES-GCM ciphertext and tag)>`: AES-GCM from the
`cryptography` package (OpenSSL), a 96-bit random nonce per value. Destroying the key hash erases every
value sealed with it, wherever copies of it lie; the key id is never reused.

A process keeps the keys it used for `KEY_TTL_S` seconds, so a key destroyed by `tokenstream erase` stops
opening anything in every running role within that time; a new process never sees it again. Fetching a
key is one round trip to the durable Redis per conversation and role (then cached); a Redis outage raises
SealingUnavailable, which a reader treats as the outage it is (never as bad input).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import redis
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from common.config import settings
from schemas.codec import sealer as installed_sealer
from schemas.codec import use_sealer
from schemas.errors import MalformedEvent
from schemas.sealing import SealingUnavailable

log = logging.getLogger(__name__)
T = TypeVar("T")

KEY_TTL_S = 10.0
PREFIX = "s1"

# One round trip: the scope's current key (made if there is none) and its material. (The key hash of an
# existing current key is named inside the script: fine on one Redis, not on a Redis Cluster.)
_MAKE = """
local current = redis.call('GET', KEYS[1])
if current then return {current, redis.call('HGET', 'ts:seal:key:' .. current, 'key')} end
redis.call('HSET', KEYS[2], 'tenant', ARGV[2], 'scope', ARGV[3], 'key', ARGV[4], 'created_at', ARGV[5])
redis.call('SET', KEYS[1], ARGV[1])
redis.call('SADD', KEYS[3], ARGV[1])
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
    """Seals and opens values with keys held in the durable Redis (the codec's `Sealer`)."""

    def __init__(self, url: str, ttl_s: float = KEY_TTL_S, timeout_s: float = 2.0) -> None:
        self.redis = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.ttl_s = ttl_s
        self._make = self.redis.register_script(_MAKE)
        self._writing: dict[tuple[str, str], tuple[str, AESGCM, float]] = {}
        self._reading: dict[str, tuple[AESGCM | None, float]] = {}
        self._lock = threading.Lock()  # sealing runs on event loops and in worker threads alike

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
            raise MalformedEvent(f"malformed event: a sealed value under key {key_id} does not open "
                                 f"({type(exc).__name__})") from exc

    # -- keys ------------------------------------------------------------------------------------------

    def _write_key(self, tenant: str, scope: str) -> tuple[str, AESGCM]:
        now = time.monotonic()
        held = self._writing.get((tenant, scope))
        if held is not None and now - held[2] < self.ttl_s:
            return held[0], held[1]
        fresh_id = os.urandom(8).hex()
        try:
            key_id, material = self._make(keys=[current_key(tenant, scope), key_hash(fresh_id), tenant_keys(tenant)],
                                          args=[fresh_id, tenant, scope, os.urandom(32), str(time.time())])
            key_id = key_id.decode() if isinstance(key_id, bytes) else key_id
        except redis.RedisError as exc:
            if held is not None:  # nobody can destroy a key while the store is away: keep using it
                return held[0], held[1]
            raise SealingUnavailable(f"the keyring (durable Redis) is unreachable: {exc}") from exc
        if material is None:  # being destroyed by an erasure right now: the next seal makes a new one
            raise SealingUnavailable(f"the key {key_id} of {tenant}/{scope} was destroyed while it was fetched")
        aead = AESGCM(material)
        with self._lock:
            self._writing[(tenant, scope)] = (key_id, aead, now)
            self._reading[key_id] = (aead, now)
        return key_id, aead

    def _read_key(self, key_id: str) -> AESGCM | None:
        now = time.monotonic()
        held = self._reading.get(key_id)
        if held is not None and now - held[1] < self.ttl_s:
            return held[0]
        try:
            material, tenant, scope = self.redis.hmget(key_hash(key_id), "key", "tenant", "scope")
        except redis.RedisError as exc:
            if held is not None:  # as in _write_key: a key held stays usable while the store is away
                return held[0]
            raise SealingUnavailable(f"the keyring (durable Redis) is unreachable: {exc}") from exc
        aead = AESGCM(material) if material is not None else None
        with self._lock:
            self._reading[key_id] = (aead, now)
            if aead is not None:  # a live key is its scope's current one: a role answering what it read
                # seals with it without asking again (the worker's tokens, the router's forward)
                held = self._writing.get((tenant.decode(), scope.decode()))
                if held is None or now - held[2] >= self.ttl_s:
                    self._writing[(tenant.decode(), scope.decode())] = (key_id, aead, now)
        return aead


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
    return keys.open(value[len(STORED):].decode("ascii", "replace"))


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
    """`work()` (a decode or an encode), tried again while the keyring is unreachable: back-off from 0.1 s
    doubling to 1 s for up to the Redis outage budget (TOKENSTREAM_REDIS_OUTAGE_S), the input held
    meanwhile, as every role rides out its Redis; past it SealingUnavailable, which ends the role for
    its supervisor to restart. (Only a conversation's first event in a process needs the store: keys
    held are used on through an outage.)"""
    budget = settings().redis_outage_s
    deadline, delay, warned = time.monotonic() + budget, 0.1, False
    while True:
        try:
            result = work()
        except SealingUnavailable as exc:
            if time.monotonic() + delay > deadline:
                raise SealingUnavailable(f"{exc} (for {budget:.0f} s)") from exc
            if not warned:
                log.warning("%s: redis unreachable (keyring: %s); retrying for up to %.0fs, input held",
                            role, exc, budget)
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
