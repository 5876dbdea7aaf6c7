"""One request inside the engine: its tokens, pages, text streamed so far and timings."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from gpu_workers.detokenizer import Detokenizer
from gpu_workers.stops import StopMatcher


@dataclass(eq=False)  # identity: two requests are never "equal"
class Sequence:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    presence_penalty: float = 0.0  # gpu_workers/logits.py
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # report each token's log probability and this many alternatives
    # resuming a request another worker started: the tokens and text it already emitted
    generated: list[int] = field(default_factory=list)
    emitted_text: str = ""
    next_seq: int = 0
    arrival: float = field(default_factory=time.time)
    priority: int = 0  # higher tiers are admitted first (gpu_workers.priority)
    tag: Any = None  # the caller's handle (the Kafka record)
    grammar: Any = None  # gpu_workers.grammar.GrammarState of a constrained request (tools, response_format)
    tenant: str = ""  # prefix KV entries are shared only within one tenant
    # the stream interval (gpu_workers/streaming.py): pending text is written once this many tokens are
    # pending, or this many milliseconds after the last chunk (0: no time bound); 1: every step
    stream_interval: int = 1
    stream_interval_ms: float = 0.0

    blocks: list[int] = field(default_factory=list)  # pages of the KV budget this request holds
    slot: int | None = None  # its slot of the KV storage (kv_cache.SlotPool) while running
    kv: list | None = None  # the slot's keys/values: per layer [2, kv_heads, max_len, head_dim]
    matched: bool = False  # the prefix cache was consulted (at its first scheduling)
    page_keys: list = field(default_factory=list)  # prefix-cache keys of its full pages at admission
    computed: int = 0  # tokens whose keys/values are in the cache
    cached_tokens: int = 0  # prompt tokens whose keys/values came from the prefix cache
    cache_written: int = 0  # prompt tokens whose keys/values this request put into the prefix cache
    detok: Detokenizer | None = None
    text: str = ""  # decoded text of `generated` (what the detokenizer has completed)
    unsent_ids: list[int] = field(default_factory=list)
    unsent_logprobs: list = field(default_factory=list)  # gpu_workers.logits.Reported, one per unsent id
    last_chunk_at: float | None = None  # when this worker last wrote a chunk of it (None: not yet)
    resumed: int = 0
    scheduled_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        self.matcher = StopMatcher(self.stop)
        self.resumed = len(self.generated)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.generated

    @property
    def pending(self) -> int:
        """Tokens to feed before the next token can be sampled."""
        return len(self.prompt_ids) + len(self.generated) - self.computed

    @property
    def limit(self) -> int:
        """Most tokens this request can ever hold in the cache."""
        return len(self.prompt_ids) + self.max_tokens

    def timings(self) -> tuple[float, float, float]:
        """(queue, prefill, decode) seconds."""
        end = self.finished_at or time.time()
        sched = self.scheduled_at or end
        first = self.first_token_at or end
        return max(0.0, sched - self.arrival), max(0.0, first - sched), max(0.0, end - first)


@dataclass
class Output:
    """What a step produced for one request: a text chunk, the completion, or both (chunk first)."""

    seq: Sequence
    chunk_seq: int | None = None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    completion_seq: int | None = None
    error: str | None = None
    logprobs: list = field(default_factory=list)  # gpu_workers.logits.Reported per token id, when asked for
