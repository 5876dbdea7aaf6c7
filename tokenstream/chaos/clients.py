"""Streaming chat clients that behave like a patient user of the SDK: when a connection drops
mid-answer, or the stream ends with an error event (the gateway's progress deadline, a slow reader
dropped), they resume with Last-Event-ID on any gateway until [DONE] or a deadline."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class Outcome:
    """What one client received for one admitted request."""

    rid: str
    sent: float
    frames: list[tuple[int, str]] = field(default_factory=list)  # (SSE position, content)
    arrivals: list[float] = field(default_factory=list)  # when each frame reached the client (wall clock)
    done: bool = False
    finished_at: float | None = None
    resumes: int = 0
    errors: list[str] = field(default_factory=list)
    error_texts: list[str] = field(default_factory=list)  # the text held at each error event or drop

    @property
    def text(self) -> str:
        return "".join(content for _, content in self.frames)

    def wait_from(self, instant: float) -> float | None:
        """How long this request waited, from `instant` (or from being sent, if later), for its next
        frame or its end: a stream's stall across a fault, a new request's wait for its first token.
        None when it had ended by then; inf when nothing more came."""
        if self.finished_at is not None and self.finished_at <= instant:
            return None
        start = max(instant, self.sent)
        after = [t for t in self.arrivals if t > start] + ([self.finished_at] if self.finished_at else [])
        return min(after) - start if after else float("inf")

    @property
    def last_id(self) -> str | None:
        return f"{self.rid}:{self.frames[-1][0]}" if self.frames else None


async def sse_events(response: httpx.Response):
    """(id, data) of each server-sent event; comments (keep-alives) are skipped."""
    event_id, data = None, []
    async for line in response.aiter_lines():
        if line == "":
            if data:
                yield event_id, "\n".join(data)
            event_id, data = None, []
        elif not line.startswith(":"):
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "id":
                event_id = value
            elif name == "data":
                data.append(value)


def content_of(data: str) -> str:
    body = json.loads(data)
    return "".join((c.get("delta", {}).get("content") or "") for c in body.get("choices", []))


class Client:
    """One user: sends streaming requests one after another to a random gateway."""

    def __init__(self, gateways: list[str], model: str, *, max_tokens: int, deadline_s: float) -> None:
        """`gateways` are base URLs; the caller's httpx client carries the API key."""
        self.gateways, self.model, self.max_tokens, self.deadline_s = gateways, model, max_tokens, deadline_s
        self.refused = 0  # not admitted (429/503, or no gateway answered): nothing to account for
        self.unacknowledged = 0  # the connection dropped before the request id arrived
        self.stall_next_s = 0.0

    async def request(self, http: httpx.AsyncClient, prompt: str) -> Outcome | None:
        body = {
            "model": self.model,
            "stream": True,
            "temperature": 0,
            "max_tokens": self.max_tokens,
            "messages": [{"role": "user", "content": prompt}],
        }
        stall, self.stall_next_s = self.stall_next_s, 0.0
        sent = time.time()
        outcome: Outcome | None = None
        try:
            async with http.stream(
                "POST", random.choice(self.gateways) + "/v1/chat/completions", json=body
            ) as r:
                if r.status_code != 200:
                    await r.aread()
                    self.refused += 1
                    return None
                async for event_id, data in sse_events(r):
                    if outcome is None and event_id:
                        outcome = Outcome(event_id.rpartition(":")[0], sent)
                    if outcome is not None and self._take(outcome, event_id, data) and stall:
                        await asyncio.sleep(stall)  # a reader that stops reading for a while
                        stall = 0.0
        except httpx.HTTPError as exc:
            if outcome is None:
                self.unacknowledged += 1
                return None
            outcome.errors.append(f"connection lost: {type(exc).__name__}")
            outcome.error_texts.append(outcome.text)
        if outcome is None:
            self.refused += 1
            return None
        await self._resume(http, outcome)
        return outcome

    def _take(self, outcome: Outcome, event_id: str | None, data: str) -> bool:
        """Record one event; True when it carried content."""
        if data == "[DONE]":
            outcome.done, outcome.finished_at = True, time.time()
            return False
        if event_id is None:  # an error event (no id: it is not part of the answer); the client resumes
            outcome.errors.append(data[:200])
            outcome.error_texts.append(outcome.text)
            return False
        position = int(event_id.rpartition(":")[2])
        if outcome.frames and position <= outcome.frames[-1][0]:
            outcome.errors.append(f"position {position} delivered again")
        content = content_of(data)
        if content and position >= 0:
            outcome.frames.append((position, content))
            outcome.arrivals.append(time.time())
            return True
        return False

    async def _resume(self, http: httpx.AsyncClient, outcome: Outcome) -> None:
        """Resume from the last frame seen, on any gateway, until [DONE] or the deadline."""
        deadline = outcome.sent + self.deadline_s
        while not outcome.done and time.time() < deadline:
            gateway = random.choice(self.gateways)
            headers = {"Last-Event-ID": outcome.last_id} if outcome.last_id else {}
            outcome.resumes += 1
            try:
                async with http.stream(
                    "GET", f"{gateway}/v1/chat/completions/chatcmpl-{outcome.rid}/stream", headers=headers
                ) as r:
                    if r.status_code != 200:
                        await r.aread()
                        await asyncio.sleep(0.5)
                        continue
                    async for event_id, data in sse_events(r):
                        self._take(outcome, event_id, data)
            except httpx.HTTPError:
                await asyncio.sleep(0.5)
