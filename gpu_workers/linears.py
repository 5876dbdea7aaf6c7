"""The engine's linear layers on the CPU: weights prepacked once for oneDNN, used by the engine's forward
only.

`torch.nn.functional.linear` on a CPU calls MKL's sgemm, which re-packs the weight matrix into its
blocked layout on every call: for the engine's small batches (1-64 rows per step) that packing is a
large part of each matmul, and on AMD CPUs MKL takes its AVX2 path. vLLM's CPU build packs every
linear layer's weight once for oneDNN (`onednn_mm`); this does the same with PyTorch's own oneDNN
ops (`mkldnn._reorder_linear_weight` once, `mkldnn._linear_pointwise` per call, the pair that
`torch.compile` emits for frozen CPU linears).

The packed path is taken only inside `engine_forward()` (the engine's step, on its thread): the same
model object called by anyone else (`generate()`, another thread) runs torch's own linear on the
original weights, untouched. Only plain `nn.Linear` layers with floating CPU weights are packed
(not bitsandbytes' quantized subclasses, not GPU layers). The packed copies cost one more copy of
those weights in memory.
"""

from __future__ import annotations

import contextlib
import threading
import types

import torch
import torch.nn.functional as F

_STATE = threading.local()
PACK_ROWS = 64  # the batch size oneDNN chooses its weight layout for (any row count runs on it)


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A [out, in] weight in oneDNN's blocked layout, once."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if getattr(_STATE, "on", False) and x.dtype == self._ts_packed.dtype:
        return packed_linear(x, self._ts_packed, self.bias)
    return F.linear(x, self.weight, self.bias)


def pack(model, modules=None) -> int:
    """Prepack the decoder's and the LM head's linear weights (idempotent), or only those of `modules`.
    Returns how many layers use it."""
    if not available():
        return 0
    n = 0
    for module in model.modules() if modules is None else modules:
        if type(module) is not torch.nn.Linear:
            continue
        w = module.weight
        if w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16):
            continue
        if not hasattr(module, "_ts_packed"):
            module._ts_packed = pack_weight(w)
            module.forward = types.MethodType(_forward, module)
        n += 1
    return n


@contextlib.contextmanager
def engine_forward():
    """Within this block (on this thread) packed linear layers run on their packed weights."""
    before = getattr(_STATE, "on", False)
    _STATE.on = True
    try:
        yield
    finally:
        _STATE.on = before
