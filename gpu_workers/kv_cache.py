"""The KV budget in pages, and the slots that hold each running request's keys/values.

Budget: a fixed number of pages of `block_size` tokens (`BlockAllocator`); a request is admitted
only while the worst case of every running request fits (engine.py), and takes pages as its
tokens arrive, so load can never exhaust the budget.

Storage (`SlotPool`): per layer ONE tensor [slots, 2 (k, v), kv_heads, max_len, head_dim], one
slot per running request (`max_running` slots of the model's context each). A request's keys are
a plain slice of its slot (no page table gather), and because every slot lives in one tensor the
decoding rows of a step are attended together: one SDPA call per layer over a range of slots
(attention.py) instead of one per row. On a CPU untouched storage costs no physical memory (the
OS maps pages on first write; a slot whose request ran long is handed back to the OS when it is
freed), so the pool's size is virtual and the page budget is what bounds admission. A GPU holds
the whole pool (slots x context x bytes per token) and would want a paged-attention kernel in
attention.py's place.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import sys

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


class KVBudget:
    """The KV budget (pages) and the shape of the per-request storage, per layer and device.

    Nothing is stored in pages: the page (`block_size` tokens) is the unit in
    which admission counts the budget; the keys and values live in `SlotPool`, one contiguous
    slot per running request."""

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        devices: list[torch.device],
    ) -> None:
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
    def key_dtype(model, layer, hidden: int, device: torch.device) -> torch.dtype:
        """The dtype keys and values come out in: what the key projection returns for the hidden
        states' dtype (bitsandbytes' 8-bit layers return bf16 beside float32 parameters, so neither
        the parameters' dtype nor the config's is it)."""
        embed = model.get_input_embeddings().weight.dtype
        proj = getattr(getattr(layer, "self_attn", None), "k_proj", None)
        if proj is not None:
            with torch.no_grad():
                dtype = proj(torch.zeros(1, hidden, dtype=embed, device=device)).dtype
        else:
            dtype = embed
        compute = getattr(getattr(model.config, "quantization_config", None), "bnb_4bit_compute_dtype", None)
        if isinstance(compute, torch.dtype):
            dtype = compute
        return dtype if dtype in (torch.float32, torch.float16, torch.bfloat16) else torch.float32

    @staticmethod
    def model_shape(model) -> tuple[int, int, int, torch.dtype, list[torch.device]]:
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        layers = list(model.get_decoder().layers)
        devices = [next(layer.parameters()).device for layer in layers]
        dtype = KVBudget.key_dtype(model, layers[0], cfg.hidden_size, devices[0])
        return len(layers), kv_heads, head_dim, dtype, devices

    @classmethod
    def for_model(cls, model, num_blocks: int | None, block_size: int, memory_gb: float) -> KVBudget:
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
        return self.capacity_tokens * self.bytes_per_token(
            self.num_layers, self.kv_heads, self.head_dim, self.dtype
        )

    def storage(self, tokens: int) -> list[torch.Tensor]:
        """One request's KV: per layer [2, kv_heads, tokens, head_dim] on that layer's device."""
        return [
            torch.empty(2, self.kv_heads, tokens, self.head_dim, dtype=self.dtype, device=d)
            for d in self.devices
        ]


class SlotPool:
    """Per layer [slots, 2, kv_heads, max_len, head_dim]; a running request holds one slot.

    Short requests take the lowest free slot and long ones the highest, so rows of similar length
    sit next to each other and a range of slots attended in one call carries little padding.
    """

    LONG = 256  # tokens (prompt + max_tokens) from which a request counts as long

    def __init__(self, cache: KVBudget, slots: int, max_len: int) -> None:
        self.slots = slots
        self.max_len = max_len
        shape = (slots, 2, cache.kv_heads, max_len, cache.head_dim)
        self.layers = [_zeros(shape, cache.dtype, d) for d in cache.devices]
        self._free = set(range(slots))
        self._touched = [0] * slots  # highest position ever written per slot (what the OS has mapped)

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self, limit: int) -> int:
        slot = max(self._free) if limit >= self.LONG else min(self._free)
        self._free.remove(slot)
        return slot

    def view(self, slot: int) -> list[torch.Tensor]:
        """The slot's storage per layer: [2, kv_heads, max_len, head_dim], the layout of `cache.storage`."""
        return [layer[slot] for layer in self.layers]

    def give(self, slot: int, used: int) -> None:
        """Free `slot`; on a CPU a slot that held more than LONG tokens returns its memory to the OS."""
        self._touched[slot] = max(self._touched[slot], used)
        if self._touched[slot] > self.LONG and _release([layer[slot] for layer in self.layers]):
            self._touched[slot] = 0
        self._free.add(slot)


_PAGE = 4096


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled pool. Batched attention reads the padding beyond a row's length (masked), so it
    must hold finite numbers: memory reused from earlier tensors may hold NaN, and NaN survives a mask
    (NaN + -inf is NaN). On a CPU the pool lies on fresh anonymous memory, which the OS maps as zero
    pages on first touch, so untouched slots still cost nothing; elsewhere it is zeroed outright."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    private = (
        mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    )  # private: madvise(DONTNEED) gives its pages back as zeros
    return torch.frombuffer(
        mmap.mmap(-1, max(size, 1), flags=private), dtype=dtype, count=math.prod(shape)
    ).view(shape)


def _release(views: list[torch.Tensor]) -> bool:
    """madvise(MADV_DONTNEED) the whole pages of these contiguous CPU tensors (Linux; else a no-op)."""
    if not sys.platform.startswith("linux") or any(v.device.type != "cpu" for v in views):
        return False
    libc = _libc()
    if libc is None:
        return False
    for v in views:
        start = v.data_ptr()
        end = start + v.numel() * v.element_size()
        lo, hi = -(-start // _PAGE) * _PAGE, end // _PAGE * _PAGE
        if hi > lo:
            libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), 4)  # 4: MADV_DONTNEED
    return True


_LIBC: list = []


def _libc():
    if not _LIBC:
        try:
            _LIBC.append(ctypes.CDLL(None, use_errno=True))
        except OSError:
            _LIBC.append(None)
    return _LIBC[0]
