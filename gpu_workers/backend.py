"""The seam between the Kafka side (`service.Worker`) and an engine: what a backend provides.

Two backends: `transformers` (the own engine, `gpu_workers/engine.py`, over a transformers model)
and `vllm` (vLLM's engine in this process, `gpu_workers/backend_vllm.py`, in vLLM's virtualenv).
`tokenstream worker --backend vllm|transformers` (or `TOKENSTREAM_WORKER_BACKEND`) selects one.

A request goes in as a `Sequence` (prompt ids, max_tokens, temperature, top_p, seed, stop strings,
grammar state with its grammar text, priority tier, tenant = prefix-cache salt; on a takeover the
tokens, text and chunk number already emitted); what comes out of each `step()` is a list of
`Output`s: text chunks with their token ids and gap-free chunk numbers, then one end with the
finish reason (the request's `cached_tokens` set by then). Everything here is called from the
event loop except `step()`, which runs on the torch thread (`torch_thread.py`).
"""

from __future__ import annotations

import collections
import threading
from typing import Protocol

from gpu_workers.sequence import Output, Sequence

BACKENDS = ("transformers", "vllm")


class Backend(Protocol):
    tokenizer: object  # a transformers tokenizer: prompts are rendered with its chat template
    eos_ids: set[int]
    max_model_len: int

    def add(self, seq: Sequence) -> None:
        """Queue a request (thread-safe); its seed and grammar are set already."""

    def cancel(self, request_id: str) -> None:
        """End the request as `cancelled` at the next step, freeing its slot; remembered if it comes later."""

    def abort(self, seq: Sequence) -> None:
        """Drop the request without any output (its partition moved to another worker)."""

    def step(self) -> list[Output]:
        """Take in what was queued, run one step, return its chunks and ends (torch thread)."""

    def kv_usage(self) -> float:
        """The share of the KV budget in use (health and metrics)."""

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (benchmarks: no measured request finds pages of the warm-up)."""

    @property
    def has_work(self) -> bool: ...

    @property
    def queued(self) -> int:
        """Requests taken but not yet running (the service pauses fetching while this is at max_waiting)."""

    @property
    def running(self) -> list[Sequence]:
        """Requests in the running batch (health and metrics)."""


def refusal(seq: Sequence, max_model_len: int, cancelled) -> tuple[str, str | None] | None:
    """Why a request taken in must end before it is scheduled, as (finish reason, error), or None:
    cancelled before it started, a prompt that does not fit the context, or a takeover that had already
    written all its tokens. Otherwise caps its max_tokens at what the context leaves and returns None."""
    if seq.request_id in cancelled:
        return "cancelled", None
    if len(seq.prompt_ids) + 1 > max_model_len or not seq.prompt_ids:
        return "error", f"prompt of {len(seq.prompt_ids)} tokens does not fit {max_model_len}"
    if seq.generated and len(seq.generated) >= seq.max_tokens:
        return "length", None
    seq.max_tokens = min(seq.max_tokens, max_model_len - len(seq.prompt_ids))
    return None


class Intake:
    """The way into an engine, shared by both backends: requests, cancels and aborts queued from any
    thread (`add`, `cancel`, `abort`, each waking the step loop), taken by the step on the torch
    thread. A cancel is remembered (the latest 10,000) so that a request arriving after it still
    ends as cancelled. A class using it calls `_init_intake()` and provides `_accept(seq, outputs)`
    (schedule a request that passed `refusal`), `_finish` and `max_model_len`."""

    RECENT_CANCELS = 10_000

    def _init_intake(self) -> None:
        self._inbox: collections.deque[Sequence] = collections.deque()
        self._cancels: collections.deque[str] = collections.deque()
        self._aborts: collections.deque[Sequence] = collections.deque()
        self._recent_cancels: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.wakeup = threading.Event()

    def add(self, seq: Sequence) -> None:
        self._inbox.append(seq)
        self.wakeup.set()

    def cancel(self, request_id: str) -> None:
        self._cancels.append(request_id)
        self.wakeup.set()

    def abort(self, seq: Sequence) -> None:
        """Drop this request without any output (its partition moved to another worker)."""
        self._aborts.append(seq)
        self.wakeup.set()

    def _take_inbox(self, outputs: list[Output]) -> None:
        while self._inbox:
            seq = self._inbox.popleft()
            refused = refusal(seq, self.max_model_len, self._recent_cancels)
            if refused:
                self._finish(seq, refused[0], outputs, error=refused[1])
            else:
                self._accept(seq, outputs)

    def _taken_cancels(self) -> list[str]:
        """The request ids cancelled since the last step, remembered for requests still to come."""
        taken = []
        while self._cancels:
            rid = self._cancels.popleft()
            self._recent_cancels[rid] = None
            taken.append(rid)
        while len(self._recent_cancels) > self.RECENT_CANCELS:
            self._recent_cancels.popitem(last=False)
        return taken
