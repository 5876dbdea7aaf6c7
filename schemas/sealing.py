"""Crypto-shredding's contract: which fields of an event are a tenant's content, and how a sealed event reads.

An event's *content* (messages, generated text and token ids, tool arguments and results, transcripts,
audio) is written sealed: encrypted with a key of its tenant's conversation (or of the tenant, for an event
outside any conversation), the key held in the durable store (common/sealing.py). Everything else (ids,
times, model, usage, verdicts, offsets) stays in clear, so an auditor, an operator and the ledger read it
without any key. Destroying a key (`tokenstream erase`) makes every copy of that content unreadable at
once: on the topics, in their replicas and in anything copied from them, although not one record is
rewritten (the ledger's digests, taken over the sealed bytes, still verify).

On the wire a sealed event is its clear fields with one more, first: `"sealed": "s1.<key id>.<sealed>"`,
where the sealed part holds the content fields as one JSON object. `schemas.codec` splices the two back
together before its typed decode, so a reader sees the event it would have seen unsealed.
"""

from __future__ import annotations

from typing import Protocol

import msgspec

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


class Unsealed(RuntimeError):
    """A sealed event met in a process with no keyring installed (common.sealing.install): a wiring bug."""


_encoder = msgspec.json.Encoder()
_untyped = msgspec.json.Decoder()


def seal(event, sealer: Sealer) -> bytes | None:
    """The wire bytes of `event` with its content sealed, or None when it has no content to seal."""
    fields = type(event).content
    if not fields:
        return None
    clear = msgspec.to_builtins(event)
    content = {name: clear.pop(name) for name in fields if name in clear}
    if not content:
        return None
    token = sealer.seal(event.tenant, event.conversation_id, _encoder.encode(content))
    return _encoder.encode({SEALED_FIELD: token, **clear})


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
            clear if isinstance(clear, dict) else {},
        )
    if not (plain.startswith(b"{") and plain.endswith(b"}")):
        raise MalformedEvent("malformed event: its sealed content is not a JSON object")
    inner = plain[1:-1]
    if rest.startswith(b","):
        return b"{" + inner + rest if inner else b"{" + rest[1:]
    return plain  # only content (no clear field but the seal)
