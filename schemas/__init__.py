"""Typed, versioned contracts for every event tokenstream carries over Kafka.

Read this package and `topics/` to follow a request end to end:

    ChatRequest -> InferenceRequest -> TokenChunk* -> Completion
                       |                  |
                 SafetyVerdict       ToolCall -> ToolResult -> (a response run) the next step's
                                                               InferenceRequest (schemas/runs.py)
    InferenceRequest(shadow_of) -> Completion on ts.shadow.answers -> ShadowGate (`tokenstream shadow`)
    Cancel (control), DeadLetter (anything undecodable), Transcript (the audit record)
    Checkpoint (the tamper-evident ledger: signed digests of every content topic's records)
    FileIngest (an uploaded file into a vector store's index, or out of it)
    KeyHome (which region serves an API key: gateways send its requests home)
    PrefixHeld, WorkerLoad (which worker holds which conversation prefix: prefix-aware routing)
    SpeechJob -> TranscriptSegment* -> TranscriptDone, or SpeechAudio* -> SpeechDone
                                                          (voice: schemas/speech.py)

All events are msgspec Structs, encoded as JSON by `schemas.codec`. A worker's TokenChunks travel as
step records (`schemas.steps`): one ts.tokens record per reply partition per engine step, holding each
chunk as the record it would be on its own; every reader unpacks them first.
"""

from schemas.audit import Transcript
from schemas.base import SCHEMA_VERSION, Event
from schemas.codec import (
    DecodeError,
    Erased,
    MalformedEvent,
    UnsupportedVersion,
    decode,
    encode,
    use_sealer,
)
from schemas.control import Cancel, RouteUpdate, ShadowGate
from schemas.conversation import ConversationHistory, RunState, TurnDeadline
from schemas.deadletter import DeadLetter
from schemas.events import ALL_EVENTS
from schemas.files import FileIngest
from schemas.ledger import Checkpoint
from schemas.requests import ChatMessage, ChatRequest, InferenceRequest, SamplingParams, Screening
from schemas.routing import KeyHome, PrefixHeld, WorkerLoad, conversation_digest
from schemas.runs import SERVER_TOOLS, RunSpec
from schemas.safety import REFUSAL, OutputWindow, SafetyVerdict
from schemas.speech import (
    SpeakParams,
    SpeechAudio,
    SpeechDone,
    SpeechJob,
    TranscribeParams,
    TranscriptDone,
    TranscriptSegment,
)
from schemas.structured import (
    FunctionCall,
    FunctionSpec,
    MessageToolCall,
    OutputSpec,
    ToolCallDelta,
    ToolSpec,
    call_id,
)
from schemas.tokens import Completion, FinishReason, Timings, TokenChunk, TokenLogprob, TopLogprob, Usage
from schemas.tools import ToolCall, ToolResult
from schemas.tracing import TraceContext

__all__ = [
    "ALL_EVENTS",
    "REFUSAL",
    "SCHEMA_VERSION",
    "SERVER_TOOLS",
    "Cancel",
    "ChatMessage",
    "ChatRequest",
    "Checkpoint",
    "Completion",
    "ConversationHistory",
    "DeadLetter",
    "DecodeError",
    "Erased",
    "Event",
    "FileIngest",
    "FinishReason",
    "FunctionCall",
    "FunctionSpec",
    "InferenceRequest",
    "KeyHome",
    "MalformedEvent",
    "MessageToolCall",
    "OutputSpec",
    "OutputWindow",
    "PrefixHeld",
    "RouteUpdate",
    "RunSpec",
    "RunState",
    "SafetyVerdict",
    "SamplingParams",
    "Screening",
    "ShadowGate",
    "SpeakParams",
    "SpeechAudio",
    "SpeechDone",
    "SpeechJob",
    "Timings",
    "TokenChunk",
    "TokenLogprob",
    "ToolCall",
    "ToolCallDelta",
    "ToolResult",
    "ToolSpec",
    "TopLogprob",
    "TraceContext",
    "TranscribeParams",
    "Transcript",
    "TranscriptDone",
    "TranscriptSegment",
    "TurnDeadline",
    "UnsupportedVersion",
    "Usage",
    "WorkerLoad",
    "call_id",
    "conversation_digest",
    "decode",
    "encode",
    "use_sealer",
]
