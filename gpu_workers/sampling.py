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


def nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest set of most likely tokens whose mass reaches top_p: (probs descending, token ids).

    A token is kept while the mass before it is below top_p. Looks in the top 64, then the top
    1024, before sorting the whole vocabulary (real models almost never need the full sort).
    """
    vocab = probs.shape[-1]
    for k in (64, 1024, vocab):
        k = min(k, vocab)
        vals, ids = torch.topk(probs, k) if k < vocab else torch.sort(probs, descending=True)
        before = vals.cumsum(-1) - vals
        if k == vocab or before[-1] >= top_p or vals.sum() >= top_p:
            keep = int((before < top_p).sum())
            return vals[:max(keep, 1)], ids[:max(keep, 1)]
    raise AssertionError("unreachable")


def sample(logits: torch.Tensor, params: list[tuple[float, float, int, int]]) -> list[int]:
    """logits [N, V]; params per row: (temperature, top_p, seed, token_index). Returns N token ids.

    A sampled row draws one uniform number u from its own generator and takes the token where
    the cumulative distribution (of the nucleus, when top_p < 1) passes u.
    """
    logits = logits.float()
    out: list[int] = logits.argmax(-1).tolist()
    rows = [i for i, p in enumerate(params) if p[0] > 0]
    if not rows:
        return out
    temps = torch.tensor([params[i][0] for i in rows], device=logits.device).unsqueeze(-1)
    probs = torch.softmax(logits[rows] / temps, dim=-1).cpu()
    gen = torch.Generator(device="cpu")
    for j, i in enumerate(rows):
        _, top_p, seed, index = params[i]
        gen.manual_seed(token_seed(seed, index))
        u = float(torch.rand((), generator=gen))
        if top_p < 1.0:
            vals, ids = nucleus(probs[j], top_p)
        else:
            vals, ids = probs[j], None
        cdf = vals.cumsum(-1)
        k = min(int(torch.searchsorted(cdf, u * float(cdf[-1]))), len(cdf) - 1)
        out[i] = int(ids[k]) if ids is not None else k
    return out
