"""The iteration-level batching engine: admit, one forward step, post-process, repeat.

Each `step()`:
  1. takes in new requests, cancellations and aborts (thread-safe queues fed by the service);
  2. admits waiting requests by tier (gpu_workers/priority.py), FIFO within a tier, while their
     worst-case pages (prompt + max_tokens) fit the KV budget and the batch has room: load can
     never exhaust the pool, so nothing is preempted; an admitted request gets a KV slot
     (kv_cache.SlotPool) and, when it is first scheduled, the longest cached prefix of its
     tokens (prefix_cache.py: requests admitted together share what the earlier ones prefilled);
  3. runs ONE forward over the packed tokens of the step: one token of every decoding request
     (in slot order) and at most `prefill_chunk` prompt tokens (chunked prefill: a long prompt is
     spread over several steps, so running streams get a token every step), without padding;
     attention reads the slots in place, the decoding rows batched (attention.py; on a CPU by the
     engine's own decode kernel, cpu_kernels.py); on a CPU the linear layers run on weights
     prepacked once for oneDNN (linears.py), and a Llama runs the engine's own forward on fused
     kernels (llama_step.py);
  4. samples the batch on the device, detokenises incrementally, applies stop strings and the
     stream interval (gpu_workers/streaming.py: a request's text is written as a chunk at its first
     text, its end, or once enough tokens or milliseconds have passed since its last chunk), stores
     the full prompt pages of requests that finished prefilling in the prefix cache, and frees
     the pages of every request that finished, at once.
"""

from __future__ import annotations

import collections
import contextlib
import time

import torch

from gpu_workers.attention import Chunk, StepPlan, install
from gpu_workers.backend import Intake
from gpu_workers.cpu_kernels import available
from gpu_workers.detokenizer import Detokenizer
from gpu_workers.grammar import mask_rows
from gpu_workers.kv_cache import KVBudget, SlotPool
from gpu_workers.linears import engine_forward, pack
from gpu_workers.llama_step import LlamaStep, supports
from gpu_workers.logits import Logprobs, shape
from gpu_workers.prefix_cache import PrefixCache, page_hashes
from gpu_workers.priority import enqueue
from gpu_workers.sampling import new_seed, sample
from gpu_workers.sequence import Output, Sequence
from gpu_workers.streaming import TextStream

__all__ = ["Engine", "Output", "Sequence"]

_NO_MASK = torch.ones(
    1, 1, 1, 1, dtype=torch.bool
)  # a 4D mask is passed through untouched; attention masks per row


class Engine(Intake, TextStream):
    def __init__(
        self,
        model,
        tokenizer,
        cache: KVBudget,
        *,
        max_running: int = 32,
        prefill_chunk: int = 256,
        max_model_len: int = 2048,
        metrics=None,
        prefix_cache: bool | int = True,
        packed_linears: bool = True,
        cpu_kernels: bool = True,
    ) -> None:
        """prefix_cache: True (a pool of half the KV budget's pages), a number of pages, or False/0 (off).
        packed_linears: the step's linear layers on weights prepacked for oneDNN (CPU; linears.py).
        cpu_kernels: on a CPU where they are built (cpu_kernels.py), decoding rows attended by the engine's
        kernel, and a Llama run by the engine's own forward on fused kernels (llama_step.py)."""
        install(model)
        # a Llama on the CPU: the engine's own forward (llama_step.py), its layers' weights packed there
        self.llama_step = LlamaStep(model) if cpu_kernels and supports(model) else None
        lm_head = [model.get_output_embeddings()] if self.llama_step is not None else None
        self.packed_linears = pack(model, lm_head) if packed_linears else 0
        self._linears = engine_forward if self.packed_linears else contextlib.nullcontext
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
        self._init_intake()
        self.steps = 0
        pages = cache.allocator.num_blocks // 2 if prefix_cache is True else int(prefix_cache)
        self.prefix_cache = PrefixCache(cache, pages) if pages > 0 else None
        self.slots = SlotPool(cache, max_running, self.max_model_len)
        self.decode_kernel = (
            cpu_kernels
            and available()
            and all(
                t.device.type == "cpu" and t.dtype in (torch.float32, torch.bfloat16, torch.float16)
                for t in self.slots.layers
            )
        )
        self._mask_cache: dict[tuple[int, int], torch.Tensor] = {}

    # ---- called from any thread ----
    def add(self, seq: Sequence) -> None:
        if seq.seed is None:
            seq.seed = new_seed()
        super().add(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._inbox or self._cancels or self._aborts)

    @property
    def queued(self) -> int:
        return len(self.waiting) + len(self._inbox)

    def kv_usage(self) -> float:
        """The share of the KV budget's pages in use."""
        return self.cache.usage()

    def reset_prefix_cache(self) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

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
        rows = self._schedule()
        if rows:
            self._run(rows, outputs)
        self.steps += 1
        if self.metrics is not None:
            self.metrics.engine_state(len(self.running), self.queued, self.kv_usage())
        return outputs

    def _accept(self, seq: Sequence, outputs: list[Output]) -> None:
        enqueue(self.waiting, seq)

    def _take_cancels(self, outputs: list[Output]) -> None:
        while self._aborts:
            seq = self._aborts.popleft()
            if seq in self.waiting:
                self.waiting.remove(seq)
            self._finish(seq, None, outputs)
        for rid in self._taken_cancels():
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
            seq.slot = self.slots.take(seq.limit)
            seq.kv = self.slots.view(seq.slot)
            seq.detok = Detokenizer(self.tokenizer, seq.generated)
            seq.text = seq.detok.text
            seq.computed = 0
            seq.matched = self.prefix_cache is None
            if self.prefix_cache is not None:
                seq.page_keys = page_hashes(seq.all_ids, seq.tenant, self.cache.block_size)
            self.running.append(seq)
            if self.metrics is not None:
                self.metrics.scheduled(seq)

    def _schedule(self) -> list[tuple[Sequence, int]]:
        """Rows of the step's single forward: decodes in slot order, then prefill chunks within the budget."""
        budget = self.prefill_chunk
        decodes: list[tuple[Sequence, int]] = []
        chunks: list[tuple[Sequence, int]] = []
        busy = {
            k for s in self.running if s.matched and s.pending > 1 for k in s.page_keys
        }  # being prefilled
        for seq in self.running:
            if not seq.matched and (budget > 0 or seq.pending <= 1):
                if self._sibling_prefills(seq, busy):
                    continue  # the pages it would compute next are being computed: take them when stored
                self._match_prefix(seq)
                busy.update(seq.page_keys)
            if seq.pending == 1:
                decodes.append((seq, 1))
            elif budget > 0:
                n = min(seq.pending, budget)
                budget -= n
                # a 1-token chunk (the budget's last token) has a decode's shape and is run as one:
                # it must sit among the decodes, in slot order, before the packed chunks
                (decodes if n == 1 else chunks).append((seq, n))
        decodes.sort(key=lambda r: r[0].slot)
        return decodes + chunks

    def _sibling_prefills(self, seq: Sequence, busy: set[bytes]) -> bool:
        keys = seq.page_keys[: (seq.pending - 1) // self.cache.block_size]
        n = self.prefix_cache.cached(keys)
        return n < len(keys) and keys[n] in busy

    def _match_prefix(self, seq: Sequence) -> None:
        """At its first scheduling (not at admission): what requests prefilled meanwhile is reused too."""
        seq.matched = True
        all_ids = seq.all_ids  # at least the last token is computed: its logits are needed
        pages = self.prefix_cache.match(all_ids, seq.tenant, len(all_ids) - 1, seq.page_keys)
        seq.computed = self.prefix_cache.load(seq.kv, pages)
        seq.cached_tokens = min(seq.computed, len(seq.prompt_ids))
        self._take_pages(seq, seq.computed)

    def _take_pages(self, seq: Sequence, tokens: int) -> None:
        need = self.blocks_for(tokens) - len(seq.blocks)
        if need > 0:
            seq.blocks += self.cache.allocator.take(need)

    def _mask(self, start: int, n: int) -> torch.Tensor | None:
        """[n, start + n]: query i (position start + i) sees keys 0..start + i."""
        if start == 0 or n == 1:
            return None
        key = (start, n)
        mask = self._mask_cache.get(key)
        if mask is None:
            mask = torch.arange(start + n).view(1, -1) <= torch.arange(start, start + n).view(-1, 1)
            mask = mask.to(self.input_device)
            if len(self._mask_cache) < 256:
                self._mask_cache[key] = mask
        return mask

    def _run(self, rows: list[tuple[Sequence, int]], outputs: list[Output]) -> None:
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        decodes: list[tuple[int, int]] = []
        chunks: list[Chunk] = []
        ends: list[int] = []
        for seq, n in rows:
            start = seq.computed
            self._take_pages(seq, start + n)
            a = len(ids)
            if n == 1:
                ids.append(
                    seq.prompt_ids[start]
                    if start < len(seq.prompt_ids)
                    else seq.generated[start - len(seq.prompt_ids)]
                )
                pos.append(start)
                slots.append(seq.slot)
                decodes.append((seq.slot, start + 1))
            else:
                ids += seq.all_ids[start : start + n]
                pos += range(start, start + n)
                slots += [seq.slot] * n
                chunks.append(Chunk(seq.slot, a, a + n, start, self._mask(start, n)))
            ends.append(a + n)
        dev = self.input_device
        plan = StepPlan.build(self.slots.layers, decodes, chunks, slots, pos, dev, self.decode_kernel)
        with self._linears():
            if self.llama_step is not None:
                hidden = self.llama_step(torch.tensor(ids, device=dev), plan.positions, plan)
            else:
                out = self.decoder(
                    input_ids=torch.tensor([ids], device=dev),
                    position_ids=plan.positions.unsqueeze(0),
                    attention_mask=_NO_MASK.to(dev),
                    use_cache=False,
                    ts_plan=plan,
                )
                hidden = out.last_hidden_state[0]
        to_sample = []
        for (seq, n), end in zip(rows, ends):
            seq.computed += n
            if self.prefix_cache is not None and n > 1:
                # the full pages of the prompt (and any resumed tokens) prefilled so far may serve others
                written = self.prefix_cache.store(
                    seq.kv, seq.all_ids, seq.tenant, seq.computed, seq.page_keys
                )
                seq.cache_written = min(seq.cache_written + written, len(seq.prompt_ids) - seq.cached_tokens)
            if seq.pending == 0:
                to_sample.append(end - 1)
        if not to_sample:
            return
        picked = [seq for seq, _ in rows if seq.pending == 0]
        h = hidden[torch.tensor(to_sample, device=hidden.device)]
        with self._linears():
            logits = self.lm_head(h.to(self.lm_head.weight.device))
        reported = Logprobs(logits, picked)  # the model's own distribution, for rows that asked
        shape(logits, picked)  # penalties and logit_bias of the rows that set them
        mask_rows(logits, picked)  # grammar hook: constrained rows (tools, response_format) masked
        tokens = sample(logits, [(s.temperature, s.top_p, s.seed, len(s.generated)) for s in picked])
        now = time.time()
        for row, (seq, token) in enumerate(zip(picked, tokens)):
            self._append(seq, token, now, outputs, reported.of(row, token))
        if self.metrics is not None:
            self.metrics.generated(len(picked))  # counted once per step, not per token

    def _finish(
        self, seq: Sequence, reason: str | None, outputs: list[Output], error: str | None = None
    ) -> None:
        seq.finished_at = time.time()
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
            self.reserved_blocks -= self.blocks_for(seq.limit)
            self.cache.allocator.give(seq.blocks)
            seq.blocks = []
            if self.prefix_cache is not None and reason is not None and seq.computed:
                self.prefix_cache.store(seq.kv, seq.all_ids, seq.tenant, seq.computed)  # prompt + answer
            self.slots.give(seq.slot, seq.computed)
            seq.kv = None
            seq.slot = None
        if reason is None:
            return
        self._completion(seq, reason, outputs, error)

    # ---- convenience for tests and the benchmark ----
    def generate(self, seqs: list[Sequence]) -> dict[str, list[Output]]:
        for s in seqs:
            self.add(s)
        got: dict[str, list[Output]] = {s.request_id: [] for s in seqs}
        while self.has_work:
            for o in self.step():
                got.setdefault(o.seq.request_id, []).append(o)
        return got
