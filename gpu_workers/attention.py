"""The attention of the engine's packed forward: decoding rows batched per slot range, prefill chunks per row.

A step's forward packs the new tokens of every row on one axis: first the decoding rows (one
token each) in slot order, then the prefill chunks. `slot_attention`, registered with
transformers as attention implementation "tokenstream", receives that step's `StepPlan`
(keyword `ts_plan`) in every layer and
  1. writes the new keys/values of all T tokens into their slots with ONE index_put per layer;
  2. attends the decoding rows: on a CPU with the engine's kernel built (cpu_kernels.py), ONE call
     for all of them, each row over exactly its own keys in place; otherwise one SDPA call per
     *segment*: a range of consecutive slots read in place ([slots, kv_heads, longest, head_dim],
     a strided view, no copy), the query heads of each kv head folded into the query axis
     (grouped-query attention without repeating keys) and a length mask for the rows shorter than
     the segment's longest; the segments are chosen once per step (`StepPlan.build`) so that
     padding costs less than another call;
  3. attends each prefill chunk over its slot's slice (causal, or with a mask after cached tokens).
Without a plan (plain `generate()` on the same model object) it is transformers' SDPA attention,
so the model keeps working for other callers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

ATTN_NAME = "tokenstream"
CALL_COST = 256  # padding (slot x token positions) one more SDPA call is worth, measured on a CPU


@dataclass(slots=True)
class Chunk:
    """A prefill chunk: packed positions a..b, written at start.. of the slot's storage."""

    slot: int
    a: int
    b: int
    start: int
    mask: torch.Tensor | None  # [n, start + n] after cached tokens; None: causal from 0 (or one token)


@dataclass(slots=True)
class Segment:
    """Decoding rows whose slots lie in lo..hi-1, attended in one call over `longest` positions."""

    lo: int
    hi: int
    longest: int
    a: int  # their packed positions a..b (slot order)
    b: int
    where: torch.Tensor | None  # slot - lo of each row, when the range has slots without a decoding row
    mask: torch.Tensor | None  # [hi - lo, 1, 1, longest] key positions < length; None: all full


@dataclass
class StepPlan:
    pool: list[torch.Tensor]  # per layer [slots, 2, kv_heads, max_len, head_dim]
    slots: torch.Tensor  # [T] slot of every packed token
    positions: torch.Tensor  # [T] its position in the slot
    segments: list[Segment] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)
    kernel: tuple[torch.Tensor, torch.Tensor] | None = (
        None  # the decoding rows' (slots, lengths) for the CPU kernel
    )
    _moved: dict = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        pool: list[torch.Tensor],
        decodes: list[tuple[int, int]],
        chunks: list[Chunk],
        token_slots: list[int],
        token_positions: list[int],
        device,
        kernel: bool = False,
    ) -> StepPlan:
        """decodes: (slot, length after this token) of the decoding rows, in slot order (packed first).
        kernel: the CPU decode kernel serves them (one call per layer, no segments)."""
        plan = cls(
            pool,
            torch.tensor(token_slots, device=device),
            torch.tensor(token_positions, device=device),
            chunks=chunks,
        )
        if kernel and decodes:
            plan.kernel = (torch.tensor([s for s, _ in decodes]), torch.tensor([n for _, n in decodes]))
            return plan
        groups: list[list[tuple[int, int]]] = []
        for slot, length in decodes:  # greedy: extend the range while its padding costs less than a call
            if groups:
                g = groups[-1]
                longest = max(n for _, n in g)
                lo = g[0][0]
                grown = (slot - lo + 1) * max(longest, length) - (g[-1][0] - lo + 1) * longest
                if grown <= CALL_COST + length:
                    g.append((slot, length))
                    continue
            groups.append([(slot, length)])
        a = 0
        for g in groups:
            lo, hi = g[0][0], g[-1][0] + 1
            longest = max(n for _, n in g)
            dense = hi - lo == len(g)
            lengths = [1] * (hi - lo)  # slots without a decoding row: one key, a finite result, discarded
            for slot, n in g:
                lengths[slot - lo] = n
            mask = None
            if min(lengths) < longest:
                mask = (
                    (torch.arange(longest).view(1, -1) < torch.tensor(lengths).view(-1, 1))
                    .view(hi - lo, 1, 1, longest)
                    .to(device)
                )
            where = None if dense else torch.tensor([s - lo for s, _ in g], device=device)
            plan.segments.append(Segment(lo, hi, longest, a, a + len(g), where, mask))
            a += len(g)
        return plan

    def on(self, t: torch.Tensor | None, device) -> torch.Tensor | None:
        """`t` on `device` (layers sharded over GPUs), moved once per step."""
        if t is None or t.device == device:
            return t
        key = (id(t), device)
        if key not in self._moved:
            self._moved[key] = t.to(device)
        return self._moved[key]


def slot_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query [1, H, T, D], key/value [1, KVH, T, D] of the step's T packed tokens -> [1, T, H, D].

    There is no page table: keys and values are read in place from the
    dense slot pool (`kv_cache.SlotPool`, one contiguous slot per running request)."""
    plan: StepPlan | None = kwargs.pop("ts_plan", None)
    if plan is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    dev = query.device
    pool = plan.pool[module.layer_idx]
    heads, kv_heads, dim = query.shape[1], key.shape[1], query.shape[3]
    group = heads // kv_heads
    # 1. every new key/value into its slot: [T, 2, KVH, D] at (slot, position)
    new = torch.stack((key[0], value[0]), 1).transpose(0, 2)
    pool[plan.on(plan.slots, dev), :, :, plan.on(plan.positions, dev)] = new
    outs = []
    q_all = query[0].transpose(0, 1)  # [T, H, D]
    if plan.kernel is not None:
        # 2. decoding rows (packed first): one call, each over its own slot's keys
        slots, lengths = plan.kernel
        scale = scaling if scaling is not None else dim**-0.5
        outs.append(torch.ops.tokenstream.decode_attention(q_all[: len(slots)], pool, slots, lengths, scale))
    for s in plan.segments:
        # 2. decoding rows: one call per slot range, read in place
        span = s.hi - s.lo
        q = q_all[s.a : s.b]
        if s.where is not None:
            full = q.new_zeros(span, heads, dim)
            full[plan.on(s.where, dev)] = q
            q = full
        q = q.reshape(span, kv_heads, group, dim)  # the query heads of a kv head as its query positions
        k = pool[s.lo : s.hi, 0, :, : s.longest]
        v = pool[s.lo : s.hi, 1, :, : s.longest]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.on(s.mask, dev), scale=scaling)
        o = o.reshape(span, heads, dim)
        outs.append(o if s.where is None else o[plan.on(s.where, dev)])
    for c in plan.chunks:
        # 3. prefill chunks: each over its slot's keys 0..end
        end = c.start + c.b - c.a
        kv = pool[c.slot]
        o = F.scaled_dot_product_attention(
            query[:, :, c.a : c.b],
            kv[0, :, :end].unsqueeze(0),
            kv[1, :, :end].unsqueeze(0),
            attn_mask=plan.on(c.mask, dev),
            is_causal=c.mask is None and c.b - c.a > 1,
            scale=scaling,
            enable_gqa=True,
        )
        outs.append(o[0].transpose(0, 1))
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    return out.unsqueeze(0), None


def install(model) -> None:
    """Make `model` use `slot_attention` (idempotent); masks for other callers stay SDPA's."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if any(p.is_cuda for p in model.parameters()):
        # cuDNN's SDPA builds an execution plan per new shape, and a decode step's key length grows
        # every step: measured on an H200, 2.8 ms of host time per call, 72% of a 128-row step. The
        # flash and memory-efficient kernels need no plan. (Process-wide: one engine per worker.)
        torch.backends.cuda.enable_cudnn_sdp(False)
    AttentionInterface.register(ATTN_NAME, slot_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    if model.config._attn_implementation != ATTN_NAME:
        model.set_attn_implementation(ATTN_NAME)
