"""Gateway settings, read from TOKENSTREAM_GATEWAY_* environment variables (CLI flags override)."""

from __future__ import annotations

import os
import socket
from functools import lru_cache
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def _default_instance_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class GatewaySettings(BaseSettings):
    """Example: TOKENSTREAM_GATEWAY_INSTANCE_INDEX=1 TOKENSTREAM_GATEWAY_INSTANCE_COUNT=2."""

    model_config = SettingsConfigDict(env_prefix="TOKENSTREAM_GATEWAY_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = 8000
    instance_id: str = Field(default_factory=_default_instance_id)
    # Instance i of n owns the tokens-topic partitions p with p % n == i, unless
    # reply_partitions names them explicitly.
    instance_index: int = Field(0, ge=0)
    instance_count: int = Field(1, ge=1)
    reply_partitions: list[int] | None = None

    models: list[str] = ["smollm2"]

    # When the input safety check runs (schemas.Screening): "parallel" overlaps it with queueing and
    # prefill and holds the answer back until the verdict; "serial" judges before routing.
    screening: Literal["serial", "parallel"] = "parallel"

    # Per-connection buffer: at most buffer_events pending events; when full, a new chunk is
    # merged into the last pending one (text, call deltas and log probabilities all kept) until that
    # holds coalesce_chars characters of the model's output; then the stream is dropped (it ends with
    # an error event, code slow_reader, and the client resumes from the log with Last-Event-ID).
    buffer_events: int = Field(64, ge=2)
    coalesce_chars: int = Field(4096, ge=16)
    # A stream whose write waits this long on a client that reads nothing is ended (gateway/sse.py).
    slow_reader_s: float = Field(30.0, gt=0)

    # Largest request body accepted (413 beyond): below the broker's message size (1 MiB by default),
    # since the request is written to the pipeline as one event.
    max_body_bytes: int = Field(512 * 1024, ge=1024, le=900 * 1024)

    # Uploaded files (/v1/files): largest file, and all of a tenant's files together (kept in Redis:
    # see docs/clients.md, "Files and vector stores"); files one vector store may hold; a search's wait for
    # the tool processor's answer.
    file_max_bytes: int = Field(8 * 1024 * 1024, ge=1024, le=64 * 1024 * 1024)
    audio_max_bytes: int = Field(25 * 1024 * 1024, ge=1024, le=64 * 1024 * 1024)  # a recording to transcribe
    tenant_files_max_bytes: int = Field(256 * 1024 * 1024, ge=1024)
    store_max_files: int = Field(500, ge=1, le=10_000)
    search_timeout_s: float = Field(30.0, gt=0)

    # Connections waiting on tokens at once; beyond this, 429 (a hard cap next to the lag check).
    max_active_streams: int = Field(20_000, ge=1)

    # Open requests one API key may hold at once across every gateway instance, by tier, for keys
    # created without --max-streams (a tier missing here, or 0: no limit). A request holds its slot
    # from admission until it ends (completion, cancel, error, deadline; a client that disconnects
    # keeps it for the resume grace period). The admitting instance renews the slot's lease in Redis
    # every stream_lease_s / 3; an instance that dies stops renewing, so its slots lapse after the lease.
    tier_max_streams: dict[str, int] = {"free": 16, "paid": 64, "enterprise": 256}
    stream_lease_s: float = Field(30.0, ge=3)

    # Admission: reject when the estimated queue wait of the model's worker group exceeds this.
    admission_budget_s: float = Field(10.0, gt=0)
    admission_poll_s: float = Field(0.5, gt=0)
    admission_window_s: float = Field(10.0, gt=0)
    # Drain rate assumed when none has been measured yet (requests per second).
    admission_min_rate: float = Field(1.0, gt=0)
    # The broker counts as down when no lag sample succeeded for this long.
    broker_stale_s: float = Field(5.0, gt=0)

    # A disconnected stream is cancelled unless some client resumes it within this time.
    cancel_grace_s: float = Field(5.0, ge=0)
    # A request that makes no progress (no event from the pipeline) for this long is ended for its
    # client (an error event on a stream, 504 otherwise) and cancelled, instead of hanging.
    progress_timeout_s: float = Field(60.0, gt=0)
    # a response run (/v1/responses): at most this many inference steps (the last answers in text)
    responses_max_steps: int = Field(8, ge=1, le=64)
    # a conversation (/v1/conversations) holds at most this many items (older turns beyond the
    # model's context are trimmed from what it reads, not from the conversation)
    conversation_max_items: int = Field(2000, ge=20, le=100_000)
    # SSE keep-alive comment interval.
    ping_s: float = Field(15.0, gt=0)

    # Exact response cache (deterministic requests): entry lifetime and the longest answer stored.
    exact_cache_ttl_s: float = Field(3600.0, gt=0)
    exact_cache_max_chars: int = Field(32_768, ge=0)
    # Semantic cache (opt-in per key): least cosine similarity of a hit, entry lifetime.
    semantic_cache_threshold: float = Field(0.9, gt=0, le=1)
    semantic_cache_ttl_s: float = Field(86_400.0, gt=0)
    # Each semantic lookup or store (connecting included) gets this long before it counts as a miss;
    # after a failure Weaviate is skipped for 0.25 s doubling to 2 s (common/vectordb.py).
    semantic_cache_timeout_s: float = Field(1.0, gt=0)

    def max_streams(self, max_streams: int, tier: str) -> int:
        """The open-request limit of a key (its own, else its tier's); 0 means none."""
        if max_streams:
            return max(0, max_streams)
        return max(0, self.tier_max_streams.get(tier, 0))

    @model_validator(mode="after")
    def _index_below_count(self) -> GatewaySettings:
        # refused at start (a StatefulSet pod whose ordinal is not below the replica count it was given)
        if not self.reply_partitions and self.instance_index >= self.instance_count:
            raise ValueError(
                f"instance index {self.instance_index} must be below the instance count {self.instance_count}"
            )
        return self

    def owned_partitions(self, total: int) -> list[int]:
        if self.reply_partitions:
            return sorted(p for p in self.reply_partitions if 0 <= p < total)
        if self.instance_index >= self.instance_count:
            raise ValueError("instance_index must be below instance_count")
        return [p for p in range(total) if p % self.instance_count == self.instance_index]


@lru_cache
def gateway_settings() -> GatewaySettings:
    return GatewaySettings()
