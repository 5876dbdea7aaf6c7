"""One request's events folded into an audit: timeline rows, the text the client saw, the gap check.

The client's text follows the gateway's rules: token chunks on the tokens topic in log order, a
seq at or below one already taken dropped, until the Completion or a blocking output verdict in
band; for a request screened in parallel (`schemas.Screening`) the answer is held until its input
verdict arrives in band, and a blocking one replaces it with the refusal (an error or a blocked
output before that verdict ends it with nothing). The gap check holds when:

    seq        the chunks' seqs are 0..n-1 with no hole, and the Completion's seq is n
    completion exactly one Completion on the tokens topic (none yet: the request is open); a
               request refused while generating in parallel may have none (the gateway ends it), and
               one of tool calls alone (a vector store search the gateway made) asks none
    block      after a block nothing more reached the client: a blocked input screened in series
               never reached a worker; one screened in parallel, and a blocked output, were followed
               by a Cancel to the workers
    tools      every ToolCall has a ToolResult with its call_id
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from audit.hops import Marks, hop_times
from schemas import (
    REFUSAL,
    Cancel,
    ChatRequest,
    Completion,
    DeadLetter,
    Event,
    InferenceRequest,
    SafetyVerdict,
    TokenChunk,
    ToolCall,
    ToolResult,
    Transcript,
    TurnDeadline,
)
from topics import PREPARED, SCREENED, TOKENS, TRANSCRIPTS, VERDICTS

TEXT_SHOWN = 80  # characters of a message or a text run shown in a timeline row


class Chunk(msgspec.Struct, kw_only=True, tag_field="type", tag="token_chunk"):
    """A TokenChunk as the audit reads it when nothing is exported: the fields the fold uses, the
    rest of the record (token ids, call deltas, raw text) skipped by the decoder, never built."""

    request_id: str
    conversation_id: str = ""
    tenant: str = "default"
    seq: int
    text: str
    worker_id: str = ""
    v: int = 1


CHUNKS = (TokenChunk, Chunk)


@dataclass
class ErasedRecord:
    """A record whose content's key `tokenstream erase` destroyed: only its clear fields are left
    (ids, times, tenant, the event's type; schemas/sealing.py). Its bytes still verify in the ledger."""

    kind: str
    request_id: str
    conversation_id: str = ""
    tenant: str = ""

    @classmethod
    def of(cls, clear: dict) -> ErasedRecord:
        return cls(
            kind=str(clear.get("type", "?")),
            request_id=str(clear.get("request_id", "")),
            conversation_id=str(clear.get("conversation_id", "")),
            tenant=str(clear.get("tenant", "")),
        )


@dataclass
class Row:
    timestamp: int  # ms
    topic: str
    where: str  # partition@offset (or a range of offsets for folded chunks)
    kind: str
    detail: str


@dataclass
class Audit:
    request_id: str
    conversation_id: str = ""
    tenant: str = ""
    model: str = ""
    first_ms: int = 0
    last_ms: int = 0
    rows: list[Row] = field(default_factory=list)
    client_text: list[str] = field(default_factory=list)
    client_done: bool = False
    next_seq: int = 0
    seqs: set[int] = field(default_factory=set)
    duplicates: int = 0
    withheld: int = 0  # chunks written after the client's stream ended (block, cancel)
    completions: list[Completion] = field(default_factory=list)
    input_blocked: bool = False
    output_blocked: bool = False
    reached_worker: bool = False
    cancelled_after_block: bool = False
    tool_calls: dict[str, str] = field(default_factory=dict)
    tool_results: set[str] = field(default_factory=set)
    dead_letters: int = 0
    transcript: Transcript | None = None
    events: int = 0
    open_ok: bool = False  # no completion yet, but the request may still be running
    input_text: str = ""  # the newest user message, as the safety processor judged it
    live_input: SafetyVerdict | None = None  # the live input verdict (ts.safety.verdicts)
    live_output: SafetyVerdict | None = None  # the first blocking live output verdict, if any
    parallel: bool = False  # screened in parallel: the answer is held until the input verdict
    screened: bool = False  # the in-band input verdict of a parallel request has arrived
    refused: bool = False  # that verdict blocked: the client got the refusal
    timeline: bool = True  # False: only what the gap check and a summary need (range scans)
    tools_only: bool = True  # only ToolCalls and ToolResults so far: no model was asked (a search)
    marks: Marks = field(default_factory=Marks)  # when the request reached each hop (audit.hops)
    first_token_ms: int = 0  # the first generated chunk's timestamp (the mark, kept cheaply)
    _run: list = field(default_factory=list)  # token chunks not yet folded into a row
    erased: int = 0  # records whose content was erased (`tokenstream erase`): the answer cannot be checked

    # ------------------------------------------------------------------ folding

    def add(
        self, topic: str, partition: int, offset: int, timestamp: int, event: Event | ErasedRecord
    ) -> None:
        if isinstance(event, ErasedRecord):
            self._erased(topic, partition, offset, timestamp, event)
            return
        if topic == TOKENS.name and isinstance(event, CHUNKS):
            self.chunk(partition, offset, timestamp, event)
            return
        self.events += 1
        if not self.first_ms or timestamp < self.first_ms:
            self.first_ms = timestamp
        self.last_ms = max(self.last_ms, timestamp)
        if not self.tenant:
            self.conversation_id, self.tenant = event.conversation_id, event.tenant
        self._note(topic, event, timestamp)
        if self.timeline:
            self._flush()
            self.rows.append(
                Row(
                    timestamp,
                    topic,
                    f"{partition}@{offset}",
                    type(event).__struct_config__.tag,
                    describe(event),
                )
            )

    def _erased(self, topic: str, partition: int, offset: int, timestamp: int, record: ErasedRecord) -> None:
        self.events += 1
        self.erased += 1
        self.tools_only = False
        self.first_ms = min(self.first_ms or timestamp, timestamp)
        self.last_ms = max(self.last_ms, timestamp)
        if not self.tenant:
            self.conversation_id, self.tenant = record.conversation_id, record.tenant
        if self.timeline:
            self._flush()
            self.rows.append(Row(timestamp, topic, f"{partition}@{offset}", record.kind, "(content erased)"))

    def chunk(self, partition: int, offset: int, timestamp: int, chunk: TokenChunk | Chunk) -> None:
        """A token chunk on the tokens topic: most of every request's events, so kept to the essentials."""
        self.events += 1
        self.tools_only = False
        self.last_ms = max(self.last_ms, timestamp)
        if not self.first_ms or timestamp < self.first_ms:
            self.first_ms = timestamp
        if not self.tenant:
            self.conversation_id, self.tenant = chunk.conversation_id, chunk.tenant
        seq, seqs = chunk.seq, self.seqs
        if seq in seqs:
            self.duplicates += 1
        else:
            seqs.add(seq)
        if chunk.worker_id:
            self.reached_worker = True
            if not self.first_token_ms or timestamp < self.first_token_ms:
                self.first_token_ms = timestamp
        if self.client_done:
            self.withheld += 1
        elif seq >= self.next_seq:
            self.client_text.append(chunk.text)
            self.next_seq = seq + 1
        if self.timeline:
            self._run.append((partition, offset, timestamp, chunk))

    def _flush(self) -> None:
        if not self._run:
            return
        partition, first, ts, head = self._run[0]
        last = self._run[-1]
        text = "".join(c.text for *_, c in self._run)
        span = (
            f"seq {head.seq}" if len(self._run) == 1 else f"seq {head.seq}..{last[3].seq} ({len(self._run)})"
        )
        self.rows.append(
            Row(
                ts,
                TOKENS.name,
                f"{partition}@{first}" + (f"..{last[1]}" if len(self._run) > 1 else ""),
                "token_chunks",
                f"{span} {_short(text)!r}",
            )
        )
        self._run.clear()

    def _note(self, topic: str, event: Event, timestamp: int) -> None:
        """What the gap check, the summary and the hop times need from one event (no text is built here)."""
        if not isinstance(event, ToolCall | ToolResult | DeadLetter):
            self.tools_only = False
        if isinstance(event, ChatRequest | InferenceRequest) and event.screening == "parallel":
            self.parallel = True
        at = timestamp / 1000
        if isinstance(event, ChatRequest):
            self.model = self.model or event.model
            self.marks.admitted = event.created_at or None
            self.marks.first("chat", at)
        elif isinstance(event, InferenceRequest):
            if topic == PREPARED.name:
                self.input_text = next((m.content for m in reversed(event.messages) if m.role == "user"), "")
                self.marks.first("prepared", at)
            elif topic == SCREENED.name:
                self.marks.first("screened", at)
            elif topic.startswith("ts.inference."):
                self.reached_worker = True
                self.model = event.model
                self.marks.first("inference", at)
        elif isinstance(event, SafetyVerdict):
            if topic == VERDICTS.name and event.stage == "input":
                self.live_input = event
            if (
                topic == VERDICTS.name
                and event.stage == "output"
                and event.blocked
                and self.live_output is None
            ):
                self.live_output = event
            if event.blocked and event.stage == "input" and topic in (VERDICTS.name, TOKENS.name):
                self.input_blocked = True
            if event.stage == "input" and topic == TOKENS.name:  # in band: screened in parallel
                self.parallel = self.screened = True
                if event.blocked and not self.refused:
                    self.refused = self.client_done = True
                    self.withheld += len(self.client_text)
                    self.client_text = [REFUSAL]
            if event.blocked and event.stage == "output" and topic == TOKENS.name:
                self.output_blocked = True
                self._ended_before_screening()
                self.client_done = True
        elif isinstance(event, Completion):
            if topic == TOKENS.name:
                if not self.completions:
                    self.marks.completion, self.marks.timings = at, event.timings
                self.completions.append(event)
                if event.finish_reason == "error":
                    self._ended_before_screening()
                self.client_done = True
        elif isinstance(event, Cancel):
            if self.output_blocked or (self.input_blocked and self.parallel):
                self.cancelled_after_block = True
        elif isinstance(event, ToolCall):
            self.tool_calls[event.call_id] = event.name
        elif isinstance(event, ToolResult):
            self.tool_results.add(event.call_id)
        elif isinstance(event, DeadLetter):
            self.dead_letters += 1
        elif isinstance(event, Transcript) and topic == TRANSCRIPTS.name:
            self.transcript = event

    def _ended_before_screening(self) -> None:
        """An error or a blocked output ends a parallel answer still held: the client saw none of it."""
        if self.parallel and not self.screened and not self.client_done:
            self.withheld += len(self.client_text)
            self.client_text = []

    def finish(self) -> Audit:
        self._flush()
        return self

    # --------------------------------------------------------------- results

    @property
    def hops(self) -> list[tuple[str, float]]:
        """(hop, seconds) from admission to the Completion (audit.hops)."""
        self.marks.first_token = self.first_token_ms / 1000 if self.first_token_ms else None
        return hop_times(self.marks)

    @property
    def completed(self) -> bool:
        return bool(self.completions)

    @property
    def answer(self) -> str:
        """The whole answer the model generated (what an output policy judges), '' when none."""
        if self.completions and self.completions[0].text:
            return self.completions[0].text
        if self.transcript is not None:
            return self.transcript.answer.text
        return "".join(self.client_text)

    @property
    def text(self) -> str:
        """What the client saw (from the transcript's answer when the tokens have expired)."""
        if self.client_text or self.completions or self.transcript is None:
            return "".join(self.client_text)
        return self.transcript.answer.text

    @property
    def finish_reason(self) -> str:
        if self.output_blocked or self.refused:
            return "content_filter"
        if self.completions:
            return self.completions[0].finish_reason
        return self.transcript.answer.finish_reason if self.transcript else ""

    def problems(self, open_ok: bool = False) -> list[str]:
        """What the gap check found; [] when every rule holds. `open_ok`: no completion is no problem.
        An erased request has nothing left to check (its records' digests still verify: `audit verify`)."""
        found = []
        if self.erased:
            return found
        if self.seqs:
            top = max(self.seqs)
            holes = sorted(set(range(top + 1)) - self.seqs)
            if holes:
                found.append(f"token seq gap: missing {_ranges(holes)}")
        if len(self.completions) > 1:
            found.append(f"{len(self.completions)} completions")
        elif not (self.completions or self.transcript or open_ok or self.refused or self.tools_only):
            found.append("no completion")
        for done in self.completions[:1]:
            want = max(self.seqs) + 1 if self.seqs else done.seq
            if done.seq != want:
                found.append(f"completion seq {done.seq}, expected {want}")
        if self.input_blocked and self.reached_worker and not self.parallel:
            found.append("blocked input reached a worker")
        if self.input_blocked and self.parallel and self.reached_worker and not self.cancelled_after_block:
            found.append("blocked input (screened in parallel) not followed by a cancel")
        if self.output_blocked and not self.cancelled_after_block:
            found.append("blocked output not followed by a cancel")
        unanswered = sorted(set(self.tool_calls) - self.tool_results)
        if unanswered:
            found.append("tool calls without a result: " + ", ".join(unanswered))
        return found


def describe(event: Event) -> str:
    """The detail column of a timeline row."""
    if isinstance(event, ChatRequest):
        newest = next((m.content for m in reversed(event.messages) if m.role == "user"), "")
        return f"model {event.model}, {len(event.messages)} message(s), user: {_short(newest)!r}"
    if isinstance(event, InferenceRequest):
        return f"model {event.model}, {len(event.messages)} message(s)" + (
            f", {event.dropped_messages} dropped" if event.dropped_messages else ""
        )
    if isinstance(event, SafetyVerdict):
        state = "BLOCKED" if event.blocked else "allowed"
        where = f" up to seq {event.window_end_seq}" if event.stage == "output" else ""
        cats = f" ({', '.join(event.categories)})" if event.categories else ""
        return f"{event.stage}{where}: {state}{cats}, policy {event.policy_version or '-'}"
    if isinstance(event, Completion):
        return (
            f"seq {event.seq}, {event.finish_reason}, {event.usage.completion_tokens} tokens"
            + (f", {event.error}" if event.error else "")
            + (f", {event.worker_id}" if event.worker_id else "")
        )
    if isinstance(event, Cancel):
        return event.reason
    if isinstance(event, ToolCall):
        return f"{event.call_id} {event.name}({_short(event.arguments)})"
    if isinstance(event, ToolResult):
        outcome = "ok" if event.ok else "failed"
        return f"{event.call_id} {event.name}: {outcome} {_short(event.output or event.error or '')}"
    if isinstance(event, DeadLetter):
        return (
            f"{event.error_type} from {event.source_topic}[{event.source_partition}]@{event.source_offset}: "
            f"{_short(event.reason)}"
        )
    if isinstance(event, Transcript):
        return f"final record: {event.answer.finish_reason}, {len(event.answer.text)} chars"
    if isinstance(event, TurnDeadline):
        return "parked past its deadline for the previous answer"
    return ""


def _short(text: str, most: int = TEXT_SHOWN) -> str:
    text = " ".join(text.split())
    return text if len(text) <= most else text[: most - 1] + "…"


def _ranges(values: list[int]) -> str:
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ", ".join(out)
