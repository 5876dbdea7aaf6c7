"""Topic specifications. `tokenstream topics apply` makes the cluster match this file.

Every topic also names who writes it and who reads it (role, consumer group or group-less,
commit rule): the map `tokenstream topics describe --flow` prints, and what `tokenstream audit`
and `tokenstream ops` are built on.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from schemas import (
    Cancel,
    ChatRequest,
    Completion,
    ConversationHistory,
    DeadLetter,
    Event,
    FileIngest,
    InferenceRequest,
    OutputWindow,
    RouteUpdate,
    SafetyVerdict,
    TokenChunk,
    ToolCall,
    ToolResult,
    Transcript,
    TurnDeadline,
)

DAY_MS = 24 * 3600 * 1000

# Consumer groups. A faust processor's group is its app id, `ts-<role>`.
CONVERSATION_GROUP = "ts-conversation"
SAFETY_GROUP = "ts-safety"
ROUTER_GROUP = "ts-router"


def processor_group(role: str) -> str:
    return f"ts-{role}"


def worker_group(model: str) -> str:
    """The consumer group of the workers serving `model` (its lag is the load signal)."""
    return f"worker.{model}"


@dataclass(frozen=True)
class Writer:
    """A role that writes the topic, and when."""

    role: str
    when: str


@dataclass(frozen=True)
class Reader:
    """A role that reads the topic. group None: group-less (manual assignment, nothing committed)."""

    role: str
    group: str | None
    commit: str


# Commit rules, named once.
FAUST_COMMIT = ("faust at-least-once: commits every 0.2 s what the agent has handled and its outputs "
                "acknowledged; each effect done once per request id (Redis)")
WORKER_COMMIT = ("a request's offset is committed only after its Completion is acknowledged "
                 "(the lowest unfinished request holds the partition's commit back)")
CHANGELOG_READ = "from the beginning at start, to rebuild the table (faust recovery); nothing committed"


@dataclass(frozen=True)
class TopicSpec:
    """One topic. `key` says what the record key means (ordering holds per key).

    placement is "key" (the default partitioner hashes the key) or "reply_partition" (the
    writer picks the partition the request names: the gateway instance that holds the client).
    """

    name: str
    partitions: int
    key: str
    events: tuple[type[Event], ...]
    purpose: str
    configs: dict[str, str] = field(default_factory=dict)
    writers: tuple[Writer, ...] = ()
    readers: tuple[Reader, ...] = ()
    placement: str = "key"

    @property
    def compacted(self) -> bool:
        return "compact" in self.configs.get("cleanup.policy", "")

    @property
    def groups(self) -> list[str]:
        """The consumer groups that commit offsets on this topic."""
        return [r.group for r in self.readers if r.group]


def _retained(days: float, **extra: str) -> dict[str, str]:
    return {"cleanup.policy": "delete", "retention.ms": str(int(days * DAY_MS)), **extra}


AUDITOR = Reader("auditor (`tokenstream audit`)", None, "scan by time (offsets_for_times), nothing committed")

# min.insync.replicas=1 because the local stack has one broker; a production cluster
# overrides it (and the replication factor) through TOKENSTREAM_KAFKA_REPLICATION.
CHAT_REQUESTS = TopicSpec(
    "ts.chat.requests", 12, "tenant:conversation_id", (ChatRequest,),
    "requests as the gateway admitted them; input to the conversation processor",
    _retained(7),
    writers=(Writer("gateway", "once per admitted request, before the client gets its first byte"),),
    readers=(Reader("conversation processor", CONVERSATION_GROUP, FAUST_COMMIT), AUDITOR),
)
PREPARED = TopicSpec(
    "ts.requests.prepared", 12, "request_id", (InferenceRequest,),
    "requests with their full, trimmed history; input to the safety processor (and, for requests "
    "screened in parallel, to the router at once)",
    _retained(7),
    writers=(Writer("conversation processor", "history, preset and trimming applied"),),
    readers=(Reader("safety processor (input)", SAFETY_GROUP, FAUST_COMMIT),
             Reader("router (requests screened in parallel only)", ROUTER_GROUP, FAUST_COMMIT), AUDITOR),
)
SCREENED = TopicSpec(
    "ts.requests.screened", 12, "request_id", (InferenceRequest,),
    "requests whose input passed safety (screened in series); input to the router",
    _retained(7),
    writers=(Writer("safety processor", "the input verdict allowed a request screened in series"),),
    readers=(Reader("router", ROUTER_GROUP, FAUST_COMMIT), AUDITOR),
)
TOKENS = TopicSpec(
    "ts.tokens", 12, "request_id", (TokenChunk, Completion, SafetyVerdict, ToolResult),
    "generated tokens and completions (and, in band, blocking output verdicts, the input verdict "
    "of a request screened in parallel, and the server tools' results of a response run); "
    "the partition is chosen by the gateway that holds the connection",
    _retained(1, **{"message.timestamp.type": "LogAppendTime"}),
    writers=(
        Writer("gpu worker", "TokenChunk seq 0..n-1 per engine step, then Completion seq n"),
        Writer("safety processor", "a refusal (blocked input screened in series), the input verdict of a "
               "request screened in parallel, or a blocking output verdict, in band"),
        Writer("conversation processor / router", "an error Completion for a request they cannot pass on"),
        Writer("conversation processor (runs)", "each server tool's ToolResult of a response run, keyed by "
               "the step's request id, once per call id, before the next step is prepared"),
    ),
    readers=(
        Reader("gateway", None, "owns a fixed set of partitions per instance, reads from the end; "
               "a resume seeks by the request id's admission time; nothing committed"),
        Reader("gpu worker (takeover)", None, "reads the tokens already written for a request it takes over"),
        Reader("safety processor (output)", SAFETY_GROUP, FAUST_COMMIT),
        Reader("conversation processor (answers)", CONVERSATION_GROUP, FAUST_COMMIT),
        AUDITOR,
    ),
    placement="reply_partition",
)
CONTROL = TopicSpec(
    "ts.control", 3, "request_id", (Cancel,),
    "cancellations, read by every worker",
    _retained(1),
    writers=(Writer("gateway", "client disconnected past the grace period, or the cancel endpoint"),
             Writer("safety processor", "an output window was blocked")),
    readers=(Reader("gpu worker", None, "every worker reads every partition from 10 minutes before it "
                    "started (the cancels sent while no worker held a request); nothing committed"), AUDITOR),
)
VERDICTS = TopicSpec(
    "ts.safety.verdicts", 12, "request_id", (SafetyVerdict,),
    "safety classifications of inputs and output windows",
    _retained(30),
    writers=(Writer("safety processor", "every verdict, allowed or not, with its policy version"),),
    readers=(AUDITOR,),
)
TOOL_CALLS = TopicSpec(
    "ts.tool.calls", 6, "request_id", (ToolCall,), "tool invocations asked for by a model", _retained(7),
    writers=(Writer("gpu worker", "a generated call, once whole (id from the request id and the call's index), "
                    "besides its deltas on ts.tokens"),
             Writer("gateway", "a file_search call per POST /v1/vector_stores/{id}/search (the tenant the key's)")),
    readers=(Reader("tool processor", processor_group("tools"), "a call's offset is committed only after its "
                    "ToolResult is acknowledged; each call runs to completion once (Redis claim and result "
                    "per call id)"),
             AUDITOR),
)
TOOL_RESULTS = TopicSpec(
    "ts.tool.results", 6, "request_id", (ToolResult,), "outcomes of tool invocations", _retained(7),
    writers=(Writer("tool processor", "one result per server-tool ToolCall, keyed like the call"),),
    readers=(Reader("conversation processor (results)", CONVERSATION_GROUP, FAUST_COMMIT),
             Reader("gateway (vector store search)", None, "every partition from the end while it waits on "
                    "its own search calls; nothing committed"), AUDITOR),
)
INGEST_GROUP = processor_group("ingest")
FILE_INGEST = TopicSpec(
    "ts.files.ingest", 6, "vector_store_id:file_id", (FileIngest,),
    "uploaded files added to or taken out of a vector store; the tool processor indexes them in Weaviate",
    _retained(7),
    writers=(Writer("gateway", "a file added to a vector store (add), or taken out of it, deleted, or its "
                    "store deleted (remove); after the store-file record is written in Redis"),),
    readers=(Reader("tool processor (ingestion)", INGEST_GROUP, "an event's offset is committed only after "
                    "its outcome is recorded in the store-file record (Redis); an add whose generation the "
                    "record no longer holds, or that is already completed or failed, is passed over"),),
)
CONVERSATION_TURNS = TopicSpec(
    "ts.conversation.turns", 12, "tenant:conversation_id", (Completion, ToolResult, TurnDeadline),
    "finished answers and tool results re-keyed by conversation, so the history table can append "
    "them (and a response run go on to its next step); and the deadline of a turn parked for an "
    "answer that did not come",
    _retained(7),
    writers=(Writer("conversation processor (answers, results)", "every Completion on ts.tokens and every "
                    "ToolResult on ts.tool.results, re-keyed"),
             Writer("conversation processor (timer)", "a TurnDeadline when a parked turn's deadline passes")),
    readers=(Reader("conversation processor (history)", CONVERSATION_GROUP, FAUST_COMMIT), AUDITOR),
)
# Changelogs of the processors' faust tables. Faust names them <app id>-<table>-changelog;
# they are listed here so that `topics apply` owns their partitions and configs.
CONVERSATIONS = TopicSpec(
    "ts-conversation-history-changelog", 12, "tenant:conversation_id", (ConversationHistory,),
    "history of each conversation, the conversation processor's table (compacted)",
    {"cleanup.policy": "compact", "min.cleanable.dirty.ratio": "0.1", "segment.ms": str(DAY_MS)},
    writers=(Writer("conversation processor", "every change of a conversation's table row"),),
    readers=(Reader("conversation processor", None, CHANGELOG_READ),),
)
SAFETY_WINDOWS = TopicSpec(
    "ts-safety-windows-changelog", 12, "request_id", (OutputWindow,),
    "the text window under review of each streaming answer, the safety processor's table (compacted)",
    {"cleanup.policy": "compact", "min.cleanable.dirty.ratio": "0.1", "segment.ms": str(DAY_MS)},
    writers=(Writer("safety processor", "every change of an answer's window; a tombstone at its end"),),
    readers=(Reader("safety processor", None, CHANGELOG_READ),),
)
ROUTES = TopicSpec(
    "ts.routes", 1, "model", (RouteUpdate,),
    "routing weights per requested model (compacted: the latest weights win)",
    {"cleanup.policy": "compact"},
    writers=(Writer("operator (`tokenstream route set | rollback`)", "a change of weights"),),
    readers=(Reader("router", None, "every router reads it from the beginning, then follows it; "
                    "nothing committed"),),
)
DEAD_LETTER = TopicSpec(
    "ts.deadletter", 3, "original key", (DeadLetter,),
    "events no processor could decode or handle, with the reason and the original bytes",
    _retained(30),
    writers=(Writer("any role", "a record it cannot decode or handle, before committing past it"),),
    readers=(AUDITOR,),
)
#: How long the transcripts topic keeps the final record of each request (the per-token topic
#: keeps one day). TOKENSTREAM_AUDIT_RETENTION_DAYS changes it; `topics apply` applies it.
TRANSCRIPT_RETENTION_DAYS = float(os.environ.get("TOKENSTREAM_AUDIT_RETENTION_DAYS", "365"))
TRANSCRIPTS = TopicSpec(
    "ts.audit.transcripts", 12, "conversation_id", (Transcript,),
    "the final record of each request (question and whole answer), kept for audits",
    _retained(TRANSCRIPT_RETENTION_DAYS),
    writers=(Writer("conversation processor (history)", "once per answer, when it appends the answer "
                    "to the conversation's history"),),
    readers=(AUDITOR,),
)
RESCREEN_GROUP_PREFIX = "ts-audit-rescreen."
RESCREENED = TopicSpec(
    "ts.audit.rescreen.verdicts", 12, "request_id", (SafetyVerdict,),
    "verdicts of stored requests and answers re-judged under another safety policy (never the live ones)",
    _retained(TRANSCRIPT_RETENTION_DAYS),
    writers=(Writer("auditor (`tokenstream audit rescreen`)", "one verdict per stored input and answer, "
                    "stamped with the policy version it was judged under; the offsets it re-judged are "
                    "committed in group ts-audit-rescreen.<policy>"),),
    readers=(AUDITOR,),
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
        writers=(Writer("router", "the request's route chose this model"),),
        readers=(Reader("gpu worker", worker_group(model), WORKER_COMMIT),
                 Reader("gateway admission, router", None, "read the group's committed offsets "
                        "and end offsets (lag), never records"), AUDITOR),
    )


REGISTRY: tuple[TopicSpec, ...] = (
    CHAT_REQUESTS, PREPARED, SCREENED, TOKENS, CONTROL, VERDICTS, TOOL_CALLS, TOOL_RESULTS,
    FILE_INGEST, CONVERSATION_TURNS, CONVERSATIONS, SAFETY_WINDOWS, ROUTES, DEAD_LETTER, TRANSCRIPTS, RESCREENED,
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


#: The way of a request through the topics, in order (`topics describe --flow`).
FLOW: tuple[str, ...] = (
    CHAT_REQUESTS.name, CONVERSATIONS.name, PREPARED.name, VERDICTS.name, SCREENED.name,
    ROUTES.name, "ts.inference.<model>", TOOL_CALLS.name, TOOL_RESULTS.name, FILE_INGEST.name, TOKENS.name,
    SAFETY_WINDOWS.name, CONTROL.name, CONVERSATION_TURNS.name, TRANSCRIPTS.name, RESCREENED.name,
    DEAD_LETTER.name,
)


def flow(models: list[str]) -> list[TopicSpec]:
    """Every topic of `all_topics(models)`, in the order a request meets them."""
    out: list[TopicSpec] = []
    for name in FLOW:
        if name == "ts.inference.<model>":
            out += [inference_topic(m) for m in models]
        else:
            out.append(spec_for(name))
    listed = {s.name for s in out}
    return out + [s for s in REGISTRY if s.name not in listed]


#: Topics whose partitions must stay equal in number: one consumer joins them partition by
#: partition (a faust agent and the changelog of its table). `topics grow` grows them together.
CO_PARTITIONED: tuple[tuple[str, ...], ...] = (
    (CHAT_REQUESTS.name, CONVERSATION_TURNS.name, CONVERSATIONS.name),
    (TOKENS.name, SAFETY_WINDOWS.name),
)
#: Topics holding table rows by key: growing them moves existing keys to other partitions, so a
#: row (a conversation's history) is not found where its next event arrives.
KEYED_STATE = frozenset({CONVERSATIONS.name, SAFETY_WINDOWS.name})


def co_partitioned(name: str) -> tuple[str, ...]:
    """`name` and every topic that must keep its partition count."""
    for group in CO_PARTITIONED:
        if name in group:
            return group
    return (name,)
