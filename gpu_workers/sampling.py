"""Sampling for the whole batch on the model's device: greedy, temperature, top-p, per-request seed.

Greedy (temperature 0) is argmax, exactly what `generate(do_sample=False)` picks. A sampled
token is the Gumbel-max draw argmax(log p - log(-log u)) over the (nucleus-filtered)
distribution, where u for vocabulary entry v is a hash of (request seed, token index, v)
computed with integer arithmetic on the device: the same seed gives the same output whatever
else shares the batch, and a worker that takes a request over mid-stream draws the very numbers
the first worker would have drawn. No per-row host loop, no copy of the probabilities to the host.
"""

from __future__ import annotations

import random

import torch

_MASK = (1 << 63) - 1
_M1 = 0x9E3779B97F4A7C15 - (1 << 64)  # constants as signed int64 (torch wraps on overflow)
_M2 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M3 = 0x94D049BB133111EB - (1 << 64)


def token_seed(seed: int, index: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 1) & _MASK


def new_seed() -> int:
    return random.getrandbits(62)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def hashed_uniform(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N] int64 seeds -> [N, vocab] float64 uniforms in (0, 1): splitmix64 of (seed, v)."""
    v = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    x = seeds.unsqueeze(1) + (v + 1) * _M1
    x = (x ^ _shr(x, 30)) * _M2
    x = (x ^ _shr(x, 27)) * _M3
    x = x ^ _shr(x, 31)
    return (_shr(x, 11).to(torch.float64) + 0.5) / float(1 << 53)


def sample(logits: torch.Tensor, params: list[tuple[float, float, int, int]]) -> list[int]:
    """logits [N, V]; params per row: (temperature, top_p, seed, token_index). Returns N token ids."""
    logits = logits.float()
    out = logits.argmax(-1)
    rows = [i for i, p in enumerate(params) if p[0] > 0]
    if not rows:
        return out.tolist()
    dev = logits.device
    idx = torch.tensor(rows, device=dev)
    temps = torch.tensor([params[i][0] for i in rows], device=dev).unsqueeze(-1)
    logp = torch.log_softmax(logits[idx] / temps, dim=-1)
    top_p = torch.tensor([params[i][1] for i in rows], device=dev).unsqueeze(-1)
    if bool((top_p < 1.0).any()):
        # nucleus: keep a token while the mass of the more likely tokens before it is below top_p
        sorted_logp, order = torch.sort(logp, dim=-1, descending=True)
        probs = sorted_logp.exp()
        before = probs.cumsum(-1) - probs
        drop_sorted = (before >= top_p) & (top_p < 1.0)
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logp = logp.masked_fill(drop, float("-inf"))
    seeds = torch.tensor(
        [token_seed(params[i][2], params[i][3]) for i in rows], dtype=torch.int64, device=dev
    )
    gumbel = -torch.log(-torch.log(hashed_uniform(seeds, logits.shape[-1])))
    picked = (logp.double() + gumbel).argmax(-1)
    out[idx] = picked
    return out.tolist()
