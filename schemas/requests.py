"""What a client asks for: the chat request at the edge and the inference request a worker runs."""

from __future__ import annotations

from typing import ClassVar, Literal

import msgspec

from schemas.base import Event
from schemas.runs import RunSpec
from schemas.structured import MessageToolCall, OutputSpec

Role = Literal["system", "user", "assistant", "tool"]

#: When the input safety check runs relative to generation (chosen by the gateway's operator):
#: "serial"    safety judges first; only a passed request goes on (ts.requests.screened -> router);
#: "parallel"  the router forwards the prepared request at once while safety judges it; safety writes
#:             its input verdict in band to the request's tokens partition, and the gateway holds the
#:             answer back until that verdict (a block cancels generation; no token reaches the client).
# moderation: an input judged only (POST /v1/moderations), its verdict in band; nothing is generated
Screening = Literal["serial", "parallel", "moderation"]

MAX_LOGIT_BIAS = 300  # token ids one request may bias (OpenAI's limit)
MAX_TOP_LOGPROBS = 20  # alternatives per token (OpenAI's limit)
MAX_STREAM_INTERVAL = 1024  # tokens a request may ask its text to be held for (stream_interval)
MAX_STREAM_INTERVAL_MS = 10_000  # milliseconds (stream_interval_ms)


class ChatMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: Role
    content: str
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[MessageToolCall] = msgspec.field(default_factory=list)


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Per-request decoding settings. temperature 0 means greedy."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = msgspec.field(default_factory=list)
    seed: int | None = None
    # subtracted from a token's logit once if it appeared in the answer so far (presence) and once per
    # time it appeared (frequency); OpenAI's range
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = msgspec.field(default_factory=dict)  # token id -> added to its logit
    # None: no log probabilities; k >= 0: each answer token's, with the k most likely alternatives
    logprobs: int | None = None
    # the stream interval (gpu_workers/streaming.py): the worker writes a request's pending text as one
    # chunk once this many tokens are pending, or this many milliseconds after its last chunk (0: no
    # time bound); its first text and its end at once. None: the worker deployment's setting
    stream_interval: int | None = None
    stream_interval_ms: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2]")
        if len(self.logit_bias) > MAX_LOGIT_BIAS or any(
            t < 0 or not -100 <= b <= 100 for t, b in self.logit_bias.items()
        ):
            raise ValueError(
                f"logit_bias maps at most {MAX_LOGIT_BIAS} token ids (>= 0) to biases in [-100, 100]"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
        if self.stream_interval is not None and not 1 <= self.stream_interval <= MAX_STREAM_INTERVAL:
            raise ValueError(f"stream_interval must be in [1, {MAX_STREAM_INTERVAL}]")
        if self.stream_interval_ms is not None and not 0 <= self.stream_interval_ms <= MAX_STREAM_INTERVAL_MS:
            raise ValueError(f"stream_interval_ms must be in [0, {MAX_STREAM_INTERVAL_MS}]")

    def shapes_tokens(self) -> bool:
        """Whether penalties or a logit bias change the distribution the model's tokens are drawn from."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)


class ChatRequest(Event, tag="chat_request"):
    """Written by the gateway to the chat-requests topic, keyed by
    `schemas.keys.conversation_key(tenant, conversation_id)`.

    messages may hold the whole history (OpenAI style) or only the new turn; the
    conversation processor completes it from the stored history.
    reply_partition is the tokens-topic partition owned by the gateway instance that
    holds the client's connection: every token event for this request goes there.
    """

    content: ClassVar[frozenset[str]] = frozenset(
        {"messages", "output", "user", "run"}
    )  # sealed (schemas/sealing.py)

    model: str
    messages: list[ChatMessage]
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    output: OutputSpec = msgspec.field(default_factory=OutputSpec)
    stream: bool = True
    assistant: str | None = None
    user: str | None = None
    reply_partition: int = 0
    gateway_id: str = ""
    screening: Screening = "serial"
    tier: str = ""  # of the API key (schemas.keys.TIERS); "" in events written before keys existed
    priority: int = 0  # higher is admitted first by the workers (schemas.keys.TIER_PRIORITY)
    # the client's prompt_cache_key: a tenant's requests that share it go to the same worker (its prefix
    # cache then holds their common prompt once; processors/router/prefixes.py)
    cache_key: str = ""
    # set when the gateway answered from its exact cache: written for the audit trail only, the
    # answer (from the request named here) is on the tokens topic already; processors skip it
    cached_from: str = ""
    # a response run (/v1/responses): the conversation processor goes on through server tool calls
    run: RunSpec | None = None
    # the messages are the whole conversation (the gateway's /v1/conversations keeps it): they replace
    # the history the conversation processor kept, rather than being appended to it
    full_history: bool = False


class InferenceRequest(Event, tag="inference_request"):
    """Written to a model's inference topic, keyed by request_id; a worker group consumes it.

    prompt is the final, rendered message list after history, presets and trimming.
    dropped_messages counts turns removed to fit the context window.
    """

    content: ClassVar[frozenset[str]] = frozenset({"messages", "output"})  # sealed (schemas/sealing.py)

    model: str
    messages: list[ChatMessage]
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    output: OutputSpec = msgspec.field(default_factory=OutputSpec)
    reply_partition: int = 0
    dropped_messages: int = 0
    admitted_at: float = 0.0
    screening: Screening = "serial"
    tier: str = ""
    priority: int = 0
    cache_key: str = ""  # ChatRequest.cache_key
    # a shadow evaluation's replay (`tokenstream shadow`) of the served request with this id: the worker
    # writes only its Completion, to ts.shadow.answers, and none of its tool calls (nothing runs them)
    shadow_of: str = ""
