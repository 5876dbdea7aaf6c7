"""Every event type, the union `schemas.codec.decode` reads when it is given no type."""

from __future__ import annotations

from schemas.audit import Transcript
from schemas.base import Event
from schemas.control import Cancel, RouteUpdate, ShadowGate
from schemas.conversation import ConversationHistory, TurnDeadline
from schemas.deadletter import DeadLetter
from schemas.files import FileIngest
from schemas.ledger import Checkpoint
from schemas.requests import ChatRequest, InferenceRequest
from schemas.routing import KeyHome, PrefixHeld, WorkerLoad
from schemas.safety import OutputWindow, SafetyVerdict
from schemas.speech import SpeechAudio, SpeechDone, SpeechJob, TranscriptDone, TranscriptSegment
from schemas.tokens import Completion, TokenChunk
from schemas.tools import ToolCall, ToolResult

ALL_EVENTS: tuple[type[Event], ...] = (
    ChatRequest,
    InferenceRequest,
    TokenChunk,
    Completion,
    ToolCall,
    ToolResult,
    SafetyVerdict,
    Cancel,
    RouteUpdate,
    ShadowGate,
    ConversationHistory,
    OutputWindow,
    DeadLetter,
    Transcript,
    FileIngest,
    TurnDeadline,
    PrefixHeld,
    KeyHome,
    WorkerLoad,
    Checkpoint,
    SpeechJob,
    TranscriptSegment,
    TranscriptDone,
    SpeechAudio,
    SpeechDone,
)
