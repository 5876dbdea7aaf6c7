"""The iteration-level batching engine: admit, one forward step, post-process, repeat.

Each `step()`:
  1. takes in new requests, cancellations and aborts (thread-safe queues fed by the service);
  2. admits waiting requests by tier (gpu_workers/priority.py) while their worst-case pages
     (prompt + max_tokens) fit the KV budget and the batch has room: load can never exhaust
     the pool, so nothing is preempted;
  3. prefills at most `prefill_chunk` prompt tokens (chunked prefill: a long prompt is spread
     over several steps, so running streams get a token every step) and decodes one token for
     every running request, each as one batched forward over the paged cache;
  4. samples per request, detokenises, applies stop strings, and frees the pages of every
     request that finished, at once.
"""

from __future__ import annotations

import collections
import threading
import time

import torch

from gpu_workers.grammar import advance, mask_rows
from gpu_workers.kv_cache import PagedKVCache, StepCache
from gpu_workers.priority import enqueue
from gpu_workers.sampling import new_seed, sample
from gpu_workers.sequence import Output, Sequence

__all__ = ["Engine", "Output", "Sequence"]


class Engine:
    def __init__(self, model, tokenizer, cache: PagedKVCache, *, max_running: int = 32,
                 prefill_chunk: int = 256, max_model_len: int = 2048, metrics=None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.cache = cache
        self.max_running = max_running
        self.prefill_chunk = prefill_chunk
        self.max_model_len = min(max_model_len, cache.capacity_tokens)
        self.metrics = metrics
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.input_device = model.get_input_embeddings().weight.device
        eos = model.generation_config.eos_token_id if model.generation_config else None
        eos = eos if isinstance(eos, list) else [eos]
        self.eos_ids = {e for e in [*eos, tokenizer.eos_token_id] if e is not None}
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.reserved_blocks = 0
        self._inbox: collections.deque[Sequence] = collections.deque()
        self._cancels: collections.deque[str] = collections.deque()
        self._aborts: collections.deque[Sequence] = collections.deque()
        self._recent_cancels: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.wakeup = threading.Event()
        self.steps = 0

    # ---- called from any thread ----
    def add(self, seq: Sequence) -> None:
        if seq.seed is None:
            seq.seed = new_seed()
        self._inbox.append(seq)
        self.wakeup.set()

    def cancel(self, request_id: str) -> None:
        self._cancels.append(request_id)
        self.wakeup.set()

    def abort(self, seq: Sequence) -> None:
        """Drop this request without any output (its partition moved to another worker)."""
        self._aborts.append(seq)
        self.wakeup.set()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._inbox or self._cancels or self._aborts)

    @property
    def queued(self) -> int:
        return len(self.waiting) + len(self._inbox)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.cache.block_size)

    # ---- the step loop (one thread) ----
    @torch.inference_mode()
    def step(self) -> list[Output]:
        self.wakeup.clear()
        outputs: list[Output] = []
        self._take_inbox(outputs)
        self._take_cancels(outputs)
        self._admit()
        prefill, decode = self._schedule()
        if prefill:
            self._run(prefill, outputs)
        if decode:
            self._run([(s, 1) for s in decode], outputs)
        self.steps += 1
        if self.metrics is not None:
            self.metrics.engine_state(len(self.running), self.queued, self.cache.usage())
        return outputs

    def _take_inbox(self, outputs: list[Output]) -> None:
        while self._inbox:
            seq = self._inbox.popleft()
            if seq.request_id in self._recent_cancels:
                self._finish(seq, "cancelled", outputs)
            elif len(seq.prompt_ids) + 1 > self.max_model_len or not seq.prompt_ids:
                self._finish(seq, "error", outputs,
                             error=f"prompt of {len(seq.prompt_ids)} tokens does not fit {self.max_model_len}")
            elif seq.generated and len(seq.generated) >= seq.max_tokens:
                self._finish(seq, "length", outputs)
            else:
                seq.max_tokens = min(seq.max_tokens, self.max_model_len - len(seq.prompt_ids))
                enqueue(self.waiting, seq)

    def _take_cancels(self, outputs: list[Output]) -> None:
        while self._aborts:
            seq = self._aborts.popleft()
            if seq in self.waiting:
                self.waiting.remove(seq)
            self._finish(seq, None, outputs)
        while self._cancels:
            rid = self._cancels.popleft()
            self._recent_cancels[rid] = None
            while len(self._recent_cancels) > 10_000:
                self._recent_cancels.popitem(last=False)
            for seq in [s for s in self.waiting if s.request_id == rid]:
                self.waiting.remove(seq)
                self._finish(seq, "cancelled", outputs)
            for seq in [s for s in self.running if s.request_id == rid]:
                self._finish(seq, "cancelled", outputs)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            seq = self.waiting[0]
            need = self.blocks_for(seq.limit)
            if self.reserved_blocks + need > self.cache.allocator.num_blocks:
                break
            self.waiting.popleft()
            self.reserved_blocks += need
            seq.scheduled_at = time.time()
            self.running.append(seq)
            if self.metrics is not None:
                self.metrics.scheduled(seq)

    def _schedule(self) -> tuple[list[tuple[Sequence, int]], list[Sequence]]:
        budget = self.prefill_chunk
        prefill: list[tuple[Sequence, int]] = []
        decode: list[Sequence] = []
        for seq in self.running:
            if seq.pending == 1:
                decode.append(seq)
            elif budget > 0:
                n = min(seq.pending, budget)
                budget -= n
                prefill.append((seq, n))
        return prefill, decode

    def _run(self, rows: list[tuple[Sequence, int]], outputs: list[Output]) -> None:
        bs = self.cache.block_size
        q = max(n for _, n in rows)
        ids = torch.zeros(len(rows), q, dtype=torch.long)
        pos = torch.zeros(len(rows), q, dtype=torch.long)
        valid = torch.zeros(len(rows), q, dtype=torch.bool)
        ends = []
        for r, (seq, n) in enumerate(rows):
            start = seq.computed
            need = self.blocks_for(start + n) - len(seq.blocks)
            if need > 0:
                seq.blocks += self.cache.allocator.take(need)
            ids[r, :n] = torch.tensor(seq.all_ids[start:start + n])
            pos[r, :n] = torch.arange(start, start + n)
            pos[r, n:] = start
            valid[r, :n] = True
            ends.append(start + n)
        length = max(ends)
        width = self.blocks_for(length)
        table = torch.zeros(len(rows), width, dtype=torch.long)
        for r, (seq, _) in enumerate(rows):
            k = min(width, len(seq.blocks))
            table[r, :k] = torch.tensor(seq.blocks[:k])
        p = torch.arange(length)
        gather_idx = table[:, p // bs] * bs + p % bs
        slots = torch.gather(table, 1, pos // bs)[valid] * bs + (pos % bs)[valid]
        mask = (p.view(1, 1, -1) <= pos.unsqueeze(-1)).unsqueeze(1)
        dev = self.input_device
        out = self.decoder(input_ids=ids.to(dev), attention_mask=mask.to(dev), position_ids=pos.to(dev),
                           past_key_values=StepCache(self.cache, slots, valid, gather_idx), use_cache=True)
        hidden = out.last_hidden_state
        last = torch.tensor([n - 1 for _, n in rows], device=hidden.device)
        h = hidden[torch.arange(len(rows), device=hidden.device), last]
        to_sample = []
        for r, (seq, n) in enumerate(rows):
            seq.computed += n
            if seq.pending == 0:
                to_sample.append(r)
        if not to_sample:
            return
        logits = self.lm_head(h[to_sample].to(self.lm_head.weight.device))
        picked = [rows[r][0] for r in to_sample]
        mask_rows(logits, picked)  # grammar hook: constrained rows (tools, response_format) masked
        tokens = sample(logits, [(s.temperature, s.top_p, s.seed, len(s.generated)) for s in picked])
        now = time.time()
        for seq, token in zip(picked, tokens):
            self._append(seq, token, now, outputs)

    def _append(self, seq: Sequence, token: int, now: float, outputs: list[Output]) -> None:
        advance(seq, token)  # grammar hook: the request's grammar state follows the sampled token
        if self.metrics is not None:
            self.metrics.token(seq, now)
        if seq.first_token_at is None:
            seq.first_token_at = now
        seq.last_token_at = now
        if token in self.eos_ids:  # flush text held back for a stop string that never came
            if seq.emitted_text != (text := self.tokenizer.decode(seq.generated, skip_special_tokens=True)):
                self._emit(seq, text, outputs)
            self._finish(seq, "stop", outputs)
            return
        seq.generated.append(token)
        seq.unsent_ids.append(token)
        text = self.tokenizer.decode(seq.generated, skip_special_tokens=True)
        at = seq.matcher.find(text, len(seq.emitted_text)) if seq.matcher.stops else None
        if at is not None:
            self._emit(seq, text[:at], outputs)
            self._finish(seq, "stop", outputs)
            return
        done = len(seq.generated) >= seq.max_tokens
        self._emit(seq, text if done else text[:seq.matcher.safe_end(text)], outputs)
        if done:
            self._finish(seq, "length", outputs)

    def _emit(self, seq: Sequence, upto: str, outputs: list[Output]) -> None:
        delta = upto[len(seq.emitted_text):] if upto.startswith(seq.emitted_text) else ""
        if not delta:
            return
        seq.emitted_text += delta
        outputs.append(Output(seq, chunk_seq=seq.next_seq, text=delta, token_ids=seq.unsent_ids))
        seq.unsent_ids = []
        seq.next_seq += 1

    def _finish(self, seq: Sequence, reason: str | None, outputs: list[Output], error: str | None = None) -> None:
        seq.finished_at = time.time()
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
            self.reserved_blocks -= self.blocks_for(seq.limit)
            self.cache.allocator.give(seq.blocks)
            seq.blocks = []
        if reason is None:
            return
        outputs.append(Output(seq, finish_reason=reason, completion_seq=seq.next_seq, error=error,
                              token_ids=seq.unsent_ids))
        seq.unsent_ids = []
        seq.next_seq += 1
        if self.metrics is not None:
            self.metrics.finished(seq)

    # ---- convenience for tests and the benchmark ----
    def generate(self, seqs: list[Sequence]) -> dict[str, list[Output]]:
        for s in seqs:
            self.add(s)
        got: dict[str, list[Output]] = {s.request_id: [] for s in seqs}
        while self.has_work:
            for o in self.step():
                got.setdefault(o.seq.request_id, []).append(o)
        return got
