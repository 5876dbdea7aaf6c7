"""The KV budget in pages, each running request's KV kept contiguous, and the attention that reads it.

Budget: a fixed number of pages of `block_size` tokens (`BlockAllocator`); a request is admitted
only while the worst case of every running request fits (engine.py), and takes pages as its
tokens arrive, so load can never exhaust memory. Storage: each running request owns, per layer,
one tensor [2 (k, v), kv_heads, capacity, head_dim] sized at admission to its worst case
(prompt + max_tokens). Attention then reads a request's keys as a plain slice: no page table
gather and no padded dense copy per step, which on a CPU costs more than the attention itself
(a paged-attention kernel would be the GPU's answer; transformers' attention interface lets a
CUDA kernel take this function's place). On a CPU the tensor's untouched pages cost no physical
memory (the OS maps them on first write).

`paged_attention` is registered with transformers as attention implementation "tokenstream":
with a `ts_plan` keyword (the engine's forward) it writes the step's new keys/values into each
row's storage and runs SDPA per row over the slice; without one (plain `generate()` on the same
model object) it is transformers' SDPA attention, so the model keeps working for other callers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ATTN_NAME = "tokenstream"


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.num_blocks - len(self._free)

    def take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"KV pool exhausted: want {n} pages, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def give(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


class PagedKVCache:
    """The KV budget (pages) and the shape of the per-request storage, per layer and device."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, devices: list[torch.device]) -> None:
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.devices = devices

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @staticmethod
    def model_shape(model) -> tuple[int, int, int, torch.dtype, list[torch.device]]:
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        layers = list(model.get_decoder().layers)
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            dtype = torch.float32
        compute = getattr(getattr(model.config, "quantization_config", None), "bnb_4bit_compute_dtype", None)
        if isinstance(compute, torch.dtype):
            dtype = compute
        devices = [next(layer.parameters()).device for layer in layers]
        return len(layers), kv_heads, head_dim, dtype, devices

    @classmethod
    def for_model(cls, model, num_blocks: int | None, block_size: int, memory_gb: float) -> PagedKVCache:
        layers, kv_heads, head_dim, dtype, devices = cls.model_shape(model)
        if num_blocks is None:
            per_block = cls.bytes_per_token(layers, kv_heads, head_dim, dtype) * block_size
            num_blocks = max(4, int(memory_gb * 2**30 // per_block))
        return cls(layers, kv_heads, head_dim, num_blocks, block_size, dtype, devices)

    @property
    def capacity_tokens(self) -> int:
        return self.allocator.num_blocks * self.block_size

    def usage(self) -> float:
        return self.allocator.used / self.allocator.num_blocks

    def nbytes(self) -> int:
        """Bytes the whole budget holds when every page is in use."""
        return self.capacity_tokens * self.bytes_per_token(self.num_layers, self.kv_heads, self.head_dim, self.dtype)

    def storage(self, tokens: int) -> list[torch.Tensor]:
        """One request's KV: per layer [2, kv_heads, tokens, head_dim] on that layer's device."""
        return [torch.empty(2, self.kv_heads, tokens, self.head_dim, dtype=self.dtype, device=d)
                for d in self.devices]


@dataclass(slots=True)
class Row:
    """One request in a packed forward: its new tokens are positions a..b of the step's token axis."""

    kv: list[torch.Tensor]
    a: int
    b: int
    start: int  # tokens already in its storage
    mask: torch.Tensor | None  # [n, start + n] for a chunk after earlier tokens; None: none or causal

    @property
    def end(self) -> int:
        return self.start + self.b - self.a


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query [1, H, T, D], key/value [1, KVH, T, D] of the step's T packed tokens -> [1, T, H, D]."""
    plan = kwargs.pop("ts_plan", None)
    if plan is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    layer = module.layer_idx
    new = torch.stack((key[0], value[0]))  # [2, KVH, T, D]: one copy into storage per row
    outs = []
    for r in plan:
        kv = r.kv[layer]
        end = r.end
        kv[:, :, r.start:end] = new[:, :, r.a:r.b]
        mask = r.mask if r.mask is None or r.mask.device == query.device else r.mask.to(query.device)
        o = F.scaled_dot_product_attention(query[:, :, r.a:r.b], kv[0, :, :end].unsqueeze(0),
                                           kv[1, :, :end].unsqueeze(0), attn_mask=mask,
                                           is_causal=r.mask is None and r.b - r.a > 1, scale=scaling, enable_gqa=True)
        outs.append(o[0].transpose(0, 1))
    out = torch.cat(outs).unsqueeze(0) if len(outs) > 1 else outs[0].unsqueeze(0)
    return out, None


def install(model) -> None:
    """Make `model` use `paged_attention` (idempotent); masks for other callers stay SDPA's."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_NAME, paged_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    if model.config._attn_implementation != ATTN_NAME:
        model.set_attn_implementation(ATTN_NAME)
