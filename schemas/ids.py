"""Identifier formats every role relies on.

A request id names its reply partition and admission time, `<16 hex>p<partition>t<ms>`: any
gateway instance finds the request's events in the tokens topic without shared state (the
topic stamps records with LogAppendTime, so offsets_for_times(admission time) is at or before
the request's first event), and an auditor finds where and when to start reading.

An SSE event id is `<request_id>:<position>`; positions are the token event seqs (the role
chunk is -1; the completion at seq c gives the finish chunk c, the usage chunk c+1 and
[DONE] c+2).

A response (`/v1/responses`) is a run of inference requests: step 0's request id is the run id,
step k's is `step_request_id(run_id, k)`, the same format with the same reply partition and
admission time, so every step is found where the run's events are. Its client-facing id is
`resp_<run id>`; its SSE ids are `<run id>:<sequence_number>` (one per streamed event, in log order).
"""

from __future__ import annotations

import hashlib
import re
import secrets

REQUEST_ID = re.compile(r"^[0-9a-f]{16}p(\d+)t(\d+)$")


def new_request_id(partition: int, created_at: float) -> str:
    return f"{secrets.token_hex(8)}p{partition}t{int(created_at * 1000)}"


def parse_request_id(request_id: str) -> tuple[int, int]:
    """(reply partition, admission time in ms), or ValueError for an id no gateway made."""
    m = REQUEST_ID.match(request_id)
    if not m:
        raise ValueError(f"not a tokenstream request id: {request_id!r}")
    return int(m.group(1)), int(m.group(2))


def event_id(request_id: str, position: int) -> str:
    return f"{request_id}:{position}"


def step_request_id(run_id: str, step: int) -> str:
    """The request id of step `step` of a run (step 0 is the run id itself): deterministic, so the
    gateway follows every step of a run from its id alone and a replayed step keeps its id."""
    if step == 0:
        return run_id
    partition, created_ms = parse_request_id(run_id)
    head = hashlib.sha256(f"{run_id}:{step}".encode()).hexdigest()[:16]
    return f"{head}p{partition}t{created_ms}"


RESPONSE_PREFIX = "resp_"


def response_id(run_id: str) -> str:
    return RESPONSE_PREFIX + run_id


def run_id_of(response: str) -> str:
    """The run id inside a response id; ValueError for an id no gateway made."""
    rid = response.removeprefix(RESPONSE_PREFIX)
    if rid == response:
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


def is_file_id(value: str) -> bool:
    return bool(FILE_ID.match(value))


def is_vector_store_id(value: str) -> bool:
    return bool(VECTOR_STORE_ID.match(value))
