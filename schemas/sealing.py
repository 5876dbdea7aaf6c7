"""Crypto-shredding's contract: which fields of an event are a tenant's content, and how a sealed event reads.

An event's *content* (messages, generated text and token ids, tool arguments and results, transcripts,
audio) is written sealed: encrypted with a key of its tenant's conversation (or of the tenant, for an event
outside any conversation), the key held in the durable store (common/sealing.py). Everything else (ids,
times, model, usage, verdicts, offsets) stays in clear, so an auditor, an operator and the ledger read it
without any key. Destroying a key (`tokenstream erase`) makes every copy of that content unreadable at
once: on the topics, in their replicas and in anything copied from them, although not one record is
rewritten (the ledger's digests, taken over the sealed bytes, still verify).

On the wire a sealed event is its clear fields with one more, first: `"sealed": "s1.<key id>.<sealed>"`,
where the sealed part holds the content fields as one JSON object. As in any event, a field at its
default is written in neither part (schemas/base.py); an event whose content is all at its default has
nothing to seal and is written in clear. `schemas.codec` splices the two back together before its typed
decode, so a reader sees the event it would have seen unsealed.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter
from typing import Any, Protocol

import msgspec

from schemas.base import Event
from schemas.errors import Erased, MalformedEvent

#: the field a sealed event carries its content in; the codec writes it first
SEALED_FIELD = "sealed"
SEALED_PREFIX = b'{"sealed":"'


class Sealer(Protocol):
    """What the codec needs of a keyring (common/sealing.py is the one the roles install)."""

    def seal(self, tenant: str, scope: str, plaintext: bytes) -> str:
        """Encrypt `plaintext` with the key of (tenant, scope), made if there is none; a token without
        quotes."""

    def open(self, token: str) -> bytes | None:
        """The plaintext of `token`, or None when its key was destroyed (the content is erased)."""


class SealingUnavailable(RuntimeError):
    """The keyring could not be reached (the durable store is away): a dependency outage, not bad input.

    Never a DecodeError: a record that cannot be opened now is not dead-lettered; its reader holds it
    and tries again within the Redis outage budget (common.sealing.patiently), then stops for its
    supervisor to restart it; the gateway answers 503."""


class KeyNotHeld(SealingUnavailable):
    """A key this process does not hold, needed on an event loop, which never waits on the keyring's store.

    Raised only inside `common.sealing.unblocked`, which calls `fetch()` (the round trip to the store) in
    a thread and runs the work again with the key it returned (`wanted`: a key id, or (tenant, scope)
    for sealing); it never reaches a caller."""

    def __init__(self, message: str, wanted: Any, fetch: Callable[[], Any]) -> None:
        super().__init__(message)
        self.wanted, self.fetch = wanted, fetch


class Unsealed(RuntimeError):
    """A sealed event met in a process with no keyring installed (common.sealing.install): a wiring bug."""


_encoder = msgspec.json.Encoder()
_untyped = msgspec.json.Decoder()


class _Plan:
    """How one event type is written sealed: its content fields as one object (left at their default:
    not written), and its clear fields after the seal. Each part is a struct made for it, so a record
    is two direct encodes (the content, sealed; the clear part with the seal), no intermediate copy."""

    def __init__(self, cls: type) -> None:
        fields = msgspec.structs.fields(cls)
        content = [f for f in fields if f.name in cls.content]
        clear = [f for f in fields if f.name not in cls.content]
        config = cls.__struct_config__
        self.content_view = _view(cls.__name__ + "Content", [], content, config.omit_defaults)
        self.clear_view = _view(
            cls.__name__ + "Clear",
            [(SEALED_FIELD, str), (config.tag_field, str)],
            clear,
            config.omit_defaults,
        )
        self.tag = config.tag
        self.content = _getter([f.name for f in _ordered(content)])
        self.clear = _getter([f.name for f in _ordered(clear)])


def _ordered(fields: list) -> list:
    return [f for f in fields if f.required] + [f for f in fields if not f.required]


def _view(name: str, first: list[tuple[str, type]], fields: list, omit_defaults: bool) -> type:
    """A struct of `first`, then `fields` (required ones first, so it is built positionally), each with
    its default and its name on the wire, written as the event writes them (defaults left out or not)."""
    spec: list = list(first)
    for f in _ordered(fields):
        if f.required:
            spec.append((f.name, Any))
        elif f.default_factory is not msgspec.NODEFAULT:
            spec.append((f.name, Any, msgspec.field(default_factory=f.default_factory)))
        else:
            spec.append((f.name, Any, f.default))
    rename = {f.name: f.encode_name for f in fields if f.encode_name != f.name}
    return msgspec.defstruct(name, spec, omit_defaults=omit_defaults, rename=rename or None, gc=False)


def _getter(names: list[str]):
    get = attrgetter(*names)
    return get if len(names) > 1 else lambda event: (get(event),)


_plans: dict[type, _Plan | None] = {}
#: the clear fields every event has, at their defaults (not written): what an erased record's clear
#: fields read as when absent
_BASE_DEFAULTS = {
    f.name: f.default for f in msgspec.structs.fields(Event) if f.default is not msgspec.NODEFAULT
}


def seal(event, sealer: Sealer) -> bytes | None:
    """The wire bytes of `event` with its content sealed, or None when it has no content to seal."""
    cls = type(event)
    try:
        plan = _plans[cls]
    except KeyError:
        plan = _plans[cls] = _Plan(cls) if cls.content else None
    if plan is None:
        return None
    content = _encoder.encode(plan.content_view(*plan.content(event)))
    if content == b"{}":  # every content field at its default: nothing to seal
        return None
    token = sealer.seal(event.tenant, event.conversation_id, content)
    return _encoder.encode(plan.clear_view(token, plan.tag, *plan.clear(event)))


def unseal(data: bytes, sealer: Sealer | None) -> bytes:
    """`data` with its sealed content spliced back among the clear fields (data itself when not sealed).

    Raises Erased when the content's key was destroyed, MalformedEvent when the sealed field is not one."""
    if not data.startswith(SEALED_PREFIX):
        return data
    end = data.find(b'"', len(SEALED_PREFIX))
    if end < 0:
        raise MalformedEvent("malformed event: the sealed field is not closed")
    token = data[len(SEALED_PREFIX) : end].decode("ascii", "replace")
    rest = data[end + 1 :]  # ',"type":...}' or '}'
    if sealer is None:
        raise Unsealed("a sealed event was read in a process without a keyring (common.sealing.install)")
    plain = sealer.open(token)
    if plain is None:
        try:
            clear = _untyped.decode(b"{" + rest.lstrip(b","))
        except msgspec.DecodeError:
            clear = {}
        raise Erased(
            f"erased: the key of {token.split('.')[1] if token.count('.') >= 2 else '?'} was destroyed",
            {**_BASE_DEFAULTS, **clear} if isinstance(clear, dict) else {},
        )
    if not (plain.startswith(b"{") and plain.endswith(b"}")):
        raise MalformedEvent("malformed event: its sealed content is not a JSON object")
    inner = plain[1:-1]
    if rest.startswith(b","):
        return b"{" + inner + rest if inner else b"{" + rest[1:]
    return plain  # only content (no clear field but the seal)
