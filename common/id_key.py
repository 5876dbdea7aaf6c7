"""The deployment's id key: what makes request ids opaque to clients (schemas/ids.py).

Every gateway and auditor of a deployment must hold the same key: TOKENSTREAM_ID_KEY (64 hex digits;
one Secret on Kubernetes), else the file `id-key` in the data folder, made on first use (mode 0600),
which every local process shares. Changing the key makes every earlier id unreadable: resumes and
audits by id of requests admitted before then fail with 404 (`audit` by time still finds them).
"""

from __future__ import annotations

import secrets

from common import secret_files
from common.config import settings
from schemas.ids import use_id_key


def load() -> bytes:
    cfg = settings()
    if cfg.id_key is not None:
        text = cfg.id_key.get_secret_value()
    else:
        text = secret_files.ensure(cfg.data_dir / "id-key", lambda: secrets.token_hex(32))
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != 32:
        raise ValueError("the id key (TOKENSTREAM_ID_KEY or the data folder's id-key) must be 64 hex digits")
    return key


def install() -> None:
    """Load the key and hand it to schemas.ids (once per process, at start)."""
    use_id_key(load())
