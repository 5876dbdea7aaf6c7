"""The engine's CPU kernels (gpu_workers/csrc/): built by the set-up; the decode kernel equal to SDPA over
each row's own keys; the fused Llama steps equal to transformers' own ops; the engine's greedy text the
same with them as without them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_workers.cpu_kernels import available, library
from gpu_workers.engine import Engine, Sequence
from gpu_workers.kv_cache import KVBudget
from gpu_workers.model_loader import load


def test_the_set_up_built_the_kernel_and_an_engine_on_the_cpu_uses_it():
    assert library().exists(), "make setup builds it (python -m gpu_workers.cpu_kernels)"
    assert available()


def reference(q, pool, slots, lengths, scale):
    """SDPA per row over its own first `length` keys, query heads grouped onto their kv head."""
    rows, heads, dim = q.shape
    kv_heads = pool.shape[2]
    out = []
    for r in range(rows):
        n, s = int(lengths[r]), int(slots[r])
        qr = q[r].view(kv_heads, heads // kv_heads, dim)
        out.append(
            F.scaled_dot_product_attention(qr, pool[s, 0, :, :n], pool[s, 1, :, :n], scale=scale).reshape(
                heads, dim
            )
        )
    return torch.stack(out)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 128), (8, 2, 48)])
def test_the_kernel_equals_sdpa_over_each_rows_own_keys(dtype, tol, heads, kv_heads, dim):
    assert available()
    g = torch.Generator().manual_seed(heads * dim)
    storage = torch.randn(12, 2, kv_heads, 80, dim + 16, generator=g).to(dtype)
    pool = storage[..., :dim]  # a strided view, as the slot pool's layers can be
    rows = 7
    slots = torch.randperm(12, generator=g)[:rows]
    lengths = torch.tensor([1, 2, 5, 31, 32, 33, 80])  # a first token, short rows, a full slot
    q = torch.randn(rows, heads, dim, generator=g).to(dtype)
    got = torch.ops.tokenstream.decode_attention(q, pool, slots, lengths, dim**-0.5)
    want = reference(q.float(), pool.float(), slots, lengths, dim**-0.5)
    assert got.dtype == dtype and got.shape == q.shape
    assert torch.allclose(got.float(), want, atol=tol, rtol=tol)
    # keys past a row's length do not count: changing them changes nothing
    storage[..., 40:, :] += 100
    again = torch.ops.tokenstream.decode_attention(q, pool, slots, lengths.clamp(max=40), dim**-0.5)
    short = reference(q.float(), pool.float(), slots, lengths.clamp(max=40), dim**-0.5)
    assert torch.allclose(again.float(), short, atol=tol, rtol=tol)


def test_the_kernel_refuses_a_slot_or_length_outside_the_pool():
    assert available()
    pool = torch.zeros(4, 2, 1, 16, 8)
    q = torch.zeros(1, 2, 8)
    with pytest.raises(RuntimeError, match="slot out of range"):
        torch.ops.tokenstream.decode_attention(q, pool, torch.tensor([4]), torch.tensor([3]), 1.0)
    with pytest.raises(RuntimeError, match="length out of range"):
        torch.ops.tokenstream.decode_attention(q, pool, torch.tensor([0]), torch.tensor([17]), 1.0)
    with pytest.raises(RuntimeError, match="length out of range"):
        torch.ops.tokenstream.decode_attention(q, pool, torch.tensor([0]), torch.tensor([0]), 1.0)


def test_the_fused_llama_steps_equal_transformers_own_ops():
    """bf16: bit for bit (they round where transformers rounds); fp32: within float rounding."""
    from transformers.models.llama import modeling_llama as llama

    assert available()
    g = torch.Generator().manual_seed(1)
    for dtype, tol in ((torch.bfloat16, 0.0), (torch.float32, 1e-5)):

        def rnd(*shape, dtype=dtype):
            return torch.randn(*shape, generator=g).to(dtype)

        norm = llama.LlamaRMSNorm(96, eps=1e-5).to(dtype)
        norm.weight.data = rnd(96)
        x, residual = rnd(2, 7, 96), rnd(2, 7, 96)
        assert torch.allclose(
            torch.ops.tokenstream.rms_norm(x, norm.weight, 1e-5), norm(x), atol=tol, rtol=tol
        )
        total, normed = torch.ops.tokenstream.add_rms_norm(x, residual, norm.weight, 1e-5)
        assert torch.equal(total, x + residual)
        assert torch.allclose(normed, norm(x + residual), atol=tol, rtol=tol)
        gate_up = rnd(5, 400)
        assert torch.allclose(
            torch.ops.tokenstream.silu_and_mul(gate_up),
            F.silu(gate_up[:, :200]) * gate_up[:, 200:],
            atol=tol,
            rtol=tol,
        )
        q = rnd(1, 11, 6, 32).transpose(1, 2)  # [B, H, T, D] as the attention's projection view gives it
        k = rnd(1, 11, 2, 32).transpose(1, 2)
        cos, sin = rnd(1, 11, 32), rnd(1, 11, 32)
        fq, fk = torch.ops.tokenstream.rotary(q, k, cos, sin)
        wq, wk = llama.apply_rotary_pos_emb(q, k, cos, sin)
        assert fq.shape == q.shape and fk.shape == k.shape
        assert torch.allclose(fq, wq, atol=tol, rtol=tol) and torch.allclose(fk, wk, atol=tol, rtol=tol)


def test_the_engines_llama_forward_equals_transformers_and_leaves_the_model_alone():
    """LlamaStep's hidden states for a packed step equal transformers' forward of the same tokens, and
    the model object stays transformers' own for every other caller."""
    import tempfile

    from gpu_workers.attention import Chunk, StepPlan
    from gpu_workers.kv_cache import SlotPool
    from gpu_workers.llama_step import LlamaStep, supports
    from gpu_workers.random_model import build

    with tempfile.TemporaryDirectory() as d:
        loaded = load("tiny", build(d), dtype="float32")
    model = loaded.model
    tokens = torch.tensor([[5, 9, 13, 21, 34, 55, 89]])
    with torch.inference_mode():
        want = model.get_decoder()(input_ids=tokens).last_hidden_state[0]
    assert supports(model)
    cache = KVBudget.for_model(model, 64, 16, 1.0)
    Engine(model, loaded.tokenizer, cache)  # registers the engine's attention with transformers
    pool = SlotPool(cache, 2, 64)
    slot = pool.take(64)
    n = tokens.shape[1]
    plan = StepPlan.build(pool.layers, [], [Chunk(slot, 0, n, 0, None)], [slot] * n, list(range(n)), "cpu")
    got = LlamaStep(model)(tokens[0], plan.positions, plan)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
    with torch.inference_mode():
        assert torch.equal(model.get_decoder()(input_ids=tokens).last_hidden_state[0], want)


def test_smollm2_greedy_is_the_same_with_the_cpu_kernels_as_without():
    """Eight chat prompts of different lengths decoded together, fp32: the kernel serves every decoding
    row, the engine's Llama forward every layer, and the text is token for token what transformers' forward
    and SDPA write."""
    loaded = load("smollm2", dtype="float32")
    tok = loaded.tokenizer
    questions = [
        "What is the capital of France?",
        "Name three colours.",
        "Count from one to five.",
        "Why is the sky blue? Answer in one sentence.",
        "Write a haiku about the sea.",
        "What is 12 times 12?",
        "Say hello in Spanish.",
        "Give me a word that rhymes with cat.",
    ]
    prompts = [
        list(
            tok.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
        for q in questions
    ]

    def run(kernel: bool) -> tuple[list[list[int]], Engine]:
        cache = KVBudget.for_model(loaded.model, 256, 16, 1.0)
        eng = Engine(
            loaded.model, tok, cache, max_running=8, prefill_chunk=64, cpu_kernels=kernel, prefix_cache=False
        )
        seqs = [Sequence(f"r{i}", p, max_tokens=24, temperature=0) for i, p in enumerate(prompts)]
        eng.generate(seqs)
        return [s.generated for s in seqs], eng

    with_kernel, eng = run(True)
    assert eng.decode_kernel and eng.llama_step is not None
    without, plain = run(False)
    assert not plain.decode_kernel and plain.llama_step is None
    assert with_kernel == without
    assert all(len(g) >= 4 for g in with_kernel)


def test_the_cpu_kernels_option_defaults_on_and_the_vllm_backend_refuses_turning_it_off():
    from gpu_workers.config import WorkerConfig
    from gpu_workers.metrics import WorkerMetrics
    from gpu_workers.startup import _vllm_engine

    assert WorkerConfig().cpu_kernels
    with pytest.raises(SystemExit, match="--no-cpu-kernels"):
        _vllm_engine(WorkerConfig(backend="vllm", cpu_kernels=False), WorkerMetrics("smollm2-kernels-test"))
