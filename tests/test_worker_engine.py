"""The batching engine in-process against real model code: a tiny random Llama where the text does
not matter, SmolLM2 where it does (greedy equality, stop strings, quantized loading)."""

from __future__ import annotations

import pytest
import torch

from gpu_workers.engine import Engine, Sequence
from gpu_workers.kv_cache import KVBudget
from gpu_workers.model_loader import load
from gpu_workers.random_model import build
from gpu_workers.stops import StopMatcher


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    return load("tiny", build(tmp_path_factory.mktemp("tiny-model")), dtype="float32")


@pytest.fixture(scope="session")
def smol():
    return load("smollm2", dtype="float32")


def engine(loaded, blocks=256, block_size=16, **kw) -> Engine:
    cache = KVBudget.for_model(loaded.model, blocks, block_size, 1.0)
    return Engine(loaded.model, loaded.tokenizer, cache, **kw)


def chat(tok, text: str) -> list[int]:
    ids = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def ids(n: int, start: int = 100) -> list[int]:
    return [start + (i * 37) % 5000 for i in range(n)]


def greedy(rid: str, prompt: list[int], n: int, **kw) -> Sequence:
    return Sequence(rid, prompt, max_tokens=n, temperature=0, **kw)


def run_alone(loaded, seq: Sequence) -> list[int]:
    eng = engine(loaded)
    eng.generate([seq])
    return seq.generated


def test_request_joins_running_batch_at_next_step(tiny):
    eng = engine(tiny, max_running=8)
    a = greedy("a", ids(20), 30)
    eng.add(a)
    for _ in range(5):
        eng.step()
    assert len(a.generated) == 5 and eng.running == [a]
    b = greedy("b", ids(12, 7), 10)
    eng.add(b)
    eng.step()  # b is prefilled and samples its first token in the same step a decodes
    assert len(b.generated) == 1 and len(a.generated) == 6 and eng.running == [a, b]
    while eng.has_work:
        eng.step()
    # joining mid-batch changes nothing in either output
    assert a.generated == run_alone(tiny, greedy("a2", ids(20), 30))
    assert b.generated == run_alone(tiny, greedy("b2", ids(12, 7), 10))


def test_early_finish_frees_its_pages_and_slot_at_once(tiny):
    eng = engine(tiny, blocks=64, block_size=4, max_running=2)
    short, long_, third = (
        greedy("short", ids(10), 2),
        greedy("long", ids(10), 40),
        greedy("third", ids(10), 5),
    )
    for s in (short, long_, third):
        eng.add(s)
    eng.step()
    assert [s.request_id for s in eng.running] == ["short", "long"] and list(eng.waiting) == [third]
    used_before = eng.cache.allocator.used
    out = eng.step()
    assert short.finish_reason == "length" and any(o.finish_reason == "length" for o in out)
    assert short.blocks == [] and eng.cache.allocator.used < used_before + 1
    eng.step()  # the freed slot goes to the waiting request at the next step
    assert [s.request_id for s in eng.running] == ["long", "third"]
    while eng.has_work:
        eng.step()
    assert eng.cache.allocator.used == 0 and eng.reserved_blocks == 0


def test_cancel_frees_slot_within_one_step(tiny):
    eng = engine(tiny)
    a, b = greedy("a", ids(8), 100), greedy("b", ids(8, 3), 100)
    eng.add(a)
    eng.add(b)
    for _ in range(3):
        eng.step()
    eng.cancel("a")
    out = eng.step()
    done = [o for o in out if o.finish_reason]
    assert [(o.seq.request_id, o.finish_reason) for o in done] == [("a", "cancelled")]
    assert done[0].completion_seq == a.next_seq - 1  # the completion follows the last chunk
    assert eng.running == [b] and a.blocks == []
    eng.cancel("not-yet-arrived")
    eng.step()
    late = greedy("not-yet-arrived", ids(5), 10)
    eng.add(late)
    out = eng.step()
    assert late.finish_reason == "cancelled" and late.generated == []


def test_kv_budget_bounds_admission(tiny):
    eng = engine(tiny, blocks=20, block_size=8, max_running=32)  # 160 tokens of KV in all
    seqs = [greedy(f"r{i}", ids(30, i), 20) for i in range(10)]  # each may need 50 tokens = 7 pages
    for s in seqs:
        eng.add(s)
    peak = 0
    while eng.has_work:
        eng.step()
        assert eng.reserved_blocks <= 20 and eng.cache.allocator.used <= eng.reserved_blocks
        peak = max(peak, len(eng.running))
    assert peak == 2 and all(s.finish_reason == "length" and len(s.generated) == 20 for s in seqs)


def test_long_prompt_is_prefilled_in_chunks_without_stalling_streams(tiny):
    eng = engine(tiny, blocks=512, prefill_chunk=64)
    running = greedy("running", ids(10), 60)
    eng.add(running)
    eng.step()
    long_prompt = greedy("long", ids(600), 5)
    eng.add(long_prompt)
    steps_to_first = 0
    while not long_prompt.generated:
        before = len(running.generated)
        eng.step()
        steps_to_first += 1
        assert len(running.generated) == before + 1  # a token every step while the long prompt prefills
    assert steps_to_first == 10  # 600 tokens in chunks of 64
    assert long_prompt.generated == run_alone(tiny, greedy("l2", ids(600), 5))[:1]


def test_same_seed_same_output(tiny):
    def sampled(seed, rid="s"):
        return Sequence(rid, ids(16), max_tokens=24, temperature=1.0, top_p=0.9, seed=seed)

    first = run_alone(tiny, sampled(1234))
    assert run_alone(tiny, sampled(1234, "again")) == first
    assert run_alone(tiny, sampled(4321)) != first


@pytest.mark.slow
def test_same_seed_same_output_in_a_different_batch_on_smollm2(smol):
    prompt = chat(smol.tokenizer, "Write a short poem about the sea.")

    def sampled(seed, rid):
        return Sequence(rid, prompt, max_tokens=20, temperature=0.8, top_p=0.9, seed=seed)

    alone = run_alone(smol, sampled(7, "alone"))
    eng = engine(smol)
    batched = sampled(7, "batched")
    eng.generate([greedy("other", chat(smol.tokenizer, "Name three rivers."), 20), batched, sampled(8, "x")])
    assert batched.generated == alone
    assert run_alone(smol, sampled(9, "nine")) != alone
    # the draw of token i depends only on (seed, i): a request resumed from its first 8 tokens
    # (a takeover) continues as the uninterrupted run did
    resumed = sampled(7, "resumed")
    resumed.generated = list(alone[:8])
    assert run_alone(smol, resumed) == alone


def test_tiny_top_p_is_greedy(tiny):
    s = Sequence("p", ids(16), max_tokens=16, temperature=1.5, top_p=1e-6, seed=5)
    assert run_alone(tiny, s) == run_alone(tiny, greedy("g", ids(16), 16))


def test_stop_matcher_holds_back_possible_stop_prefixes():
    m = StopMatcher(["###", "\nUser:"])
    assert m.safe_end("answer #") == 7 and m.safe_end("answer ##") == 7 and m.safe_end("answer") == 6
    assert m.safe_end("a\nUs") == 1 and m.find("ab ### c") == 3 and m.find("abc") is None
    assert m.safe_end("caf\ufffd") == 3


@pytest.mark.slow
def test_greedy_equals_generate_on_smollm2(smol):
    tok, model = smol.tokenizer, smol.model
    eng = engine(smol, max_running=8, prefill_chunk=9)
    prompts = ["What is the capital of France?", "Write a haiku about rivers.", "Count from one to ten:"]
    seqs, refs = [], {}
    for i, p in enumerate(prompts):
        prompt = chat(tok, p)
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[
            0, len(prompt) :
        ].tolist()
        refs[str(i)] = [t for t in ref if t != tok.eos_token_id]
        seqs.append(greedy(str(i), prompt, 24))
    eng.generate(seqs)
    for s in seqs:
        assert s.generated == refs[s.request_id]
        assert s.emitted_text == tok.decode(refs[s.request_id], skip_special_tokens=True)
    assert seqs[0].finish_reason == "stop" and "Paris" in seqs[0].emitted_text


@pytest.mark.slow
def test_stop_sequences_on_smollm2(smol):
    eng = engine(smol)
    free = greedy("free", chat(smol.tokenizer, "Count from one to ten:"), 24)
    stopped = greedy("stopped", chat(smol.tokenizer, "Count from one to ten:"), 24, stop=["3."])
    out = eng.generate([free, stopped])
    assert "3." in free.emitted_text
    assert stopped.finish_reason == "stop" and "3." not in stopped.emitted_text
    assert free.emitted_text.startswith(stopped.emitted_text)
    assert stopped.emitted_text == free.emitted_text[: free.emitted_text.index("3.")]
    chunks = [o for o in out["stopped"] if o.chunk_seq is not None]
    assert [o.chunk_seq for o in chunks] == list(range(len(chunks)))
    assert "".join(o.text for o in chunks) == stopped.emitted_text


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["8bit", "4bit"])
def test_bitsandbytes_quantized_loading_on_cpu(quantization, smol):
    q = load("smollm2", dtype="float32", quantization=quantization)
    assert type(q.model.get_decoder().layers[0].mlp.down_proj).__module__.startswith("bitsandbytes")
    assert q.model.get_memory_footprint() < 0.6 * smol.model.get_memory_footprint()
    s = greedy("q", chat(q.tokenizer, "What is the capital of France?"), 12)
    out = engine(q).generate([s])
    assert s.finish_reason in ("stop", "length") and len(s.generated) >= 3
    assert "".join(o.text for o in out["q"]) == s.emitted_text and s.emitted_text.strip()


def test_packed_linears_serve_the_engine_forward_only(tiny):
    import torch.nn.functional as F

    from gpu_workers.linears import engine_forward

    x = torch.tensor([ids(12)])
    with torch.inference_mode():
        before = tiny.model(x).logits
    eng = engine(
        tiny, cpu_kernels=False
    )  # transformers' forward, its layers packed (llama_step packs its own)
    if not eng.packed_linears:
        pytest.skip("this torch build has no oneDNN")
    assert eng.packed_linears == sum(type(m) is torch.nn.Linear for m in tiny.model.modules())
    lin = tiny.model.get_decoder().layers[0].mlp.down_proj
    h = torch.randn(5, lin.in_features)
    with torch.inference_mode():
        assert torch.equal(tiny.model(x).logits, before)  # other callers: torch's linear, original weights
        with engine_forward():
            inside = lin(h)
        assert torch.allclose(inside, F.linear(h, lin.weight), atol=1e-4)
        packed = lin._ts_packed
        lin._ts_packed = torch.ops.mkldnn._reorder_linear_weight(torch.zeros_like(lin.weight), 64)
        try:
            with engine_forward():
                assert not lin(h).any()  # inside the engine's forward the packed weights are what runs
            assert torch.equal(lin(h), F.linear(h, lin.weight))
        finally:
            lin._ts_packed = packed


def test_prompt_longer_than_context_ends_with_error(tiny):
    eng = engine(tiny, blocks=64, block_size=16, max_model_len=128)
    too_long, fine = greedy("long", ids(200), 5), greedy("fine", ids(100), 100)
    out = eng.generate([too_long, fine])
    assert [o.finish_reason for o in out["long"]] == ["error"] and "does not fit" in out["long"][0].error
    assert fine.finish_reason == "length" and len(fine.generated) == 28  # capped by the 128-token context


def test_cli_modules_are_import_light():
    import subprocess
    import sys

    code = "import sys, gpu_workers.cli, bench.worker; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


class _Bf16Keys(torch.nn.Module):
    """A key projection returning bf16 beside float32 parameters, as bitsandbytes' 8-bit layers do on
    a GPU (where the engine's KV pool, typed after the parameters, refused the first write)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x).to(torch.bfloat16)


def test_kv_pool_dtype_is_what_the_key_projection_returns(tiny):
    attn = tiny.model.get_decoder().layers[0].self_attn
    real = attn.k_proj
    assert KVBudget.model_shape(tiny.model)[3] == torch.float32
    attn.k_proj = _Bf16Keys(real)
    try:
        assert KVBudget.model_shape(tiny.model)[3] == torch.bfloat16
    finally:
        attn.k_proj = real


def test_a_one_token_prefill_chunk_is_attended_as_the_decode_it_is(tiny):
    """prefill_chunk 5: a's 4-token prompt leaves b a 1-token chunk in the same step. That row has a
    decode's shape and must sit among the decodes in slot order (it once sat after the chunks, so
    attention read another row's query for it, or indexed past its slot range)."""
    a, b, c = greedy("a", ids(4), 6), greedy("b", ids(10, start=300), 6), greedy("c", ids(3, start=900), 6)
    eng = engine(tiny, prefill_chunk=5)
    eng.generate([a, b])
    eng.generate([c])
    assert a.generated == run_alone(tiny, greedy("a", ids(4), 6))
    assert b.generated == run_alone(tiny, greedy("b", ids(10, start=300), 6))
    assert c.generated == run_alone(tiny, greedy("c", ids(3, start=900), 6))


def test_auto_dtype_is_bf16_where_the_cpu_computes_in_it_natively():
    import torch

    from gpu_workers.model_loader import resolve_dtype

    zen4 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n"
    sapphire = "flags\t\t: fpu avx2 avx512f amx_bf16 amx_tile amx_int8\n"
    avx2 = "flags\t\t: fpu sse2 avx avx2 fma\n"
    assert resolve_dtype("auto", "cpu", zen4) is torch.bfloat16
    assert resolve_dtype("auto", "cpu", sapphire) is torch.bfloat16
    assert resolve_dtype("auto", "cpu", avx2) is torch.float32  # bf16 emulated there: slower than fp32
    assert resolve_dtype("auto", "cpu", "") is torch.float32
    assert resolve_dtype("auto", "cuda", avx2) is torch.bfloat16
    assert resolve_dtype("float32", "cpu", zen4) is torch.float32
