"""The time a request spent in each hop, from the broker timestamps of its events and the worker's Timings.

    gateway       admission (or the client's send) -> the ChatRequest on ts.chat.requests
    conversation  -> the InferenceRequest on ts.requests.prepared
    safety        -> the request on ts.requests.screened (screened in series; in parallel the
                     check overlaps the next hops and has no hop of its own)
    router        -> the request on ts.inference.<model>
    fetch         -> received by the worker that finished it (admission + Timings.pipeline_s)
    engine        -> its first token generated (+ Timings.queue_s + prefill_s: the worker's own TTFT)
    publish       -> the first TokenChunk on ts.tokens
    decode        -> the Completion on ts.tokens (the rest of the answer)
    delivery      -> received by the client (only where the client's clock is known: bench pipeline)

A record's timestamp is its producer's clock (CreateTime; ts.tokens stamps the broker's append
time) and the Timings are the worker's, so the figures are exact on one host and as good as the
hosts' clock sync across hosts. A hop whose
mark is missing is left out and its time counts towards the next one found. `bench pipeline`
computes its per-hop shares of time to first token with the same function.
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas import Timings

HOPS = ("gateway", "conversation", "safety", "router", "fetch", "engine", "publish", "decode", "delivery")


@dataclass
class Marks:
    """Seconds since the epoch at which a request reached each point (None: not seen)."""

    admitted: float | None = None  # ChatRequest.created_at (the gateway's clock)
    chat: float | None = None
    prepared: float | None = None
    screened: float | None = None
    inference: float | None = None
    first_token: float | None = None
    completion: float | None = None
    timings: Timings | None = None  # from the worker's Completion

    def first(self, name: str, at: float) -> None:
        """Note `name` at `at` unless an earlier time is noted already."""
        now = getattr(self, name)
        if now is None or at < now:
            setattr(self, name, at)


def hop_times(
    marks: Marks, *, sent: float | None = None, delivered: float | None = None, through: str = "completion"
) -> list[tuple[str, float]]:
    """(hop, seconds) in order, from `sent` (the client's send) or the admission, up to `through`
    ("first_token": time to first token; "completion": the whole answer) and then `delivered`."""
    start = sent if sent is not None else marks.admitted if marks.admitted is not None else marks.chat
    if start is None:
        return []
    received = engine = None
    if marks.timings is not None and (
        marks.timings.pipeline_s or marks.timings.queue_s or marks.timings.prefill_s
    ):
        admitted = marks.admitted if marks.admitted is not None else marks.chat
        if admitted is not None:
            received = admitted + marks.timings.pipeline_s
            engine = received + marks.timings.queue_s + marks.timings.prefill_s
    points = [
        ("gateway", marks.chat),
        ("conversation", marks.prepared),
        ("safety", marks.screened),
        ("router", marks.inference),
        ("fetch", received),
        ("engine", engine),
        ("publish", marks.first_token),
    ]
    if through == "completion":
        points.append(("decode", marks.completion))
    points.append(("delivery", delivered))
    out, last = [], start
    for hop, at in points:
        if at is not None:
            out.append((hop, at - last))
            last = at
    return out
