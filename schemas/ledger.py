"""The tamper-evident ledger's record (`ts.audit.ledger`): a signed checkpoint of one partition.

The notary (`tokenstream audit notarize`) reads every content topic in offset order and chains its
records: each record's digest is sha256 over its timestamp, key, value and headers
(`audit/ledger_math.py`, the same file the exported bundle carries as its verifier), and the chain
head after a record is sha256(previous head || record digest), from 32 zero bytes at the
partition's first notarized record. Every few seconds (or 500 records) it writes, per partition
that moved, a Checkpoint: the records' digests in order, the heads before and after, and an
Ed25519 signature over all of it. `audit verify` recomputes each attested record and names the
first one changed, removed, reordered or inserted.
"""

from __future__ import annotations

import msgspec

from schemas.base import Event


class Checkpoint(Event, tag="ledger_checkpoint", kw_only=True, omit_defaults=False):
    """Records `first_offset`..`last_offset` of `topic`/`partition`, attested in order.

    request_id holds "<topic>/<partition>" (the record key: one partition's checkpoints in order).
    record_digests[i] is the digest of the i-th attested record (hex); offsets names each one's offset
    (the log may skip offsets: transaction markers, compaction). signature signs `signed_bytes()` of
    `audit/ledger_math.py` with the notary's key, whose public half `key_id` names (its sha256, hex).
    Written whole, defaults included: its fields as plain JSON are what the signature covers and what
    a bundle's verifier reads, and checkpoints signed before events left out their defaults still verify.
    """

    topic: str
    partition: int
    first_offset: int
    last_offset: int
    offsets: list[int] = msgspec.field(default_factory=list)
    record_digests: list[str] = msgspec.field(default_factory=list)
    prev_head: str = "00" * 32
    head: str = ""
    signed_at: float = 0.0
    key_id: str = ""
    signature: str = ""  # hex
