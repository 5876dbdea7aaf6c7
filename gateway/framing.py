"""Token events -> OpenAI chat completion chunks with resumable SSE ids."""

from __future__ import annotations

import json
import time

from sse_starlette import ServerSentEvent

from gateway import openai_api as api
from gateway.resume import event_id
from schemas import Completion, Event, SafetyVerdict, TokenChunk, ToolCallDelta


def content_filtered(verdict: SafetyVerdict, seq: int) -> Completion:
    """A blocking output verdict ends the answer like a completion with finish_reason content_filter.

    `seq` is one past the highest chunk seq before the verdict in the log, so the finish frame
    gets the same SSE id live and on a resume.
    """
    return Completion(request_id=verdict.request_id, conversation_id=verdict.conversation_id,
                      tenant=verdict.tenant, seq=seq, finish_reason="content_filter",
                      error="output flagged: " + ", ".join(verdict.categories))


class Framer:
    """Turns a request's token events into OpenAI chunk frames with resumable SSE ids."""

    def __init__(self, request_id: str, model: str, created: int, include_usage: bool, last_seen: int) -> None:
        self.rid = request_id
        self.cid = api.completion_id(request_id)
        self.model, self.created, self.include_usage = model, created, include_usage
        self.last = last_seen  # highest position the client has
        self.next_seq = max(0, last_seen + 1) if last_seen >= 0 else 0
        self.done = False
        self.first_token_at: float | None = None
        self.max_chunk_seq = -1  # highest chunk seq met in log order, delivered or not

    def _data(self, body: dict) -> str:
        return json.dumps(body, separators=(",", ":"))

    def start(self) -> list[ServerSentEvent]:
        if self.last >= -1:
            return []
        self.last = -1
        return [ServerSentEvent(self._data(api.chunk(self.cid, self.created, self.model, role="assistant",
                                                     content="", include_usage=self.include_usage)),
                                id=event_id(self.rid, -1))]

    def frames(self, events: list[Event]) -> list[ServerSentEvent]:
        """Frames for new events: consecutive text is coalesced into one frame, and so are argument
        fragments of one call; a call's first delta (id, name, arguments "") is a frame of its own.
        When one chunk's events make several frames only the last carries the SSE id, so a resume
        from any id never skips part of a chunk."""
        out: list[ServerSentEvent] = []
        pending: list[dict] = []  # deltas not yet framed
        upto = None
        for ev in events:
            if self.done:
                break
            if isinstance(ev, SafetyVerdict):
                if not ev.blocked:
                    continue
                ev = content_filtered(ev, self.max_chunk_seq + 1)
            if isinstance(ev, TokenChunk):
                self.max_chunk_seq = max(self.max_chunk_seq, ev.seq)
                if ev.seq < self.next_seq:
                    continue  # duplicate
                self.next_seq = ev.seq + 1
                if ev.seq <= self.last:
                    continue
                if ev.text:
                    _add_text(pending, ev.text)
                for call in ev.tool_calls:
                    _add_call(pending, call)
                upto = ev.seq
            elif isinstance(ev, Completion):
                if upto is not None:  # text before the completion: framed first
                    out += self._delta_frames(pending, upto)
                    pending, upto = [], None
                out += self._completion_frames(ev)
                self.done = True
        if upto is not None:
            out += self._delta_frames(pending, upto)
        return out

    def _delta_frames(self, deltas: list[dict], seq: int) -> list[ServerSentEvent]:
        self.last = seq
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        if not deltas:  # a chunk with nothing to show (e.g. the closing tag of a call): keep its position
            deltas = [{"content": ""}]
        return [ServerSentEvent(self._data(api.chunk(self.cid, self.created, self.model,
                                                     include_usage=self.include_usage, **delta)),
                                id=event_id(self.rid, seq) if i == len(deltas) - 1 else None)
                for i, delta in enumerate(deltas)]

    def _completion_frames(self, c: Completion) -> list[ServerSentEvent]:
        frames: list[tuple[int, str]] = []
        if c.finish_reason == "error":
            err = api.error_body(c.error or "generation failed", "server_error", None, "generation_error")
            frames.append((c.seq, self._data(err)))
        else:
            frames.append((c.seq, self._data(api.chunk(
                self.cid, self.created, self.model, finish_reason=api.finish_reason_for_client(c.finish_reason),
                include_usage=self.include_usage))))
            if self.include_usage:
                frames.append((c.seq + 1, self._data(api.usage_chunk(
                    self.cid, self.created, self.model, c.usage.prompt_tokens, c.usage.completion_tokens))))
        frames.append((c.seq + 2, "[DONE]"))
        out = [ServerSentEvent(data, id=event_id(self.rid, pos)) for pos, data in frames if pos > self.last]
        self.last = max(self.last, c.seq + 2)
        return out


def call_delta(d: ToolCallDelta) -> dict:
    """A ToolCallDelta in OpenAI's stream shape: the first of a call names it, later ones add arguments."""
    if d.id:
        return {"index": d.index, "id": d.id, "type": "function",
                "function": {"name": d.name, "arguments": d.arguments}}
    return {"index": d.index, "function": {"arguments": d.arguments}}


def _add_text(pending: list[dict], text: str) -> None:
    if pending and "content" in pending[-1]:
        pending[-1]["content"] += text
    else:
        pending.append({"content": text})


def _add_call(pending: list[dict], d: ToolCallDelta) -> None:
    last = pending[-1]["tool_calls"][0] if pending and "tool_calls" in pending[-1] else None
    if not d.id and last is not None and "id" not in last and last["index"] == d.index:
        last["function"]["arguments"] += d.arguments
    else:
        pending.append({"tool_calls": [call_delta(d)]})
