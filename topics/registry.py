"""Topic specifications. `tokenstream topics apply` makes the cluster match this file."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from schemas import (
    Cancel,
    ChatRequest,
    Completion,
    ConversationHistory,
    DeadLetter,
    Event,
    InferenceRequest,
    OutputWindow,
    RouteUpdate,
    SafetyVerdict,
    TokenChunk,
    ToolCall,
    ToolResult,
)

DAY_MS = 24 * 3600 * 1000


@dataclass(frozen=True)
class TopicSpec:
    """One topic. `key` says what the record key means (ordering holds per key)."""

    name: str
    partitions: int
    key: str
    events: tuple[type[Event], ...]
    purpose: str
    configs: dict[str, str] = field(default_factory=dict)

    @property
    def compacted(self) -> bool:
        return "compact" in self.configs.get("cleanup.policy", "")


def _retained(days: float, **extra: str) -> dict[str, str]:
    return {"cleanup.policy": "delete", "retention.ms": str(int(days * DAY_MS)), **extra}


# min.insync.replicas=1 because the local stack has one broker; a production cluster
# overrides it (and the replication factor) through TOKENSTREAM_KAFKA_REPLICATION.
CHAT_REQUESTS = TopicSpec(
    "ts.chat.requests", 12, "tenant:conversation_id", (ChatRequest,),
    "requests as the gateway admitted them; input to the conversation processor",
    _retained(7),
)
PREPARED = TopicSpec(
    "ts.requests.prepared", 12, "request_id", (InferenceRequest,),
    "requests with their full, trimmed history; input to the safety processor",
    _retained(7),
)
SCREENED = TopicSpec(
    "ts.requests.screened", 12, "request_id", (InferenceRequest,),
    "requests whose input passed safety; input to the router",
    _retained(7),
)
TOKENS = TopicSpec(
    "ts.tokens", 12, "request_id", (TokenChunk, Completion, SafetyVerdict),
    "generated tokens and completions (and blocking output verdicts, in band); "
    "the partition is chosen by the gateway that holds the connection",
    _retained(1, **{"message.timestamp.type": "LogAppendTime"}),
)
CONTROL = TopicSpec(
    "ts.control", 3, "request_id", (Cancel,),
    "cancellations, read by every worker",
    _retained(1),
)
VERDICTS = TopicSpec(
    "ts.safety.verdicts", 12, "request_id", (SafetyVerdict,),
    "safety classifications of inputs and output windows",
    _retained(30),
)
TOOL_CALLS = TopicSpec(
    "ts.tool.calls", 6, "request_id", (ToolCall,), "tool invocations asked for by a model", _retained(7),
)
TOOL_RESULTS = TopicSpec(
    "ts.tool.results", 6, "request_id", (ToolResult,), "outcomes of tool invocations", _retained(7),
)
CONVERSATION_TURNS = TopicSpec(
    "ts.conversation.turns", 12, "tenant:conversation_id", (Completion,),
    "finished answers re-keyed by conversation, so the history table can append them",
    _retained(7),
)
# Changelogs of the processors' faust tables. Faust names them <app id>-<table>-changelog;
# they are listed here so that `topics apply` owns their partitions and configs.
CONVERSATIONS = TopicSpec(
    "ts-conversation-history-changelog", 12, "tenant:conversation_id", (ConversationHistory,),
    "history of each conversation, the conversation processor's table (compacted)",
    {"cleanup.policy": "compact", "min.cleanable.dirty.ratio": "0.1", "segment.ms": str(DAY_MS)},
)
SAFETY_WINDOWS = TopicSpec(
    "ts-safety-windows-changelog", 12, "request_id", (OutputWindow,),
    "the text window under review of each streaming answer, the safety processor's table (compacted)",
    {"cleanup.policy": "compact", "min.cleanable.dirty.ratio": "0.1", "segment.ms": str(DAY_MS)},
)
ROUTES = TopicSpec(
    "ts.routes", 1, "model", (RouteUpdate,),
    "routing weights per requested model (compacted: the latest weights win)",
    {"cleanup.policy": "compact"},
)
DEAD_LETTER = TopicSpec(
    "ts.deadletter", 3, "original key", (DeadLetter,),
    "events no processor could decode or handle, with the reason and the original bytes",
    _retained(30),
)

INFERENCE_PARTITIONS = 12
INFERENCE_RETENTION_DAYS = 7


def inference_topic(model: str) -> TopicSpec:
    """The inference-request topic of one model group (one topic per served model)."""
    slug = re.sub(r"[^a-zA-Z0-9._-]+", "-", model).strip("-").lower()
    if not slug:
        raise ValueError(f"model name {model!r} gives an empty topic name")
    return TopicSpec(
        f"ts.inference.{slug}", INFERENCE_PARTITIONS, "request_id", (InferenceRequest,),
        f"inference requests for model {model}; its worker group consumes them",
        _retained(INFERENCE_RETENTION_DAYS),
    )


REGISTRY: tuple[TopicSpec, ...] = (
    CHAT_REQUESTS, PREPARED, SCREENED, TOKENS, CONTROL, VERDICTS, TOOL_CALLS, TOOL_RESULTS,
    CONVERSATION_TURNS, CONVERSATIONS, SAFETY_WINDOWS, ROUTES, DEAD_LETTER,
)


def spec_for(name: str) -> TopicSpec:
    for spec in REGISTRY:
        if spec.name == name:
            return spec
    if name.startswith("ts.inference."):
        return inference_topic(name.removeprefix("ts.inference."))
    raise KeyError(f"unknown topic {name!r}")


def all_topics(models: list[str]) -> list[TopicSpec]:
    """Every topic the system needs when serving `models`."""
    return [*REGISTRY, *(inference_topic(m) for m in models)]
