"""The vLLM backend: vLLM's engine (`LLMEngine`, the engine core in this process) behind the seam of
`gpu_workers/backend.py`, stepped on the worker's torch thread like the own engine.

Runs in vLLM's own virtualenv (`gpu_workers/vllm_env.py`; `tokenstream worker --backend vllm`
re-executes itself there). Per request:

- prompt: the prompt ids, plus the tokens already emitted on a takeover (re-prefilled; what vLLM's
  prefix cache holds is not computed again), `cache_salt` = the tenant (prefix blocks are shared
  within one tenant only), `priority` = minus the tier (vLLM serves lower values first; the engine is
  built with `scheduling_policy="priority"`);
- sampling: temperature, top_p, seed, max_tokens, presence/frequency penalties, logit_bias and
  logprobs (vLLM's raw log probabilities, the own engine's measure too); vLLM returns token ids only
  (`detokenize=False`, no stop strings): detokenisation, stop strings and chunking are the own engine's
  (`gpu_workers/streaming.py`), so both backends stream the same text in the same chunks; the tokens of
  one vLLM output are one chunk at most, under the request's stream interval (never one per token);
- constraints (tools, response_format): the request's llguidance grammar (the very text the own engine
  uses, `grammar.grammar_text`) as `StructuredOutputsParams(grammar=...)` on vLLM's guidance backend;
  the worker's own grammar state follows each token too (stop-string scope, tool-call parsing, errors).
  A constrained request taken over with tokens already emitted runs without vLLM's constraint (vLLM
  cannot start a grammar mid-answer); its own grammar state still checks every token and a departure
  ends it as an error;
- usage: `cached_tokens` from `RequestOutput.num_cached_tokens` (at most the prompt's length).

Limits against the own engine: a seeded sample (temperature > 0) follows vLLM's generator, so it
differs from the own engine's and does not continue the same draw after a takeover (greedy does);
vLLM counts penalised tokens among those it generated itself, so after a takeover the tokens
the previous worker emitted are not penalised (the own engine counts them); the queue/prefill split
of the timings is taken at the hand-over to vLLM (vLLM's own queue time counts as prefill).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from gpu_workers.backend import Intake
from gpu_workers.detokenizer import Detokenizer
from gpu_workers.sequence import Output, Sequence
from gpu_workers.streaming import TextStream

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process

log = logging.getLogger(__name__)

_REASONS = {"stop": "stop", "length": "length"}


class VllmEngine(Intake, TextStream):
    """The seam (add, cancel, abort, step, has_work, queued, running, tokenizer, eos_ids) over vLLM."""

    def __init__(
        self,
        folder: Path,
        *,
        dtype: str = "auto",
        max_running: int | None = None,
        prefill_chunk: int | None = None,
        max_model_len: int = 2048,
        metrics=None,
        prefix_cache: bool = True,
        seed: int = 0,
        block_size: int | None = None,
        enforce_eager: bool = False,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
    ) -> None:
        from transformers import AutoTokenizer, GenerationConfig
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        try:
            eos = GenerationConfig.from_pretrained(folder).eos_token_id
        except OSError:
            eos = None
        eos = eos if isinstance(eos, list) else [eos]
        self.eos_ids = {e for e in [*eos, self.tokenizer.eos_token_id] if e is not None}
        self.max_model_len = max_model_len
        self.metrics = metrics
        # vLLM's own batch limits unless the operator set ours: then the own engine's per-step work,
        # one token of every running row plus a prefill chunk
        limits = {}
        if max_running is not None:
            limits["max_num_seqs"] = max_running
        if prefill_chunk is not None:
            limits["max_num_batched_tokens"] = prefill_chunk + (max_running or 0)
        args = EngineArgs(
            model=str(folder),
            tokenizer=str(folder),
            dtype=dtype,
            max_model_len=max_model_len,
            enable_prefix_caching=prefix_cache,
            scheduling_policy="priority",
            seed=seed,
            disable_log_stats=True,
            structured_outputs_config={"backend": "guidance"},
            block_size=block_size,
            enforce_eager=enforce_eager,
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            **limits,
        )
        self.llm = LLMEngine.from_engine_args(args)
        self.dtype = str(self.llm.vllm_config.model_config.dtype).removeprefix("torch.")
        scheduler = self.llm.vllm_config.scheduler_config
        self.max_running, self.prefill_chunk = scheduler.max_num_seqs, scheduler.max_num_batched_tokens
        cache = self.llm.vllm_config.cache_config
        self.cache_block = cache.block_size if cache.enable_prefix_caching else 0
        self._init_intake()
        self.live: dict[str, Sequence] = {}  # vLLM request id -> request, while in vLLM
        self._vid: dict[Sequence, str] = {}
        self._n = 0
        self.steps = 0
        self._generated = 0  # tokens taken in this step

    # ---- called from any thread (add, cancel, abort: backend.Intake) ----
    @property
    def has_work(self) -> bool:
        return bool(self._inbox or self._cancels or self._aborts or self.live)

    @property
    def running(self) -> list[Sequence]:
        return [s for s in self.live.values() if s.first_token_at is not None]

    @property
    def queued(self) -> int:
        return len(self._inbox) + sum(1 for s in self.live.values() if s.first_token_at is None)

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def kv_usage(self) -> float:
        try:
            return float(self.llm.engine_core.engine_core.scheduler.kv_cache_manager.usage)
        except AttributeError:
            return 0.0

    # ---- the step loop (the torch thread) ----
    def step(self) -> list[Output]:
        outputs: list[Output] = []
        self._take_inbox(outputs)
        self._take_cancels(outputs)
        if self.live:
            for ro in self.llm.step():
                self._take(ro, outputs)
        self.steps += 1
        if self.metrics is not None:
            self.metrics.generated(self._generated)  # counted once per step
            self.metrics.engine_state(len(self.running), self.queued, self.kv_usage())
        self._generated = 0
        return outputs

    def _accept(self, seq: Sequence, outputs: list[Output]) -> None:
        """Hand a request that passed `refusal` to vLLM."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        constraint = None
        if seq.grammar is not None and not seq.generated and seq.grammar.text:
            constraint = StructuredOutputsParams(grammar=seq.grammar.text)
        greedy = seq.temperature <= 0
        params = SamplingParams(
            n=1,
            temperature=0.0 if greedy else seq.temperature,
            top_p=1.0 if greedy else seq.top_p,
            seed=None if greedy else seq.seed,
            max_tokens=seq.max_tokens - len(seq.generated),
            detokenize=False,
            skip_special_tokens=False,
            output_kind=RequestOutputKind.DELTA,
            structured_outputs=constraint,
            presence_penalty=seq.presence_penalty,
            frequency_penalty=seq.frequency_penalty,
            logit_bias=seq.logit_bias or None,
            logprobs=seq.logprobs,
        )
        prompt = {"prompt_token_ids": seq.all_ids}
        if seq.tenant:
            prompt["cache_salt"] = seq.tenant
        self._n += 1
        vid = f"{seq.request_id}#{self._n}"
        seq.detok = Detokenizer(self.tokenizer, seq.generated)
        seq.text = seq.detok.text
        try:
            self.llm.add_request(vid, prompt, params, priority=-seq.priority)
        except Exception as exc:  # noqa: BLE001 - vLLM refused this request (e.g. its grammar): it alone ends
            self._finish(seq, "error", outputs, error=f"vllm: {exc}"[:400])
            return
        seq.scheduled_at = time.time()
        self.live[vid] = seq
        self._vid[seq] = vid
        if self.metrics is not None:
            self.metrics.scheduled(seq)

    def _take_cancels(self, outputs: list[Output]) -> None:
        while self._aborts:
            self._finish(self._aborts.popleft(), None, outputs)
        for rid in self._taken_cancels():
            for seq in [s for s in self.live.values() if s.request_id == rid]:
                self._finish(seq, "cancelled", outputs)

    def _take(self, ro, outputs: list[Output]) -> None:
        seq = self.live.get(ro.request_id)
        if seq is None:
            return  # ended here meanwhile (cancelled, aborted, a stop string)
        if seq.first_token_at is None and ro.num_cached_tokens is not None:
            seq.cached_tokens = min(ro.num_cached_tokens, len(seq.prompt_ids))
            if self.cache_block:  # automatic prefix caching keeps every full page of the prompt it computed
                full = len(seq.prompt_ids) // self.cache_block * self.cache_block
                seq.cache_written = max(0, full - seq.cached_tokens)
        done = ro.outputs[0]
        tokens = list(done.token_ids)
        if ro.finished and done.finish_reason == "stop" and tokens:
            seq.vllm_ended = True
            tokens[-1:] = [next(iter(self.eos_ids))] if self.eos_ids else []  # its stop token, as EOS
        elif ro.finished:
            seq.vllm_ended = True
        reports = None
        if seq.logprobs is not None:
            reports = [
                _reported(done.logprobs, i, seq.logprobs, done.token_ids[i]) for i in range(len(tokens))
            ]
        # the output's tokens are one chunk at most, under the stream interval (gpu_workers/streaming.py)
        self._generated += self._append_step(seq, tokens, time.time(), outputs, reports)
        if ro.finished and self._vid.get(seq) is not None:  # vLLM ended it for a reason of its own
            self._emit(seq, self._final_text(seq), outputs)
            reason = _REASONS.get(done.finish_reason or "", "error")
            self._finish(
                seq,
                reason,
                outputs,
                error=None
                if reason != "error"
                else f"vllm ended the request: {done.finish_reason} {done.stop_reason or ''}".strip(),
            )

    def _finish(
        self, seq: Sequence, reason: str | None, outputs: list[Output], error: str | None = None
    ) -> None:
        seq.finished_at = time.time()
        seq.finish_reason = reason
        vid = self._vid.pop(seq, None)
        if vid is not None:
            self.live.pop(vid, None)
            if not getattr(seq, "vllm_ended", False):
                self.llm.abort_request([vid])  # frees its KV blocks and its batch slot now
        if reason is None:
            return
        self._completion(seq, reason, outputs, error)

    def close(self) -> None:
        for vid in list(self.live):
            self.llm.abort_request([vid])
        self.live.clear()


def _reported(logprobs, i: int, k: int | None, token: int):
    """vLLM's log probabilities of the i-th new token (`token`, as vLLM sampled it) as
    gpu_workers.logits.Reported; None when the request asked for none."""
    if k is None or not logprobs or i >= len(logprobs) or logprobs[i] is None:
        return None
    at = logprobs[i]  # token id -> Logprob(logprob, rank, decoded_token): the sampled token and the top k
    ranked = sorted(at.items(), key=lambda item: item[1].rank if item[1].rank is not None else 1 << 30)
    top = [(t, float(lp.logprob)) for t, lp in ranked[:k]]
    return token, float(at[token].logprob), top  # vLLM always includes the sampled token
