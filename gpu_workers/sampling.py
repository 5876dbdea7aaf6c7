"""Per-request sampling from the last-position logits: greedy, temperature, top-p, seed.

Greedy (temperature 0) is argmax, exactly what `generate(do_sample=False)` picks. A sampled
token draws from a torch.Generator seeded by (request seed, token index): the same seed gives
the same output whatever else shares the batch, and a worker that takes a request over
mid-stream draws the very numbers the first worker would have drawn.
"""

from __future__ import annotations

import random

import torch

_MASK = (1 << 63) - 1


def token_seed(seed: int, index: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 1) & _MASK


def new_seed() -> int:
    return random.getrandbits(62)


def filter_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (always the top one)."""
    if top_p >= 1.0:
        return probs
    sorted_p, order = torch.sort(probs, descending=True)
    cum = sorted_p.cumsum(-1)
    drop = cum - sorted_p >= top_p  # mass before this token already reaches top_p
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    out = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return out / out.sum(-1, keepdim=True)


def sample(logits: torch.Tensor, params: list[tuple[float, float, int, int]]) -> list[int]:
    """logits [N, V]; params per row: (temperature, top_p, seed, token_index). Returns N token ids."""
    logits = logits.float()
    greedy = logits.argmax(-1).tolist()
    out: list[int] = []
    gen = torch.Generator(device="cpu")
    cpu_logits = None
    for row, (temperature, top_p, seed, index) in enumerate(params):
        if temperature <= 0:
            out.append(greedy[row])
            continue
        if cpu_logits is None:
            cpu_logits = logits.cpu()
        probs = torch.softmax(cpu_logits[row] / temperature, dim=-1)
        probs = filter_top_p(probs, top_p)
        gen.manual_seed(token_seed(seed, index))
        out.append(int(torch.multinomial(probs, 1, generator=gen)))
    return out
