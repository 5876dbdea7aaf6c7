"""Penalties, logit bias and reported log probabilities (gpu_workers/logits.py): the arithmetic on crafted
logits, then the engine on SmolLM2 against a reference computed from the model's own forward pass."""

from __future__ import annotations

import math

import pytest
import torch

from gpu_workers.engine import Engine, Sequence
from gpu_workers.kv_cache import KVBudget
from gpu_workers.logits import Logprobs, TokenTexts, shape
from gpu_workers.model_loader import load
from gpu_workers.sampling import sample


@pytest.fixture(scope="module")
def smol():
    return load("smollm2", dtype="float32")


def row(**kw) -> Sequence:
    return Sequence("r", [1, 2], temperature=0, **kw)


def test_penalties_count_the_answer_not_the_prompt():
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.9, 0.0]])
    seq = row(presence_penalty=0.25, frequency_penalty=0.5, generated=[2, 2, 3])
    seq.prompt_ids = [1, 1, 1, 1]  # the prompt's tokens are never penalised
    shape(logits, [seq])
    assert logits[0].tolist() == pytest.approx([0.0, 1.0, 3.0 - 0.25 - 1.0, 2.9 - 0.25 - 0.5, 0.0])
    assert sample(logits, [(0.0, 1.0, 0, 0)]) == [3]  # token 2 was the argmax before


def test_logit_bias_steers_only_its_row_and_ignores_ids_beyond_the_vocabulary():
    logits = torch.zeros(2, 4)
    shape(logits, [row(logit_bias={1: 100.0, 3: -100.0, 99: 5.0}), row()])
    assert logits.tolist() == [[0.0, 100.0, 0.0, -100.0], [0.0, 0.0, 0.0, 0.0]]


def test_reported_logprobs_are_the_models_before_shaping():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    asked, silent = row(logprobs=2, logit_bias={0: 50.0}), row()
    reported = Logprobs(logits, [asked, silent])
    shape(logits, [asked, silent])
    expected = torch.log_softmax(torch.tensor([1.0, 2.0, 3.0]), -1).tolist()
    token, logprob, top = reported.of(0, 0)
    assert token == 0 and logprob == pytest.approx(expected[0])
    assert [t for t, _ in top] == [2, 1] and [lp for _, lp in top] == pytest.approx(
        [expected[2], expected[1]]
    )
    assert reported.of(1, 0) is None  # a row that asked for nothing


def test_engine_reports_each_streamed_token_and_honours_bias_and_penalties(smol):
    tok = smol.tokenizer
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Write a short poem about the sea."}],
        add_generation_prompt=True,
        tokenize=True,
    )
    prompt = list(prompt if isinstance(prompt, list) else prompt["input_ids"])

    def run(**kw) -> tuple[Sequence, list]:
        seq = Sequence("s", prompt, max_tokens=12, temperature=0, **kw)
        eng = Engine(smol.model, tok, KVBudget.for_model(smol.model, 64, 16, 1.0))
        outputs = eng.generate([seq])["s"]
        return seq, [r for o in outputs for r in o.logprobs]

    plain, _ = run()
    seq, reported = run(logprobs=4)
    assert seq.generated == plain.generated  # asking for a report changes nothing
    assert [r[0] for r in reported] == seq.generated[: len(reported)] and len(reported) >= len(
        seq.generated
    ) - 1
    with torch.no_grad():  # the reference: the model's own next-token distribution at each position
        logits = smol.model(torch.tensor([prompt + seq.generated])).logits[0, len(prompt) - 1 : -1].float()
    for i, (token, logprob, top) in enumerate(reported):
        ref = torch.log_softmax(logits[i], -1)
        assert logprob == pytest.approx(float(ref[token]), abs=1e-3)
        assert top[0][0] == token and len(top) == 4  # greedy: the most likely token
        assert [t for t, _ in top] == torch.topk(ref, 4).indices.tolist()
    assert all(not math.isnan(lp) for _, lp, _ in reported)

    [wave] = tok.encode(" wave", add_special_tokens=False)
    biased, _ = run(logit_bias={wave: 100.0})
    assert biased.generated == [wave] * 12
    penalised, _ = run(presence_penalty=2.0, frequency_penalty=2.0)
    assert penalised.generated != plain.generated
    assert max(penalised.generated.count(t) for t in penalised.generated) <= max(
        plain.generated.count(t) for t in plain.generated
    )


def test_token_texts_give_a_split_characters_own_bytes(smol):
    texts = TokenTexts(smol.tokenizer)
    [wave] = smol.tokenizer.encode(" wave", add_special_tokens=False)
    assert texts(wave) == (" wave", list(b" wave"))
    for token in smol.tokenizer.encode("海", add_special_tokens=False):  # one character, maybe several tokens
        text, raw = texts(token)
        assert raw and (text == "海" or "\ufffd" in text)
    joined = b"".join(bytes(texts(t)[1]) for t in smol.tokenizer.encode("海 wave", add_special_tokens=False))
    assert joined.decode() == "海 wave"
