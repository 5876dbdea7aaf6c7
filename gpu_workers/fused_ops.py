"""The element-wise steps of a Llama layer fused for the engine's forward on a CPU (csrc/fused_ops.cpp).

In transformers' Llama code RMSNorm is 8 torch ops, the rotary embedding 10 per layer (slices,
negation, concatenation, products, sums) and the MLP's activation 2 (SiLU, product): with 64 rows a
step each is a few microseconds of dispatch and a pass over memory, about a fifth of a decode
step's time on 2 cores besides the matmuls. `install(model)` points these at one-pass kernels of
the engine's CPU library (cpu_kernels.py), which round where transformers rounds (bf16 results
equal transformers' own but for the order of the norm's fp32 sum):
  * each `LlamaRMSNorm` -> `tokenstream::rms_norm`;
  * each `LlamaMLP` with SiLU -> `down(tokenstream::silu_mul(gate(x), up(x)))`;
  * `modeling_llama.apply_rotary_pos_emb` -> `tokenstream::rotary`, which also writes the query in
    the token-major layout the engine's attention reads.
Like the packed linears (linears.py) they act only inside `linears.engine_forward(fused=True)` on the
engine's thread; the same model called by anyone else runs transformers' code untouched. Other model
families keep transformers' code (nothing is replaced where the classes differ).
"""

from __future__ import annotations

import types

import torch

from gpu_workers import cpu_kernels
from gpu_workers.linears import fused_forward


def _rms_forward(self, x: torch.Tensor) -> torch.Tensor:
    if fused_forward() and x.device.type == "cpu" and x.dtype == self.weight.dtype:
        return torch.ops.tokenstream.rms_norm(x, self.weight, self.variance_epsilon)
    return type(self).forward(self, x)


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    if fused_forward() and x.device.type == "cpu":
        return self.down_proj(torch.ops.tokenstream.silu_mul(self.gate_proj(x), self.up_proj(x)))
    return type(self).forward(self, x)


def _rotary(original):
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if (fused_forward() and unsqueeze_dim == 1 and q.device.type == "cpu"
                and q.dtype == k.dtype == cos.dtype == sin.dtype):
            return torch.ops.tokenstream.rotary(q, k, cos, sin)
        return original(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb.ts_fused = True
    return apply_rotary_pos_emb


def install(model) -> int:
    """Fuse what can be fused in `model` (idempotent); returns how many modules (and functions) changed."""
    if not cpu_kernels.available() or any(p.device.type != "cpu" for p in model.parameters()):
        return 0
    from transformers.models.llama import modeling_llama as llama

    n = 0
    for module in model.modules():
        if type(module) is llama.LlamaRMSNorm:
            module.forward = types.MethodType(_rms_forward, module)
            n += 1
        elif type(module) is llama.LlamaMLP and getattr(module.config, "hidden_act", None) == "silu":
            module.forward = types.MethodType(_mlp_forward, module)
            n += 1
    if n and not getattr(llama.apply_rotary_pos_emb, "ts_fused", False):
        llama.apply_rotary_pos_emb = _rotary(llama.apply_rotary_pos_emb)
    return n + (1 if n else 0)
