"""Identifier formats every role relies on.

A request id is 32 hex digits: one AES block (under the deployment's id key) holding the request's
reply partition, its admission time in ms, 4 random bytes and a 4-byte mark. Whoever holds the key
(the gateways, the auditors) reads where and when the request's events are, so any gateway instance
finds them in the tokens topic without shared state (the topic stamps records with LogAppendTime, so
offsets_for_times(admission time) is at or before the request's first event) and an auditor knows
where and when to start reading; a client, who sees the id in `chatcmpl-<id>`, `resp_<id>` and every
SSE id, learns nothing of either, and an id it makes up fails the mark (1 in 2**32 passes it).
The key is installed once per process (`use_id_key`; common/id_key.py reads it), before any id is
made or read.

An SSE event id is `<request_id>:<position>`; positions are the token event seqs (the role
chunk is -1; the completion at seq c gives the finish chunk c, the usage chunk c+1 and
[DONE] c+2).

A response (`/v1/responses`) is a run of inference requests: step 0's request id is the run id,
step k's is `step_request_id(run_id, k)`, `<run id>s<k>`, which holds the run's reply partition and
admission time, so every step is found where the run's events are, and which needs no key to make
(the conversation processor names the steps). Its client-facing id is `resp_<run id>`; its SSE ids
are `<run id>:<sequence_number>` (one per streamed event, in log order).
"""

from __future__ import annotations

import re
import secrets

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

REQUEST_ID = re.compile(r"^([0-9a-f]{32})(?:s(\d+))?$")
_MARK = b"tsid"
_cipher: Cipher | None = None


def use_id_key(key: bytes) -> None:
    """Install this process's id key (32 bytes, the same in every gateway and auditor of a deployment)."""
    global _cipher
    if len(key) != 32:
        raise ValueError("the id key is 32 bytes")
    # One block per id, each holding 4 random bytes: ECB over single blocks is a keyed permutation of
    # the block, which is all an opaque, checkable id needs (no block ever repeats).
    _cipher = Cipher(algorithms.AES(key), modes.ECB())


def _key_cipher() -> Cipher:
    if _cipher is None:
        raise RuntimeError("no id key installed in this process (common.id_key.install)")
    return _cipher


def new_request_id(partition: int, created_at: float) -> str:
    block = (
        partition.to_bytes(2, "big")
        + int(created_at * 1000).to_bytes(6, "big")
        + secrets.token_bytes(4)
        + _MARK
    )
    encryptor = _key_cipher().encryptor()
    return (encryptor.update(block) + encryptor.finalize()).hex()


def parse_request_id(request_id: str) -> tuple[int, int]:
    """(reply partition, admission time in ms), or ValueError for an id no gateway of this deployment made."""
    m = REQUEST_ID.match(request_id)
    if not m:
        raise ValueError(f"not a tokenstream request id: {request_id!r}")
    decryptor = _key_cipher().decryptor()
    block = decryptor.update(bytes.fromhex(m.group(1))) + decryptor.finalize()
    if block[12:] != _MARK:
        raise ValueError(f"not a tokenstream request id: {request_id!r}")
    return int.from_bytes(block[:2], "big"), int.from_bytes(block[2:8], "big")


def event_id(request_id: str, position: int) -> str:
    return f"{request_id}:{position}"


def step_request_id(run_id: str, step: int) -> str:
    """The request id of step `step` of a run (step 0 is the run id itself): deterministic, so the
    gateway follows every step of a run from its id alone and a replayed step keeps its id."""
    if not REQUEST_ID.match(run_id) or "s" in run_id:
        raise ValueError(f"not a run id: {run_id!r}")
    return run_id if step == 0 else f"{run_id}s{step}"


RESPONSE_PREFIX = "resp_"


def response_id(run_id: str) -> str:
    return RESPONSE_PREFIX + run_id


def run_id_of(response: str) -> str:
    """The run id inside a response id; ValueError for an id no gateway made."""
    rid = response.removeprefix(RESPONSE_PREFIX)
    if rid == response or "s" in rid:
        raise ValueError(f"not a response id: {response!r}")
    parse_request_id(rid)
    return rid


# Uploaded files and vector stores (the /v1/files and /v1/vector_stores APIs, the ingestion events
# and the file_search tool's `vector_store_ids`): OpenAI's shapes, `file-` and `vs_` followed by 24
# base-62 characters, random, so an id reveals nothing and cannot be guessed.
ID_ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
FILE_ID = re.compile(r"^file-[0-9A-Za-z]{24}$")
VECTOR_STORE_ID = re.compile(r"^vs_[0-9A-Za-z]{24}$")


def _random_tail(n: int = 24) -> str:
    return "".join(secrets.choice(ID_ALPHABET) for _ in range(n))


def new_file_id() -> str:
    return "file-" + _random_tail()


def new_vector_store_id() -> str:
    return "vs_" + _random_tail()


def new_conversation_id() -> str:
    return "conv_" + _random_tail()


def new_item_id(prefix: str = "msg") -> str:
    """A conversation item the client added without an id of its own."""
    return f"{prefix}_" + _random_tail()


def is_file_id(value: str) -> bool:
    return bool(FILE_ID.match(value))


def is_vector_store_id(value: str) -> bool:
    return bool(VECTOR_STORE_ID.match(value))
