"""A paged KV cache: a fixed pool of pages per layer, page tables per request.

The pool is allocated once (its size is the KV budget), so load can never make the worker
run out of memory; a request holds only the pages its tokens fill and gives them back the
moment it finishes. During a forward pass `StepCache` stands in for transformers' Cache: the
attention layers call `update(k, v, layer)`, which scatters the new keys/values into their
pages and returns each row's pages gathered in logical order. The caller passes a 4D mask
(key position <= query position), which transformers uses as is.
"""

from __future__ import annotations

import torch


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
    """Per layer one key pool and one value pool of shape [num_blocks * block_size, kv_heads, head_dim]."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, devices: list[torch.device]) -> None:
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.k = [torch.zeros(num_blocks * block_size, kv_heads, head_dim, dtype=dtype, device=d) for d in devices]
        self.v = [torch.zeros_like(k) for k in self.k]
        self.devices = devices

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @classmethod
    def for_model(cls, model, num_blocks: int | None, block_size: int, memory_gb: float) -> PagedKVCache:
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
        if num_blocks is None:
            per_block = cls.bytes_per_token(len(layers), kv_heads, head_dim, dtype) * block_size
            num_blocks = max(4, int(memory_gb * 2**30 // per_block))
        devices = [next(layer.parameters()).device for layer in layers]
        return cls(len(layers), kv_heads, head_dim, num_blocks, block_size, dtype, devices)

    @property
    def capacity_tokens(self) -> int:
        return self.allocator.num_blocks * self.block_size

    def usage(self) -> float:
        return self.allocator.used / self.allocator.num_blocks

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class StepCache:
    """The cache view of one forward pass over `rows` sequences.

    slots:       flat pool index of every new (non-padding) token, in row-major order
    valid:       bool [B, q] marking the new tokens that are real (not padding)
    gather_idx:  [B, L] flat pool index of every logical position 0..L-1 of each row
    """

    def __init__(self, cache: PagedKVCache, slots: torch.Tensor, valid: torch.Tensor, gather_idx: torch.Tensor):
        self.cache = cache
        self._per_device: dict[torch.device, tuple] = {}
        self._src = (slots, valid, gather_idx)

    def _on(self, device: torch.device):
        got = self._per_device.get(device)
        if got is None:
            got = self._per_device[device] = tuple(t.to(device, non_blocking=True) for t in self._src)
        return got

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        pool_k, pool_v = self.cache.k[layer_idx], self.cache.v[layer_idx]
        slots, valid, gather_idx = self._on(pool_k.device)
        # [B, H, q, D] -> [B, q, H, D] -> only the real tokens -> their pages
        pool_k[slots] = key_states.transpose(1, 2)[valid].to(pool_k.dtype)
        pool_v[slots] = value_states.transpose(1, 2)[valid].to(pool_v.dtype)
        b, length = gather_idx.shape
        k = pool_k[gather_idx.reshape(-1)].view(b, length, *pool_k.shape[1:]).transpose(1, 2)
        v = pool_v[gather_idx.reshape(-1)].view(b, length, *pool_v.shape[1:]).transpose(1, 2)
        return k.to(key_states.dtype), v.to(value_states.dtype)

    # the few Cache methods some model code asks for
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    @property
    def is_compileable(self) -> bool:
        return False
