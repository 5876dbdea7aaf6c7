"""Batched seeded sampling and prefix KV reuse, against the real model code (the incremental detokenizer:
tests/test_detokenizer.py)."""

from __future__ import annotations

import pytest
import torch

from gpu_workers.engine import Engine, Sequence
from gpu_workers.kv_cache import KVBudget
from gpu_workers.model_loader import load
from gpu_workers.prefix_cache import PrefixCache, page_hashes
from gpu_workers.random_model import build
from gpu_workers.sampling import sample


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load("tiny", build(tmp_path_factory.mktemp("tiny-model")), dtype="float32")


@pytest.fixture(scope="module")
def smol():
    return load("smollm2", dtype="float32")


def engine(loaded, blocks=256, **kw) -> Engine:
    return Engine(loaded.model, loaded.tokenizer, KVBudget.for_model(loaded.model, blocks, 16, 1.0), **kw)


def chat(tok, messages) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def test_batched_sampling_depends_only_on_seed_and_index():
    torch.manual_seed(0)
    logits = torch.randn(5, 1000)
    params = [(0.9, 0.95, 11, 3), (0.0, 1.0, 1, 0), (1.2, 1.0, 11, 3), (0.9, 0.95, 11, 4), (0.9, 0.95, 12, 3)]
    together = sample(logits, params)
    alone = [sample(logits[i : i + 1], [p])[0] for i, p in enumerate(params)]
    assert together == alone
    assert together[1] == int(logits[1].argmax())
    assert sample(logits[[4, 0]], [params[4], params[0]]) == [together[4], together[0]]
    # the draws follow the distribution: 4000 seeds over 4 tokens with p = .1 .2 .3 .4
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    rows = probs.log().expand(4000, 4)
    got = torch.tensor(sample(rows, [(1.0, 1.0, s, 0) for s in range(4000)]))
    freq = torch.bincount(got, minlength=4).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03), freq
    # top_p keeps the smallest set reaching the mass: 0.4 + 0.3 >= 0.6 -> only tokens 3 and 2
    nucleus = torch.tensor(sample(rows[:500], [(1.0, 0.6, s, 0) for s in range(500)]))
    assert set(nucleus.tolist()) == {2, 3}


def test_prefix_pages_chain_by_tenant_and_evict_lru(tiny):
    cache = KVBudget.for_model(tiny.model, 64, 4, 1.0)
    pc = PrefixCache(cache, num_pages=3)
    tokens = list(range(100, 120))
    assert page_hashes(tokens, "a", 4)[:2] == page_hashes(tokens[:9], "a", 4)[:2]
    assert page_hashes(tokens, "a", 4)[0] != page_hashes(tokens, "b", 4)[0]
    assert (
        page_hashes([1, 2, 3, 4, 5, 6, 7, 8], "a", 4)[1] != page_hashes([9, 2, 3, 4, 5, 6, 7, 8], "a", 4)[1]
    )
    kv = cache.storage(20)
    for layer in kv:
        layer.copy_(torch.randn_like(layer))
    pc.store(kv, tokens, "a", 12)  # 3 full pages
    assert len(pc.match(tokens, "a", 19)) == 3 and pc.match(tokens, "b", 19) == []
    assert len(pc.match(tokens, "a", 11)) == 2  # never more than asked for
    other = cache.storage(20)
    assert pc.load(other, pc.match(tokens, "a", 19)) == 12
    assert all(torch.equal(o[:, :, :12], k[:, :, :12]) for o, k in zip(other, kv))
    pc.store(kv, [7] * 8, "a", 8)  # 2 new pages: the 2 least recently used entries go
    assert len(pc.match(tokens, "a", 19)) == 0 and len(pc.match([7] * 8, "a", 8)) == 2


def test_turn_two_prefills_only_new_tokens_with_identical_greedy_output(tiny):
    tok = tiny.tokenizer
    turn1 = [{"role": "user", "content": "Tell me about rivers and the sea, and about the water cycle."}]

    def conversation(eng, tenant="t"):
        a = Sequence("a", chat(tok, turn1), max_tokens=20, temperature=0, tenant=tenant)
        eng.generate([a])
        msgs = turn1 + [
            {"role": "assistant", "content": a.emitted_text},
            {"role": "user", "content": "More."},
        ]
        b = Sequence("b", chat(tok, msgs), max_tokens=20, temperature=0, tenant=tenant)
        eng.generate([b])
        return a, b

    with_reuse = engine(tiny)
    a, b = conversation(with_reuse)
    a0, b0 = conversation(engine(tiny, prefix_cache=False))
    assert (a.generated, b.generated) == (a0.generated, b0.generated)
    assert a.cached_tokens == 0 and b0.cached_tokens == 0
    assert b.cached_tokens >= len(a.prompt_ids) // 16 * 16 and b.cached_tokens % 16 == 0
    assert b.cached_tokens < len(b.prompt_ids)
    # what each prefill wrote into the cache: its prompt's full pages not there before (none without one)
    assert a.cache_written == len(a.prompt_ids) // 16 * 16 and b0.cache_written == 0
    assert b.cache_written == len(b.prompt_ids) // 16 * 16 - b.cached_tokens
    # another tenant with the very same conversation shares nothing
    c = Sequence("c", b.prompt_ids, max_tokens=5, temperature=0, tenant="other")
    with_reuse.generate([c])
    assert c.cached_tokens == 0 and c.generated == b.generated[:5]
    assert c.cache_written == len(c.prompt_ids) // 16 * 16


@pytest.mark.slow
def test_multi_turn_greedy_identical_with_and_without_reuse_on_smollm2(smol):
    tok = smol.tokenizer
    outs = {}
    for reuse in (True, False):
        eng = engine(smol, prefix_cache=reuse)
        msgs, answers, cached = [], [], []
        for q in ["What is the capital of France?", "And of Italy?", "Which one is larger?"]:
            msgs.append({"role": "user", "content": q})
            s = Sequence(q, chat(tok, msgs), max_tokens=16, temperature=0)
            eng.generate([s])
            msgs.append({"role": "assistant", "content": s.emitted_text})
            answers.append(s.generated)
            cached.append(s.cached_tokens)
        outs[reuse] = (answers, cached)
    assert outs[True][0] == outs[False][0]
    assert outs[False][1] == [0, 0, 0] and outs[True][1][0] == 0 and outs[True][1][2] > outs[True][1][1] > 0


def test_requests_admitted_together_share_the_prefix_one_of_them_prefills(tiny):
    shared = [100 + (i * 37) % 5000 for i in range(200)]

    def batch(eng):
        seqs = [Sequence(f"r{i}", shared + [7 + i, 9], max_tokens=12, temperature=0) for i in range(3)]
        seqs.append(Sequence("other", [5 + (i * 11) % 4000 for i in range(60)], max_tokens=12, temperature=0))
        eng.generate(seqs)
        return seqs

    reuse, alone = (
        batch(engine(tiny, prefill_chunk=512)),
        batch(engine(tiny, prefill_chunk=512, prefix_cache=False)),
    )
    assert [s.generated for s in reuse] == [s.generated for s in alone]
    # the first prefills the 200 shared tokens; the other two wait one step and take its 12 full pages
    assert [s.cached_tokens for s in reuse] == [0, 192, 192, 0]
    assert all(s.cached_tokens == 0 for s in alone)
    assert (
        reuse[1].first_token_at > reuse[0].first_token_at
        and reuse[3].first_token_at == reuse[0].first_token_at
    )


def test_slots_keep_short_and_long_requests_apart_and_release_long_ones(tiny):
    from gpu_workers.kv_cache import SlotPool

    cache = KVBudget.for_model(tiny.model, 64, 16, 1.0)
    pool = SlotPool(cache, 4, 2048)
    short, long_ = pool.take(40), pool.take(SlotPool.LONG + 1)
    assert (short, long_) == (0, 3) and pool.take(10) == 1
    view = pool.view(long_)
    assert view[0].shape == (2, cache.kv_heads, 2048, cache.head_dim)
    view[0][:, :, :1500] = 1.0
    pool.give(long_, 1500)  # its memory goes back to the OS: the pages read as zeros again
    assert float(view[0][:, :, 100:1400].abs().sum()) == 0.0 and pool.free == 2


def test_the_pool_starts_zeroed_even_over_reused_memory(tiny):
    """Batched decode attention reads each slot range up to its longest row, so the padding of the
    shorter rows must be finite: NaN in it survives the mask (NaN + -inf is NaN) and turns a row's
    logits into NaN. Memory freed by earlier tensors is reused by the allocator and may hold NaN."""
    from gpu_workers.kv_cache import SlotPool

    cache = KVBudget.for_model(tiny.model, 64, 16, 1.0)
    for _ in range(3):  # leave NaN-filled blocks of the pool's size behind in the allocator
        poison = torch.full((4, 2, cache.kv_heads, 2048, cache.head_dim), float("nan"), dtype=cache.dtype)
        del poison
    pool = SlotPool(cache, 4, 2048)
    assert all(int(torch.count_nonzero(layer)) == 0 for layer in pool.layers)
