"""The notary's signing key (Ed25519, from the `cryptography` package).

TOKENSTREAM_LEDGER_KEY (64 hex digits: the private key's seed; one Secret in a deployment), else the
data folder's `ledger-key`, made on first use (mode 0600). Its public half goes into every exported
bundle; `key_id` (the public key's sha256, 16 hex digits) is stamped on every checkpoint.
"""

from __future__ import annotations

import secrets

import msgspec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from audit import ledger_math as lm
from common import secret_files
from common.config import settings
from schemas import Checkpoint


class Signer:
    def __init__(self, seed: bytes) -> None:
        self._key = Ed25519PrivateKey.from_private_bytes(seed)
        self.public_key = self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.key_id = lm.key_id(self.public_key)

    @classmethod
    def load(cls) -> Signer:
        cfg = settings()
        if cfg.ledger_key is not None:
            text = cfg.ledger_key.get_secret_value()
        else:
            text = secret_files.ensure(cfg.data_dir / "ledger-key", lambda: secrets.token_hex(32))
        return cls(bytes.fromhex(text))

    def sign(self, cp: Checkpoint) -> Checkpoint:
        body = msgspec.to_builtins(msgspec.structs.replace(cp, signature=""))
        return msgspec.structs.replace(cp, signature=self._key.sign(lm.signed_bytes(body)).hex())


def as_dict(cp: Checkpoint) -> dict:
    """A checkpoint as ledger_math and the bundle see it (plain JSON values)."""
    return msgspec.to_builtins(cp)
