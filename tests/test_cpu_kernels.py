"""The engine's CPU decode kernel (gpu_workers/csrc/decode_attention.cpp): built by the set-up, equal to
SDPA over each row's own keys, and the engine's greedy text the same with it as without it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_workers.cpu_kernels import decode_attention_available, library
from gpu_workers.engine import Engine, Sequence
from gpu_workers.kv_cache import PagedKVCache
from gpu_workers.model_loader import load


def test_the_set_up_built_the_kernel_and_an_engine_on_the_cpu_uses_it():
    assert library().exists(), "make setup builds it (python -m gpu_workers.cpu_kernels)"
    assert decode_attention_available()


def reference(q, pool, slots, lengths, scale):
    """SDPA per row over its own first `length` keys, query heads grouped onto their kv head."""
    rows, heads, dim = q.shape
    kv_heads = pool.shape[2]
    out = []
    for r in range(rows):
        n, s = int(lengths[r]), int(slots[r])
        qr = q[r].view(kv_heads, heads // kv_heads, dim)
        out.append(F.scaled_dot_product_attention(qr, pool[s, 0, :, :n], pool[s, 1, :, :n], scale=scale)
                   .reshape(heads, dim))
    return torch.stack(out)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 128), (8, 2, 48)])
def test_the_kernel_equals_sdpa_over_each_rows_own_keys(dtype, tol, heads, kv_heads, dim):
    assert decode_attention_available()
    g = torch.Generator().manual_seed(heads * dim)
    storage = torch.randn(12, 2, kv_heads, 80, dim + 16, generator=g).to(dtype)
    pool = storage[..., :dim]  # a strided view, as the slot pool's layers can be
    rows = 7
    slots = torch.randperm(12, generator=g)[:rows]
    lengths = torch.tensor([1, 2, 5, 31, 32, 33, 80])  # a first token, short rows, a full slot
    q = torch.randn(rows, heads, dim, generator=g).to(dtype)
    got = torch.ops.tokenstream.decode_attention(q, pool, slots, lengths, dim ** -0.5)
    want = reference(q.float(), pool.float(), slots, lengths, dim ** -0.5)
    assert got.dtype == dtype and got.shape == q.shape
    assert torch.allclose(got.float(), want, atol=tol, rtol=tol)
    # keys past a row's length do not count: changing them changes nothing
    storage[..., 40:, :] += 100
    again = torch.ops.tokenstream.decode_attention(q, pool, slots, lengths.clamp(max=40), dim ** -0.5)
    short = reference(q.float(), pool.float(), slots, lengths.clamp(max=40), dim ** -0.5)
    assert torch.allclose(again.float(), short, atol=tol, rtol=tol)


def test_the_kernel_refuses_a_slot_or_length_outside_the_pool():
    assert decode_attention_available()
    pool = torch.zeros(4, 2, 1, 16, 8)
    q = torch.zeros(1, 2, 8)
    with pytest.raises(RuntimeError, match="slot out of range"):
        torch.ops.tokenstream.decode_attention(q, pool, torch.tensor([4]), torch.tensor([3]), 1.0)
    with pytest.raises(RuntimeError, match="length out of range"):
        torch.ops.tokenstream.decode_attention(q, pool, torch.tensor([0]), torch.tensor([17]), 1.0)
    with pytest.raises(RuntimeError, match="length out of range"):
        torch.ops.tokenstream.decode_attention(q, pool, torch.tensor([0]), torch.tensor([0]), 1.0)


def test_smollm2_greedy_is_the_same_with_the_kernel_as_with_sdpa():
    """Eight chat prompts of different lengths decoded together, fp32: the kernel serves every decoding
    row and the text is token for token what the SDPA path writes."""
    loaded = load("smollm2", dtype="float32")
    tok = loaded.tokenizer
    questions = ["What is the capital of France?", "Name three colours.", "Count from one to five.",
                 "Why is the sky blue? Answer in one sentence.", "Write a haiku about the sea.",
                 "What is 12 times 12?", "Say hello in Spanish.", "Give me a word that rhymes with cat."]
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]) for q in questions]

    def run(kernel: bool) -> tuple[list[list[int]], Engine]:
        cache = PagedKVCache.for_model(loaded.model, 256, 16, 1.0)
        eng = Engine(loaded.model, tok, cache, max_running=8, prefill_chunk=64, decode_kernel=kernel,
                     prefix_cache=False)
        seqs = [Sequence(f"r{i}", p, max_tokens=24, temperature=0) for i, p in enumerate(prompts)]
        eng.generate(seqs)
        return [s.generated for s in seqs], eng

    with_kernel, eng = run(True)
    assert eng.decode_kernel
    without, plain = run(False)
    assert not plain.decode_kernel
    assert with_kernel == without
    assert all(len(g) >= 4 for g in with_kernel)
