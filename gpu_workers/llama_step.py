"""The engine's own forward for Llama-family models on a CPU: the layers' math without the modules' Python.

Through transformers' modules a step's forward makes about 40 Python calls a layer (module
`__call__`s, keyword plumbing, views) besides its torch ops: on 2 cores that was 25-30 ms of a
110 ms step with 64 rows of SmolLM2, the gap left to vLLM, whose CPU build compiles its model
(torch.compile) and so runs no Python per layer. `LlamaStep` runs the same math as transformers'
`LlamaModel` with the model's own weights, a dozen calls a layer:

    h = rms_norm(x)                                  (the layer's input norm)
    q, k, v = split(h @ W_qkv)                       (one matmul: q, k and v prepacked together)
    q, k = rotary(q, k)                              (the model's own rotary embedding's cos / sin)
    o = attention(q, k, v) @ W_o                     (attention.slot_attention: the slot pool)
    x, h = x + o, rms_norm(x + o)                    (residual and norm in one pass)
    x = x + silu_and_mul(h @ W_gate_up) @ W_down     (gate and up prepacked together)

with the engine's CPU kernels (cpu_kernels.py) and oneDNN's prepacked matmuls (linears.py); each op
rounds where transformers rounds, so in bf16 the result is transformers' own but for matmul
accumulation order (`tests/test_cpu_kernels.py` compares greedy texts). `supports(model)` says
where it applies (plain transformers `LlamaModel`, SiLU, no biases, float weights on the CPU, the
kernels built); anything else runs transformers' forward as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_workers import cpu_kernels
from gpu_workers.attention import slot_attention
from gpu_workers.linears import available as packing_available
from gpu_workers.linears import pack_weight
from gpu_workers.linears import packed_linear as _linear

ops = torch.ops.tokenstream


def _pack(*weights: torch.Tensor) -> torch.Tensor:
    """Weights that read the same input, stacked and prepacked as one matmul."""
    return pack_weight(torch.cat([w.detach() for w in weights]))


def supports(model) -> bool:
    from transformers.models.llama import modeling_llama as llama

    decoder = model.get_decoder()
    cfg = model.config
    if type(decoder) is not llama.LlamaModel or not cpu_kernels.available() or not packing_available():
        return False
    if (
        getattr(cfg, "hidden_act", None) != "silu"
        or getattr(cfg, "attention_bias", False)
        or getattr(cfg, "mlp_bias", False)
    ):
        return False
    params = list(decoder.parameters())
    dtype = params[0].dtype
    if any(p.device.type != "cpu" or p.dtype != dtype for p in params) or dtype not in (
        torch.float32,
        torch.bfloat16,
    ):
        return False
    for layer in decoder.layers:
        a, m = layer.self_attn, layer.mlp
        if type(layer) is not llama.LlamaDecoderLayer or any(
            type(lin) is not torch.nn.Linear
            for lin in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)
        ):
            return False
    return True


@dataclass(slots=True)
class _Layer:
    attn: torch.nn.Module  # for slot_attention: layer_idx, head counts
    norm_in: torch.Tensor
    norm_post: torch.Tensor
    qkv: torch.Tensor  # prepacked [q; k; v]
    o: torch.Tensor
    gate_up: torch.Tensor  # prepacked [gate; up]
    down: torch.Tensor
    q_size: int
    kv_size: int


class LlamaStep:
    def __init__(self, model) -> None:
        decoder = model.get_decoder()
        self.embed = decoder.embed_tokens
        self.rotary = decoder.rotary_emb
        self.norm = decoder.norm.weight
        self.eps = decoder.norm.variance_epsilon
        cfg = model.config
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.layers = []
        with torch.no_grad():
            for layer in decoder.layers:
                a, m = layer.self_attn, layer.mlp
                self.layers.append(
                    _Layer(
                        a,
                        layer.input_layernorm.weight,
                        layer.post_attention_layernorm.weight,
                        _pack(a.q_proj.weight, a.k_proj.weight, a.v_proj.weight),
                        _pack(a.o_proj.weight),
                        _pack(m.gate_proj.weight, m.up_proj.weight),
                        _pack(m.down_proj.weight),
                        self.heads * self.head_dim,
                        self.kv_heads * self.head_dim,
                    )
                )

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, plan) -> torch.Tensor:
        """input_ids, positions [T] -> the last norm's hidden states [T, hidden]."""
        t = input_ids.shape[0]
        x = F.embedding(input_ids, self.embed.weight)
        cos, sin = self.rotary(x, positions.unsqueeze(0))
        d, eps = self.head_dim, self.eps
        h = ops.rms_norm(x, self.layers[0].norm_in, eps)
        for i, layer in enumerate(self.layers):
            qkv = _linear(h, layer.qkv)
            q = qkv[:, : layer.q_size].view(1, t, self.heads, d).transpose(1, 2)
            k = (
                qkv[:, layer.q_size : layer.q_size + layer.kv_size]
                .view(1, t, self.kv_heads, d)
                .transpose(1, 2)
            )
            v = qkv[:, layer.q_size + layer.kv_size :].view(1, t, self.kv_heads, d).transpose(1, 2)
            q, k = ops.rotary(q, k, cos, sin)
            attn, _ = slot_attention(layer.attn, q, k, v, None, scaling=layer.attn.scaling, ts_plan=plan)
            x, h = ops.add_rms_norm(x, _linear(attn.reshape(t, layer.q_size), layer.o), layer.norm_post, eps)
            mlp = _linear(ops.silu_and_mul(_linear(h, layer.gate_up)), layer.down)
            following = self.layers[i + 1].norm_in if i + 1 < len(self.layers) else self.norm
            x, h = ops.add_rms_norm(x, mlp, following, eps)
        return h
