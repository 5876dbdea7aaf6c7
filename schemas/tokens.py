"""What a worker emits: token chunks while generating, one completion at the end."""

from __future__ import annotations

from typing import ClassVar, Literal

import msgspec

from schemas.base import Event
from schemas.structured import MessageToolCall, ToolCallDelta

FinishReason = Literal["stop", "length", "cancelled", "content_filter", "error", "tool_calls"]


class TopLogprob(msgspec.Struct, kw_only=True, array_like=True):
    """One likely token at a position: its text, its UTF-8 bytes (a token may end inside a character)
    and its log probability under the model (before penalties, bias, grammar and temperature)."""

    token: str
    bytes: list[int]
    logprob: float


class TokenLogprob(msgspec.Struct, kw_only=True, array_like=True):
    """One answer token's log probability and the most likely alternatives at its position."""

    token: str
    bytes: list[int]
    logprob: float
    top_logprobs: list[TopLogprob] = msgspec.field(default_factory=list)


class TokenChunk(Event, tag="token_chunk"):
    """New text of one request from one engine step, keyed by request_id.

    seq starts at 0 and has no gaps: a consumer that has seen seq n wants n+1 next
    and drops anything <= n (at-least-once delivery becomes exactly-once display).
    token_ids are the ids behind `text`, so a worker taking over can resume generation; `logprobs`,
    when asked for, has one entry per id.
    A request with tools streams its calls as `tool_calls` deltas; `text` is then only the
    content part, and `raw` is the model's text behind both (what a worker taking over resumes).
    """

    content: ClassVar[frozenset[str]] = frozenset(
        {"text", "token_ids", "tool_calls", "raw", "logprobs"}
    )  # sealed (schemas/sealing.py)

    seq: int
    text: str
    token_ids: list[int] = msgspec.field(default_factory=list)
    tool_calls: list[ToolCallDelta] = msgspec.field(default_factory=list)
    raw: str | None = None
    worker_id: str = ""
    # one entry per token of token_ids when the request asked for log probabilities (SamplingParams.logprobs)
    logprobs: list[TokenLogprob] = msgspec.field(default_factory=list)


def merge_chunks(earlier: TokenChunk, later: TokenChunk) -> TokenChunk:
    """Two consecutive chunks of one request as one, losing nothing: what a reader of the merged chunk
    sees (text, raw, token ids, log probabilities, the calls its deltas assemble, and the OpenAI stream
    frames they make) is what it would see from the two in order.

    text, token_ids and logprobs are joined; raw is joined where either has one (a chunk without raw
    stands for its text). Call deltas follow the stream's own rule (the worker writes them so, the
    gateway frames them so): a delta that names a call (its id) stands alone, and an argument fragment
    is appended to the delta before it when that one is an argument fragment of the same call.
    Every other field (seq, worker_id, created_at) is the later chunk's.
    """
    raw = None
    if earlier.raw is not None or later.raw is not None:
        raw = (earlier.text if earlier.raw is None else earlier.raw) + (
            later.text if later.raw is None else later.raw
        )
    calls = list(earlier.tool_calls)
    for delta in later.tool_calls:
        last = calls[-1] if calls else None
        if last is not None and not delta.id and not last.id and last.index == delta.index:
            calls[-1] = ToolCallDelta(index=last.index, arguments=last.arguments + delta.arguments)
        else:
            calls.append(delta)
    return msgspec.structs.replace(
        later,
        text=earlier.text + later.text,
        token_ids=earlier.token_ids + later.token_ids,
        tool_calls=calls,
        raw=raw,
        logprobs=earlier.logprobs + later.logprobs,
    )


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the worker's prefix cache (not prefilled)
    cache_write_tokens: int = 0  # prompt tokens whose KV this request wrote into the worker's prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class Timings(msgspec.Struct, kw_only=True):
    """Seconds a request spent on its way to the worker, then in the worker's queue, in prefill, decoding.

    pipeline_s   admission at the gateway -> received by the worker that finished it
                 (every processor and broker hop before the engine)
    queue_s      received by the worker -> admitted into its running batch
    prefill_s    admitted -> first token; decode_s: first token -> end
    The worker's own time to first token is queue_s + prefill_s.
    """

    pipeline_s: float = 0.0
    queue_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0


class Completion(Event, tag="completion"):
    """Last event of a request on the tokens topic. seq follows the last TokenChunk.

    text is the whole generated answer (the chunks joined) and tool_calls the calls it made: the
    conversation processor appends both to the history, and an auditor reads an answer without
    replaying chunks.
    """

    content: ClassVar[frozenset[str]] = frozenset(
        {"text", "tool_calls", "error"}
    )  # sealed (schemas/sealing.py)

    seq: int
    finish_reason: FinishReason
    text: str = ""
    tool_calls: list[MessageToolCall] = msgspec.field(default_factory=list)
    usage: Usage = msgspec.field(default_factory=Usage)
    timings: Timings = msgspec.field(default_factory=Timings)
    error: str | None = None
    # why a request was refused when the fault is the client's (the gateway answers 4xx):
    # "context_length_exceeded" (400), "preset_not_found" (404), "previous_turn_unanswered" (409: the
    # conversation processor gave up the answer this turn waited for; sending it again works);
    # None for a server-side error
    error_code: str | None = None
    dropped_messages: int = 0
    worker_id: str = ""
    # what the usage is billed as (`tokenstream usage`): the model that answered (the worker group's, or
    # the cached answer's) and the request's tier; "" where no model ran (a refusal, an error)
    model: str = ""
    tier: str = ""
    # the request's output.moderated: the safety processor answers it with a verdict over the whole answer
    moderated: bool = False
