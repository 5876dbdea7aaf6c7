"""Token events -> OpenAI chat completion chunks with resumable SSE ids."""

from __future__ import annotations

import json
import time

from gateway import openai_api as api
from gateway.resume import event_id
from gateway.sse import frame
from schemas import Completion, Event, SafetyVerdict, TokenChunk, ToolCallDelta


def content_filtered(verdict: SafetyVerdict, seq: int) -> Completion:
    """A blocking output verdict ends the answer like a completion with finish_reason content_filter.

    `seq` is one past the highest chunk seq before the verdict in the log, so the finish frame
    gets the same SSE id live and on a resume.
    """
    return Completion(
        request_id=verdict.request_id,
        conversation_id=verdict.conversation_id,
        tenant=verdict.tenant,
        seq=seq,
        finish_reason="content_filter",
        error="output flagged: " + ", ".join(verdict.categories),
    )


_HOLE = json.dumps("\x00")  # where a content-only chunk's text goes in its JSON


class Framer:
    """Turns a request's token events into OpenAI chunk frames with resumable SSE ids."""

    def __init__(
        self, request_id: str, model: str, created: int, include_usage: bool, last_seen: int
    ) -> None:
        self.rid = request_id
        self.cid = api.completion_id(request_id)
        self.model, self.created, self.include_usage = model, created, include_usage
        self.last = last_seen  # highest position the client has
        self.next_seq = max(0, last_seen + 1) if last_seen >= 0 else 0
        self.done = False
        self.first_token_at: float | None = None
        self.max_chunk_seq = -1  # highest chunk seq met in log order, delivered or not
        self.completion: Completion | None = None  # the event that ended the answer, once seen
        self.sent: list[str] = []  # the text of each content frame sent
        self._around: list[str] | None = None  # a content-only chunk's JSON before and after its text

    def _data(self, body: dict) -> str:
        return json.dumps(body, separators=(",", ":"))

    def start(self) -> list[bytes]:
        if self.last >= -1:
            return []
        self.last = -1
        return [
            frame(
                self._data(
                    api.chunk(
                        self.cid,
                        self.created,
                        self.model,
                        role="assistant",
                        content="",
                        include_usage=self.include_usage,
                    )
                ),
                id=event_id(self.rid, -1),
            )
        ]

    def frames(self, events: list[Event]) -> list[bytes]:
        """Frames for new events: the chunks of a batch are coalesced into one frame whose SSE id is
        the last chunk's seq (a resume never splits a chunk). Its delta has the text as `content`
        and the call deltas as `tool_calls`: a call's first entry (index, id, type, name,
        arguments "") stands alone, later argument fragments of one call are joined."""
        out: list[bytes] = []
        text: list[str] = []
        calls: list[dict] = []
        logprobs: list = []  # the chunks' schemas.TokenLogprob entries, when the request asked for them
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
                text.append(ev.text)
                logprobs += ev.logprobs
                for call in ev.tool_calls:
                    _add_call(calls, call)
                upto = ev.seq
            elif isinstance(ev, Completion):
                if upto is not None:  # text before the completion: framed first
                    out.append(self._delta_frame("".join(text), calls, upto, logprobs))
                    text, calls, logprobs, upto = [], [], [], None
                out += self._completion_frames(ev)
                self.done = True
        if upto is not None:
            out.append(self._delta_frame("".join(text), calls, upto, logprobs))
        return out

    def _delta_frame(self, text: str, calls: list[dict], seq: int, logprobs: list) -> bytes:
        self.last = seq
        self.sent.append(text)
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        if not calls and not logprobs:  # the common frame: its JSON around the text made once
            if self._around is None:
                self._around = self._data(self._chunk(content="\x00")).split(_HOLE)
            head, tail = self._around
            return f"id: {self.rid}:{seq}\r\ndata: {head}{json.dumps(text)}{tail}\r\n\r\n".encode()
        body = self._chunk(content=text if text or not calls else None, tool_calls=calls, logprobs=logprobs)
        return frame(self._data(body), id=event_id(self.rid, seq))

    def _chunk(self, **delta) -> dict:
        return api.chunk(self.cid, self.created, self.model, include_usage=self.include_usage, **delta)

    def _completion_frames(self, c: Completion) -> list[bytes]:
        self.completion = c
        frames: list[tuple[int, str]] = []
        if c.finish_reason == "error":
            refused = api.refusal(c)
            err = api.error_body(refused.message, refused.type, refused.param, refused.code)
            frames.append((c.seq, self._data(err)))
        else:
            frames.append(
                (
                    c.seq,
                    self._data(
                        api.chunk(
                            self.cid,
                            self.created,
                            self.model,
                            finish_reason=api.finish_reason_for_client(c.finish_reason),
                            include_usage=self.include_usage,
                        )
                    ),
                )
            )
            if self.include_usage:
                frames.append(
                    (
                        c.seq + 1,
                        self._data(
                            api.usage_chunk(
                                self.cid,
                                self.created,
                                self.model,
                                c.usage.prompt_tokens,
                                c.usage.completion_tokens,
                                c.usage.cached_tokens,
                            )
                        ),
                    )
                )
        frames.append((c.seq + 2, "[DONE]"))
        out = [frame(data, id=event_id(self.rid, pos)) for pos, data in frames if pos > self.last]
        self.last = max(self.last, c.seq + 2)
        return out


def call_delta(d: ToolCallDelta) -> dict:
    """A ToolCallDelta in OpenAI's stream shape: the first of a call names it, later ones add arguments."""
    if d.id:
        return {
            "index": d.index,
            "id": d.id,
            "type": "function",
            "function": {"name": d.name, "arguments": d.arguments},
        }
    return {"index": d.index, "function": {"arguments": d.arguments}}


def _add_call(calls: list[dict], d: ToolCallDelta) -> None:
    last = calls[-1] if calls else None
    if not d.id and last is not None and "id" not in last and last["index"] == d.index:
        last["function"]["arguments"] += d.arguments
    else:
        calls.append(call_delta(d))
