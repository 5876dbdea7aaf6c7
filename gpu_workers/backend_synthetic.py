"""The benchmark's stand-in for a GPU: a backend that emits tokens at a set step time and batch size and
does nothing else. It is never served.

`tokenstream bench tokens` runs the real worker process with it behind the engine seam
(gpu_workers/backend.py), to find what the token path around an engine (the worker's own per-token
work and publishing, the log, the processors, the gateway, the clients) carries at GPU rates. Each
step lasts the step time (TOKENSTREAM_BENCH_SYNTHETIC_STEP_MS, default 20 ms, on schedule after the
step before when the worker asks for it in time, as a GPU's forward would) and samples one token for every
running request (at most `max_running`: the batch size): the next word of a fixed small vocabulary,
until the request's max_tokens. Requests beyond the batch wait for a slot. The tokens then take the
path every backend's take (gpu_workers/streaming.py: detokenisation, stop strings, max_tokens, the
stream interval, the engine's metrics), so the worker writes the chunks a real engine's tokens
would make. There is no model, no prefill, no sampling, no log probabilities and no grammar (a
constrained request ends at once with an error).

The worker refuses `--backend synthetic` unless TOKENSTREAM_BENCH_SYNTHETIC_BACKEND=1 is set (the
benchmark sets it for its own throwaway system): a deployment that named it by mistake would answer
every request with these words.
"""

from __future__ import annotations

import collections
import os
import time

from gpu_workers.backend import Intake
from gpu_workers.detokenizer import Detokenizer
from gpu_workers.sequence import Output, Sequence
from gpu_workers.streaming import TextStream

ENABLE_ENV = "TOKENSTREAM_BENCH_SYNTHETIC_BACKEND"  # "1": this worker is a benchmark's, never a deployment's
STEP_ENV = "TOKENSTREAM_BENCH_SYNTHETIC_STEP_MS"
DEFAULT_STEP_MS = 20.0
# benign words (the output check judges them): one token each, a sentence in a loop
VOCABULARY = (" The", " log", " carries", " every", " token", " in", " order", ".")


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV) == "1"


class SyntheticEngine(Intake, TextStream):
    """The seam (add, cancel, abort, step, has_work, queued, running, tokenizer, eos_ids) with no model."""

    def __init__(self, tokenizer, max_running: int, step_s: float, max_model_len: int, metrics=None) -> None:
        self.tokenizer = tokenizer  # prompts are rendered with its chat template, tokens decoded with it
        self.metrics = metrics
        self.eos_ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        self.max_model_len = max_model_len
        self.max_running = max_running
        self.prefill_chunk = 0
        self.step_s = step_s
        self.words = [tokenizer.encode(w, add_special_tokens=False)[0] for w in VOCABULARY]
        self._init_intake()
        self.live: dict[str, Sequence] = {}  # request id -> request, in the batch
        self.waiting: collections.deque[Sequence] = collections.deque()
        self._deadline = 0.0  # when the last step ended (time.monotonic)
        self.steps = 0

    @property
    def has_work(self) -> bool:
        return bool(self._inbox or self._cancels or self._aborts or self.live or self.waiting)

    @property
    def running(self) -> list[Sequence]:
        return list(self.live.values())

    @property
    def queued(self) -> int:
        return len(self._inbox) + len(self.waiting)

    def kv_usage(self) -> float:
        return len(self.live) / self.max_running

    def reset_prefix_cache(self) -> None:
        """No cache to forget."""

    # ---- the step loop (the torch thread) ----
    def step(self) -> list[Output]:
        outputs: list[Output] = []
        self._take_inbox(outputs)
        while self._aborts:
            self._drop(self._aborts.popleft())
        for rid in self._taken_cancels():
            for seq in [s for s in (*self.live.values(), *self.waiting) if s.request_id == rid]:
                self._finish(seq, "cancelled", outputs)
        while self.waiting and len(self.live) < self.max_running:
            seq = self.waiting.popleft()
            seq.scheduled_at = time.time()
            self.live[seq.request_id] = seq
        if not self.live:
            return outputs
        now = time.monotonic()
        # a step called within one step time of the previous one's end follows it on schedule (a late
        # wake-up of this thread is made up, as a GPU's queue of launched work would); a later call
        # means the worker kept its GPU waiting, and the step starts now
        start = self._deadline if now - self._deadline < self.step_s else now
        self._deadline = start + self.step_s
        time.sleep(max(0.0, self._deadline - now))
        at = time.time()
        words = self.words
        running = list(self.live.values())
        for seq in running:
            self._append(seq, words[len(seq.generated) % len(words)], at, outputs)
        if self.metrics is not None:
            self.metrics.generated(len(running))  # counted once per step, as the engine does
        self.steps += 1
        return outputs

    def _accept(self, seq: Sequence, outputs: list[Output]) -> None:
        if seq.grammar is not None:
            self._finish(seq, "error", outputs, error="the synthetic backend follows no grammar")
            return
        seq.detok = Detokenizer(self.tokenizer, seq.generated)
        seq.text = seq.detok.text
        self.waiting.append(seq)

    def _drop(self, seq: Sequence) -> None:
        self.live.pop(seq.request_id, None)
        if seq in self.waiting:
            self.waiting.remove(seq)

    def _finish(self, seq: Sequence, reason: str, outputs: list[Output], error: str | None = None) -> None:
        self._drop(seq)
        seq.finished_at = time.time()
        seq.finish_reason = reason
        self._completion(seq, reason, outputs, error)


def synthetic_engine(cfg, metrics=None) -> SyntheticEngine:
    """The backend for a worker config (`backend="synthetic"`); exits unless a benchmark enabled it."""
    if not enabled():
        raise SystemExit(
            f"worker --backend synthetic: the benchmark's stand-in for a GPU, never served "
            f"(`tokenstream bench tokens` sets {ENABLE_ENV}=1 for its own throwaway system)"
        )
    from common.models import load_tokenizer

    step_ms = float(os.environ.get(STEP_ENV) or DEFAULT_STEP_MS)
    if step_ms <= 0:
        raise SystemExit(f"worker --backend synthetic: {STEP_ENV} must be above 0, not {step_ms}")
    return SyntheticEngine(
        load_tokenizer(cfg.model), cfg.max_running, step_ms / 1000, cfg.max_model_len or 1 << 20, metrics
    )
