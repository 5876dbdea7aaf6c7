"""Where a key's requests are served (`KeyHome`, on the compacted ts.key.homes, mirrored to every other
region), and what workers tell the router about themselves, on the compacted ts.kv.prefixes: which
conversation prefixes their KV caches hold (`PrefixHeld`, keyed by the prefix's digest: the latest
holder wins) and which partitions of their inference topic they own, with their load (`WorkerLoad`,
keyed by the worker). The router sends a conversation's next turn to the partition of the worker holding
its prefix unless that worker is overloaded or has not been heard from (processors/router/prefixes.py).

A prefix is named by the messages it renders, not by tokens: the worker that answered a turn holds
the keys and values of that turn's messages plus its answer, which are exactly the messages before
the next turn's new user message. `conversation_digest` is the one definition both sides use.
"""

from __future__ import annotations

import hashlib

import msgspec

from schemas.base import Event
from schemas.requests import ChatMessage


def conversation_digest(tenant: str, model: str, messages: list[ChatMessage]) -> str:
    """The name of a conversation prefix: tenant (KV is never shared across tenants), served model and
    the messages, as the wire encodes them."""
    h = hashlib.sha256()
    for part in (tenant, model):
        h.update(part.encode())
        h.update(b"\0")
    h.update(msgspec.json.encode(messages))
    return h.hexdigest()[:32]


class PrefixHeld(Event, tag="prefix_held"):
    """Worker `worker_id` of `model` has the KV of the prefix named `digest` in its cache (request_id:
    the request whose answer completed it)."""

    model: str
    worker_id: str
    digest: str


class WorkerLoad(Event, tag="worker_load"):
    """A worker's heartbeat: the partitions of ts.inference.<model> it owns and its batch (every few
    seconds and at each change of partitions; request_id is "load-<worker_id>")."""

    model: str
    worker_id: str
    partitions: list[int] = msgspec.field(default_factory=list)
    running: int = 0
    waiting: int = 0
    max_running: int = 1


class KeyHome(Event, tag="key_home"):
    """The API key whose secret hashes to `digest` (sha256 hex) is at home in `region`: its tenant's
    requests are served, and its content written, there alone. Published by the gateways of the key's
    region for every key of their durable store; MirrorMaker 2 copies the topic to the other regions,
    whose gateways send such a key's requests home (gateway/key_homes.py). Nothing else of the key
    (tenant, tier, limits) leaves its region; request_id is "key-<first 16 hex digits of digest>"."""

    digest: str
    region: str
