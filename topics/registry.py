"""Topic specifications. `tokenstream topics apply` makes the cluster match this file.

Every topic also names who writes it and who reads it: a `Role` (one per role's package), and for
a reader its consumer group (or None: group-less) and commit rule. That is the map `tokenstream
topics describe --flow` prints, what `tokenstream audit` and `tokenstream ops` are built on, and
what tests/test_topic_map_code.py holds against the code of every role.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from enum import StrEnum

from schemas import (
    Cancel,
    ChatRequest,
    Checkpoint,
    Completion,
    ConversationHistory,
    DeadLetter,
    Event,
    FileIngest,
    InferenceRequest,
    KeyHome,
    OutputWindow,
    PrefixHeld,
    RouteUpdate,
    SafetyVerdict,
    ShadowGate,
    SpeechAudio,
    SpeechDone,
    SpeechJob,
    TokenChunk,
    ToolCall,
    ToolResult,
    Transcript,
    TranscriptDone,
    TranscriptSegment,
    TurnDeadline,
    WorkerLoad,
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


class Role(StrEnum):
    """Who writes or reads a topic: one value per role's package (tests/test_topic_map_code.py
    derives each role's writes and reads from its package's code and compares them with this map)."""

    GATEWAY = "gateway"  # gateway/
    CONVERSATION = "conversation"  # processors/conversation
    SAFETY = "safety"  # processors/safety
    ROUTER = "router"  # processors/router
    WORKER = "worker"  # gpu_workers/
    TOOLS = "tools"  # tools/ (the tool processor and file ingestion)
    AUDIT = "audit"  # audit/ (`tokenstream audit`)
    OPERATOR = "operator"  # tokenstream/ (the top-level CLI: `tokenstream route`, `tokenstream chaos`)

    @property
    def title(self) -> str:
        """The role as the map prints it."""
        return _TITLES[self]


_TITLES = {
    Role.GATEWAY: "gateway",
    Role.CONVERSATION: "conversation processor",
    Role.SAFETY: "safety processor",
    Role.ROUTER: "router",
    Role.WORKER: "gpu worker",
    Role.TOOLS: "tool processor",
    Role.AUDIT: "auditor",
    Role.OPERATOR: "operator",
}


@dataclass(frozen=True)
class Writer:
    """A role that writes the topic; `when` says when, in words."""

    role: Role
    when: str

    def __post_init__(self) -> None:
        if not isinstance(self.role, Role):
            raise TypeError(f"writer role {self.role!r} is not a Role")


@dataclass(frozen=True)
class Reader:
    """A role that reads the topic, in consumer group `group` (None: group-less, manual assignment,
    nothing committed) under the commit rule `commit`; `purpose`, in words, what the role reads it for."""

    role: Role
    group: str | None
    commit: str
    purpose: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.role, Role):
            raise TypeError(f"reader role {self.role!r} is not a Role")


# Commit rules, named once.
FAUST_COMMIT = (
    "faust at-least-once: commits every 0.2 s what the agent has handled and its outputs "
    "acknowledged; each effect done once per request id (Redis)"
)
WORKER_COMMIT = (
    "a request's offset is committed only after its Completion is acknowledged "
    "(the lowest unfinished request holds the partition's commit back)"
)
CHANGELOG_READ = "from the beginning at start, to rebuild the table (faust recovery); nothing committed"
LAG_READ = "reads the group's committed offsets and end offsets (lag), never records"


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
    mirrored: bool = False  # MirrorMaker 2 copies it to every other region's cluster as <region>.<name>

    @property
    def compacted(self) -> bool:
        return "compact" in self.configs.get("cleanup.policy", "")

    @property
    def groups(self) -> list[str]:
        """The consumer groups that commit offsets on this topic."""
        return [r.group for r in self.readers if r.group]


def _retained(days: float, **extra: str) -> dict[str, str]:
    return {"cleanup.policy": "delete", "retention.ms": str(int(days * DAY_MS)), **extra}


AUDITOR = Reader(
    Role.AUDIT,
    None,
    "scan by time (offsets_for_times), nothing committed",
    "`tokenstream audit`: a request, a conversation or a time range",
)
# Roles that write what they cannot decode or handle to ts.deadletter (DEAD_LETTER's writers).
DEAD_LETTERING = (Role.CONVERSATION, Role.SAFETY, Role.ROUTER, Role.WORKER, Role.TOOLS)

# Replication and min.insync.replicas are the cluster's (one copy on one broker, three and two on the
# local three-node cluster, `stack up --brokers 3`), not the topics': TOKENSTREAM_KAFKA_REPLICATION
# overrides the copies `topics apply` gives new topics.
CHAT_REQUESTS = TopicSpec(
    "ts.chat.requests",
    12,
    "tenant:conversation_id",
    (ChatRequest,),
    "requests as the gateway admitted them; input to the conversation processor",
    _retained(7),
    writers=(
        Writer(
            Role.GATEWAY,
            "once per admitted request, before the client gets its first byte; a request "
            "answered from the cache too, beside its answer's events on ts.tokens, for the audit",
        ),
    ),
    readers=(Reader(Role.CONVERSATION, CONVERSATION_GROUP, FAUST_COMMIT, "the turns it prepares"), AUDITOR),
)
PREPARED = TopicSpec(
    "ts.requests.prepared",
    12,
    "request_id",
    (InferenceRequest,),
    "requests with their full, trimmed history; input to the safety processor (and, for requests "
    "screened in parallel, to the router at once)",
    _retained(7),
    writers=(
        Writer(Role.CONVERSATION, "history, preset and trimming applied"),
        Writer(Role.GATEWAY, "POST /v1/moderations: a text to judge only (screening moderation)"),
    ),
    readers=(
        Reader(Role.SAFETY, SAFETY_GROUP, FAUST_COMMIT, "the input check"),
        Reader(Role.ROUTER, ROUTER_GROUP, FAUST_COMMIT, "requests screened in parallel only"),
        AUDITOR,
    ),
)
SCREENED = TopicSpec(
    "ts.requests.screened",
    12,
    "request_id",
    (InferenceRequest,),
    "requests whose input passed safety (screened in series); input to the router",
    _retained(7),
    writers=(Writer(Role.SAFETY, "the input verdict allowed a request screened in series"),),
    readers=(Reader(Role.ROUTER, ROUTER_GROUP, FAUST_COMMIT, "requests screened in series"), AUDITOR),
)
TOKENS = TopicSpec(
    "ts.tokens",
    12,
    "request_id",
    (
        TokenChunk,
        Completion,
        SafetyVerdict,
        ToolResult,
        TranscriptSegment,
        TranscriptDone,
        SpeechAudio,
        SpeechDone,
    ),
    "generated tokens and completions (and, in band, blocking output verdicts, the input verdict "
    "of a request screened in parallel, the server tools' results of a response run, and the "
    "results of speech jobs); the partition is chosen by the gateway that holds the connection. A "
    "worker's chunks come as step records (event-type token_step: one record per reply partition per "
    "engine step, holding every chunk of that step on it; schemas/steps.py), which every reader "
    "unpacks first; every other event is a record of its own",
    _retained(1, **{"message.timestamp.type": "LogAppendTime"}),
    writers=(
        Writer(
            Role.WORKER,
            "TokenChunk seq 0..n-1 per engine step, a step's chunks as one step record per reply "
            "partition (schemas/steps.py; step_records=false: each chunk a record of its own), then "
            "Completion seq n, after the step record holding its last chunk",
        ),
        Writer(
            Role.SAFETY,
            "a refusal (blocked input screened in series), the input verdict of a "
            "request screened in parallel, or a blocking output verdict, in band; for a moderated request "
            "(OutputSpec.moderated) its input verdict and, after its Completion, one over the whole answer",
        ),
        Writer(
            Role.CONVERSATION,
            "an error Completion for a request it cannot pass on; each server tool's "
            "ToolResult of a response run, keyed by the step's request id, once per call id, before the "
            "next step is prepared",
        ),
        Writer(Role.ROUTER, "an error Completion for a request no worker group serves"),
        Writer(Role.GATEWAY, "the events of an answer served from the cache, on the request's own partition"),
        Writer(
            Role.TOOLS,
            "a speech job's TranscriptSegments then TranscriptDone, or SpeechAudio chunks then "
            "SpeechDone, seq without gaps, on the job's reply partition",
        ),
    ),
    readers=(
        Reader(
            Role.GATEWAY,
            None,
            "owns a fixed set of partitions per instance, reads from the end; "
            "a resume seeks by the request id's admission time; nothing committed",
            "the streams it serves",
        ),
        Reader(
            Role.WORKER,
            None,
            "reads the tokens already written for a request it takes over; nothing committed",
            "takeover",
        ),
        Reader(Role.SAFETY, SAFETY_GROUP, FAUST_COMMIT, "the output windows"),
        Reader(Role.CONVERSATION, CONVERSATION_GROUP, FAUST_COMMIT, "the answers, re-keyed to the turns"),
        Reader(
            Role.OPERATOR,
            None,
            "every partition from a start time to its end; nothing committed",
            (
                "`tokenstream chaos`: the drill's check of every answer; "
                "`tokenstream shadow`: the served answers"
            ),
        ),
        AUDITOR,
    ),
    placement="reply_partition",
)
CONTROL = TopicSpec(
    "ts.control",
    3,
    "request_id",
    (Cancel,),
    "cancellations, read by every worker",
    _retained(1),
    writers=(
        Writer(Role.GATEWAY, "client disconnected past the grace period, or the cancel endpoint"),
        Writer(Role.SAFETY, "an output window was blocked, or the input of a request screened in parallel"),
    ),
    readers=(
        Reader(
            Role.WORKER,
            None,
            "every worker reads every partition from 10 minutes before it "
            "started (the cancels sent while no worker held a request); nothing committed",
            "the cancels of the requests it holds",
        ),
        AUDITOR,
    ),
)
VERDICTS = TopicSpec(
    "ts.safety.verdicts",
    12,
    "request_id",
    (SafetyVerdict,),
    "safety classifications of inputs and output windows",
    _retained(30),
    writers=(Writer(Role.SAFETY, "every verdict, allowed or not, with its policy version"),),
    readers=(AUDITOR,),
)
TOOL_CALLS = TopicSpec(
    "ts.tool.calls",
    6,
    "request_id",
    (ToolCall,),
    "tool invocations asked for by a model",
    _retained(7),
    writers=(
        Writer(
            Role.WORKER,
            "a generated call, once whole (id from the request id and the call's index), "
            "besides its deltas on ts.tokens",
        ),
        Writer(
            Role.GATEWAY, "a file_search call per POST /v1/vector_stores/{id}/search (the tenant the key's)"
        ),
    ),
    readers=(
        Reader(
            Role.TOOLS,
            processor_group("tools"),
            "a call's offset is committed only after its "
            "ToolResult is acknowledged; each call runs to completion once (Redis claim and result "
            "per call id)",
            "the server tools' calls",
        ),
        AUDITOR,
    ),
)
TOOL_RESULTS = TopicSpec(
    "ts.tool.results",
    6,
    "request_id",
    (ToolResult,),
    "outcomes of tool invocations",
    _retained(7),
    writers=(Writer(Role.TOOLS, "one result per server-tool ToolCall, keyed like the call"),),
    readers=(
        Reader(Role.CONVERSATION, CONVERSATION_GROUP, FAUST_COMMIT, "the results, re-keyed to the turns"),
        Reader(
            Role.GATEWAY,
            None,
            "every partition from the end while it waits on its own search calls; nothing committed",
            "vector store search",
        ),
        Reader(
            Role.TOOLS,
            None,
            "the key's partition from the call's time, before a stored result is "
            "replayed (written already by a processor killed before its mark?); nothing committed",
            "a replay checked against the log",
        ),
        AUDITOR,
    ),
)
INGEST_GROUP = processor_group("ingest")
FILE_INGEST = TopicSpec(
    "ts.files.ingest",
    6,
    "vector_store_id:file_id",
    (FileIngest,),
    "uploaded files added to or taken out of a vector store; the tool processor indexes them in Weaviate",
    _retained(7),
    writers=(
        Writer(
            Role.GATEWAY,
            "a file added to a vector store (add), or taken out of it, deleted, or its "
            "store deleted (remove); after the store-file record is written in Redis",
        ),
    ),
    readers=(
        Reader(
            Role.TOOLS,
            INGEST_GROUP,
            "an event's offset is committed only after its outcome is "
            "recorded in the store-file record (Redis); an add whose generation the record no longer "
            "holds, or that is already completed or failed, is passed over",
            "ingestion",
        ),
    ),
)
SPEECH_GROUP = processor_group("speech")
SPEECH_JOBS = TopicSpec(
    "ts.speech.jobs",
    6,
    "request_id",
    (SpeechJob,),
    "speech to transcribe (the recording in the durable store) or text to speak; the tool processor's "
    "speech loop answers on ts.tokens",
    _retained(7),
    writers=(
        Writer(
            Role.GATEWAY, "a transcription or speech request, after the recording is in the durable store"
        ),
    ),
    readers=(
        Reader(
            Role.TOOLS,
            SPEECH_GROUP,
            "a job's offset is committed after its last result is "
            "acknowledged; one cut short is done again from the start (the gateway drops what it saw "
            "already by seq)",
            "speech",
        ),
    ),
)
CONVERSATION_TURNS = TopicSpec(
    "ts.conversation.turns",
    12,
    "tenant:conversation_id",
    (Completion, ToolResult, TurnDeadline),
    "finished answers and tool results re-keyed by conversation, so the history table can append "
    "them (and a response run go on to its next step); and the deadline of a turn parked for an "
    "answer that did not come",
    _retained(7),
    writers=(
        Writer(
            Role.CONVERSATION,
            "every Completion on ts.tokens and every ToolResult on ts.tool.results, "
            "re-keyed; a TurnDeadline when a parked turn's deadline passes (its timer)",
        ),
    ),
    readers=(Reader(Role.CONVERSATION, CONVERSATION_GROUP, FAUST_COMMIT, "the history"), AUDITOR),
)
# Changelogs of the processors' faust tables. Faust names them <app id>-<table>-changelog;
# they are listed here so that `topics apply` owns their partitions and configs.
CONVERSATIONS = TopicSpec(
    "ts-conversation-history-changelog",
    12,
    "tenant:conversation_id",
    (ConversationHistory,),
    "history of each conversation, the conversation processor's table (compacted)",
    {"cleanup.policy": "compact", "min.cleanable.dirty.ratio": "0.1", "segment.ms": str(DAY_MS)},
    writers=(Writer(Role.CONVERSATION, "every change of a conversation's table row"),),
    readers=(Reader(Role.CONVERSATION, None, CHANGELOG_READ, "its table"),),
)
SAFETY_WINDOWS = TopicSpec(
    "ts-safety-windows-changelog",
    12,
    "request_id",
    (OutputWindow,),
    "the text window under review of each streaming answer, the safety processor's table (compacted)",
    {"cleanup.policy": "compact", "min.cleanable.dirty.ratio": "0.1", "segment.ms": str(DAY_MS)},
    writers=(Writer(Role.SAFETY, "every change of an answer's window; a tombstone at its end"),),
    readers=(Reader(Role.SAFETY, None, CHANGELOG_READ, "its table"),),
)
ROUTES = TopicSpec(
    "ts.routes",
    1,
    "model",
    (RouteUpdate,),
    "routing weights per requested model (compacted: the latest weights win)",
    {"cleanup.policy": "compact"},
    writers=(Writer(Role.OPERATOR, "a change of weights (`tokenstream route set | rollback`)"),),
    readers=(
        Reader(
            Role.ROUTER,
            None,
            "every router reads it from the beginning, then follows it; nothing committed",
            "the weights it routes by",
        ),
        Reader(
            Role.OPERATOR,
            None,
            "from the beginning to the end; nothing committed",
            "`tokenstream route show`",
        ),
    ),
)
SHADOW_ANSWERS = TopicSpec(
    "ts.shadow.answers",
    6,
    "request_id",
    (Completion,),
    "a candidate model's answers to replayed requests (`tokenstream shadow`): never a client's, so apart "
    "from ts.tokens",
    _retained(7),
    writers=(
        Writer(Role.WORKER, "the Completion of a request with shadow_of set (no chunks, no tool calls)"),
    ),
    readers=(
        Reader(
            Role.OPERATOR,
            None,
            "every partition from the evaluation's start; nothing committed",
            "`tokenstream shadow`: the candidate's answers",
        ),
        AUDITOR,
    ),
)
SHADOW_GATES = TopicSpec(
    "ts.shadow.gates",
    1,
    "candidate model",
    (ShadowGate,),
    "each candidate's latest shadow evaluation and whether it passed its gate (compacted)",
    {"cleanup.policy": "compact"},
    writers=(Writer(Role.OPERATOR, "`tokenstream shadow`: one per evaluation"),),
    readers=(
        Reader(
            Role.OPERATOR,
            None,
            "from the beginning to the end; nothing committed",
            "`tokenstream route set`: a target other than the requested model needs a passed gate",
        ),
    ),
)
KV_PREFIXES = TopicSpec(
    "ts.kv.prefixes",
    1,
    "digest (PrefixHeld) or worker (WorkerLoad)",
    (PrefixHeld, WorkerLoad),
    "which worker holds each conversation prefix in its KV cache, and each worker's partitions and load "
    "(compacted: the latest holder of a prefix, the latest heartbeat of a worker; a day at most)",
    {
        "cleanup.policy": "compact,delete",
        "retention.ms": str(DAY_MS),
        "min.cleanable.dirty.ratio": "0.1",
        "segment.ms": str(DAY_MS // 24),
    },
    writers=(
        Writer(
            Role.WORKER,
            "a PrefixHeld at each answer that ended in text (stop or length); a WorkerLoad every second",
        ),
    ),
    readers=(
        Reader(
            Role.ROUTER,
            None,
            "every router reads it from the beginning, then follows it; nothing committed",
            "prefix-aware routing: a conversation's next turn to the worker holding its prefix",
        ),
    ),
)
KEY_HOMES = TopicSpec(
    "ts.key.homes",
    1,
    "sha256 of the API key",
    (KeyHome,),
    "the home region of every API key (compacted: the latest wins). The one topic shared across regions: "
    "MirrorMaker 2 copies it to each other region's cluster as <region>.ts.key.homes, so a gateway anywhere "
    "knows where to send a key's requests; it holds digests and region names, nothing of a tenant",
    {"cleanup.policy": "compact", "min.cleanable.dirty.ratio": "0.1"},
    writers=(
        Writer(
            Role.GATEWAY,
            "the home of each key of its region's durable store the topic lacks (at start, "
            "then as keys are made); only where the deployment names regions",
        ),
    ),
    readers=(
        Reader(
            Role.GATEWAY,
            None,
            "from the beginning, then follows it, with the other regions' mirrors of it; nothing committed",
            "where a key's requests are served (a key at home elsewhere: proxied there, or 421)",
        ),
    ),
    mirrored=True,
)
DEAD_LETTER = TopicSpec(
    "ts.deadletter",
    3,
    "original key",
    (DeadLetter,),
    "events no processor could decode or handle, with the reason and the original bytes",
    _retained(30),
    writers=tuple(
        Writer(role, "a record it cannot decode or handle, before committing past it")
        for role in DEAD_LETTERING
    ),
    readers=(AUDITOR,),
)
#: How long the transcripts topic keeps the final record of each request (the per-token topic
#: keeps one day). TOKENSTREAM_AUDIT_RETENTION_DAYS changes it; `topics apply` applies it.
TRANSCRIPT_RETENTION_DAYS = float(os.environ.get("TOKENSTREAM_AUDIT_RETENTION_DAYS", "365"))
TRANSCRIPTS = TopicSpec(
    "ts.audit.transcripts",
    12,
    "conversation_id",
    (Transcript,),
    "the final record of each request (question and whole answer), kept for audits",
    _retained(TRANSCRIPT_RETENTION_DAYS),
    writers=(
        Writer(
            Role.CONVERSATION, "once per answer, when it appends the answer to the conversation's history"
        ),
    ),
    readers=(AUDITOR,),
)
RESCREEN_GROUP_PREFIX = "ts-audit-rescreen."
RESCREENED = TopicSpec(
    "ts.audit.rescreen.verdicts",
    12,
    "request_id",
    (SafetyVerdict,),
    "verdicts of stored requests and answers re-judged under another safety policy (never the live ones)",
    _retained(TRANSCRIPT_RETENTION_DAYS),
    writers=(
        Writer(
            Role.AUDIT,
            "`tokenstream audit rescreen`: one verdict per stored input and answer, "
            "stamped with the policy version it was judged under; the offsets it re-judged are "
            "committed in group ts-audit-rescreen.<policy>",
        ),
    ),
    readers=(AUDITOR,),
)

LEDGER = TopicSpec(
    "ts.audit.ledger",
    6,
    "<topic>/<partition> it attests",
    (Checkpoint,),
    "the tamper-evident ledger: signed checkpoints of every audited topic's records, each chained "
    "to the one before it on its partition (schemas/ledger.py)",
    _retained(TRANSCRIPT_RETENTION_DAYS),
    writers=(
        Writer(
            Role.AUDIT,
            "`tokenstream audit notarize`: per partition that moved, every few seconds or 500 records",
        ),
    ),
    readers=(
        Reader(
            Role.AUDIT,
            None,
            "from the beginning: the last checkpoint of each partition (notarize), "
            "the checkpoints of a range (verify, export); nothing committed",
            "`tokenstream audit notarize | verify | export`",
        ),
    ),
)

INFERENCE_PARTITIONS = 12
INFERENCE_RETENTION_DAYS = 7


def inference_topic(model: str) -> TopicSpec:
    """The inference-request topic of one model group (one topic per served model)."""
    slug = re.sub(r"[^a-zA-Z0-9._-]+", "-", model).strip("-").lower()
    if not slug:
        raise ValueError(f"model name {model!r} gives an empty topic name")
    return TopicSpec(
        f"ts.inference.{slug}",
        INFERENCE_PARTITIONS,
        "request_id",
        (InferenceRequest,),
        f"inference requests for model {model}; its worker group consumes them",
        _retained(INFERENCE_RETENTION_DAYS),
        writers=(
            Writer(Role.ROUTER, "the request's route chose this model"),
            Writer(
                Role.OPERATOR,
                "`tokenstream shadow`: a served request replayed to a candidate "
                "(shadow_of set), rate-limited, never answered to a client",
            ),
        ),
        readers=(
            Reader(Role.WORKER, worker_group(model), WORKER_COMMIT, "the requests it serves"),
            Reader(Role.GATEWAY, None, LAG_READ, "admission"),
            Reader(Role.ROUTER, None, LAG_READ, "overflow to another model"),
            Reader(
                Role.OPERATOR,
                None,
                "a time range (offsets_for_times); nothing committed",
                "`tokenstream shadow`: the served requests it replays",
            ),
            AUDITOR,
        ),
    )


REGISTRY: tuple[TopicSpec, ...] = (
    CHAT_REQUESTS,
    PREPARED,
    SCREENED,
    TOKENS,
    CONTROL,
    VERDICTS,
    TOOL_CALLS,
    TOOL_RESULTS,
    FILE_INGEST,
    SPEECH_JOBS,
    CONVERSATION_TURNS,
    CONVERSATIONS,
    SAFETY_WINDOWS,
    ROUTES,
    KV_PREFIXES,
    DEAD_LETTER,
    TRANSCRIPTS,
    RESCREENED,
    LEDGER,
    SHADOW_ANSWERS,
    SHADOW_GATES,
    KEY_HOMES,
)


def mirror_of(spec: TopicSpec, region: str) -> str:
    """The name MirrorMaker 2 gives `spec`'s copy from `region` (its default replication policy)."""
    if not spec.mirrored:
        raise ValueError(f"{spec.name} is not mirrored between regions")
    return f"{region}.{spec.name}"


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
    CHAT_REQUESTS.name,
    CONVERSATIONS.name,
    PREPARED.name,
    VERDICTS.name,
    SCREENED.name,
    ROUTES.name,
    KV_PREFIXES.name,
    "ts.inference.<model>",
    TOOL_CALLS.name,
    TOOL_RESULTS.name,
    FILE_INGEST.name,
    SPEECH_JOBS.name,
    TOKENS.name,
    SAFETY_WINDOWS.name,
    CONTROL.name,
    CONVERSATION_TURNS.name,
    TRANSCRIPTS.name,
    RESCREENED.name,
    LEDGER.name,
    DEAD_LETTER.name,
    KEY_HOMES.name,
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
