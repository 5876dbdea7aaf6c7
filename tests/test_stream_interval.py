"""The stream interval (gpu_workers/streaming.py): a request's first text at once, its end flushed on
every finish path, otherwise one chunk once `stream_interval` tokens or `stream_interval_ms`
milliseconds are pending; chunk numbers gap-free; text, token ids and log probabilities put end to end
those of interval 1. Driven token by token through the shared TextStream with SmolLM2's tokenizer (the
clock set by the test), then through the own engine on a tiny random Llama."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from gpu_workers.detokenizer import Detokenizer
from gpu_workers.engine import Engine
from gpu_workers.kv_cache import KVBudget
from gpu_workers.metrics import WorkerMetrics
from gpu_workers.model_loader import load, smollm2_dir
from gpu_workers.random_model import build
from gpu_workers.sequence import Output, Sequence
from gpu_workers.streaming import TextStream

TEXT = (
    "Hello world! Ünïcödé and emoji 🎉🚀 split over tokens, a stop ## almost, then ### and more text "
    "after it, numbers 12345 and 日本語のテキスト too."
)


class Stream(TextStream):
    """The text side alone, as both backends use it (the engine's `_finish` without its KV bookkeeping)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = {tokenizer.eos_token_id}
        self.metrics = None

    def _finish(self, seq: Sequence, reason, outputs: list[Output], error=None) -> None:
        seq.finish_reason = reason
        if reason is not None:
            self._completion(seq, reason, outputs, error)


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(smollm2_dir())


def request(tok, interval: int = 1, ms: float = 0, **kw) -> Sequence:
    seq = Sequence("r", [1, 2, 3], stream_interval=interval, stream_interval_ms=ms, **kw)
    seq.detok = Detokenizer(tok)
    return seq


def feed(stream: Stream, seq: Sequence, tokens: list[int], times=None, per_step: int = 1) -> list[Output]:
    """`tokens` in steps of `per_step`, step i at `times[i]` seconds (10 ms apart by default), each with
    a log probability report of its own; stops at the request's end."""
    outputs: list[Output] = []
    for i in range(0, len(tokens), per_step):
        if seq.finish_reason is not None:
            break
        step = tokens[i : i + per_step]
        now = times[i // per_step] if times is not None else i // per_step * 0.01
        reports = [(t, -0.5 - j, []) for j, t in enumerate(step, i)]
        if per_step == 1:
            stream._append(seq, step[0], now, outputs, reports[0])
        else:
            stream._append_step(seq, step, now, outputs, reports)
    return outputs


def chunks(outputs: list[Output]) -> list[Output]:
    return [o for o in outputs if o.chunk_seq is not None]


def assert_gap_free(outputs: list[Output]) -> None:
    numbers = [o.chunk_seq for o in outputs if o.chunk_seq is not None]
    ends = [o.completion_seq for o in outputs if o.finish_reason is not None]
    assert numbers == list(range(len(numbers)))
    assert ends in ([], [len(numbers)])


def joined(outputs: list[Output]) -> tuple[str, list[int], list]:
    """Text, token ids and log probability reports of every output, end to end (the completion's too)."""
    return (
        "".join(o.text for o in outputs),
        [t for o in outputs for t in o.token_ids],
        [r for o in outputs for r in o.logprobs],
    )


def test_first_text_at_once_then_one_chunk_per_interval_and_the_end_flushed(tok):
    ids = tok.encode("The quick brown fox jumps over the lazy dog and runs far away.")
    seq = request(tok, interval=4, max_tokens=len(ids))
    out = feed(Stream(tok), seq, ids)
    got = chunks(out)
    assert got[0].chunk_seq == 0 and len(got[0].token_ids) == 1  # the first text at once
    assert [len(c.token_ids) for c in got[1:-1]] == [4] * (len(got) - 2)  # then every 4 tokens
    assert 1 <= len(got[-1].token_ids) <= 4 and out[-1].finish_reason == "length"  # the end at once
    assert_gap_free(out)
    assert joined(out)[0] == tok.decode(ids) and joined(out)[1] == ids


def test_tokens_further_apart_than_the_interval_go_out_one_by_one_and_faster_ones_together(tok):
    ids = tok.encode("one two three four five six seven eight nine ten eleven twelve")
    slow = request(tok, interval=32, ms=20, max_tokens=100)
    out = feed(Stream(tok), slow, ids, times=[i * 0.030 for i in range(len(ids))])  # 30 ms apart
    assert [len(c.token_ids) for c in chunks(out)] == [1] * len(ids)
    fast = request(tok, interval=32, ms=20, max_tokens=100)
    out = feed(Stream(tok), fast, ids, times=[i * 0.005 for i in range(len(ids))])  # 5 ms apart
    # the first at once, then one chunk each 20 ms: every 4th token
    assert [len(c.token_ids) for c in chunks(out)][:3] == [1, 4, 4]
    assert [c.chunk_seq for c in chunks(out)] == list(range(len(chunks(out))))
    capped = request(tok, interval=3, ms=20, max_tokens=100)
    out = feed(Stream(tok), capped, ids, times=[i * 0.001 for i in range(len(ids))])  # 1 ms apart
    assert [len(c.token_ids) for c in chunks(out)][:4] == [1, 3, 3, 3]  # the token cap first


def test_several_tokens_of_one_step_are_one_chunk_even_at_interval_1(tok):
    ids = tok.encode("A vLLM output may hold several tokens; they are written together, once.")
    seq = request(tok, interval=1, max_tokens=100)
    out = feed(Stream(tok), seq, ids, per_step=3)
    assert all(len(c.token_ids) == 3 for c in chunks(out)[:-1])
    assert joined(out)[0] == tok.decode(ids)


@pytest.mark.parametrize(
    "interval, ms, per_step, gap",
    [(4, 0, 1, 0.01), (1024, 20, 1, 0.004), (7, 15, 2, 0.006), (2, 0, 3, 0.01), (1024, 0, 1, 0.01)],
)
@pytest.mark.parametrize("end", ["length", "stop string", "held stop string", "eos", "cancel"])
def test_what_is_streamed_is_that_of_interval_1(tok, interval, ms, per_step, gap, end):
    ids = tok.encode(TEXT)
    # "2345": its first characters held back over three tokens, then the end writes nothing more
    stops = {"stop string": ["###"], "held stop string": ["2345"]}.get(end, [])
    cut = None
    if end == "eos":
        ids = ids[:30] + [tok.eos_token_id] + ids[30:]
    if end == "cancel":
        cut = 27  # tokens taken before the cancel

    def run(interval: int, ms: float) -> tuple[Sequence, list[Output]]:
        stream = Stream(tok)
        seq = request(tok, interval, ms, max_tokens=len(ids) - 5, stop=stops)
        taken = ids if cut is None else ids[:cut]
        times = [i * gap for i in range(len(taken))]
        out = feed(stream, seq, taken, times=times, per_step=per_step)
        if cut is not None:
            stream._finish(seq, "cancelled", out)
        return seq, out

    one, one_out = run(1, 0)
    seq, out = run(interval, ms)
    assert_gap_free(out)
    assert out[-1].finish_reason == one_out[-1].finish_reason
    assert joined(out) == joined(one_out)  # text, token ids, log probabilities
    assert seq.emitted_text == one.emitted_text and seq.generated == one.generated
    assert len(chunks(out)) <= len(chunks(one_out))
    if end == "stop string":
        assert "###" not in seq.emitted_text and seq.emitted_text.endswith("then ")
    if end == "held stop string":
        assert seq.emitted_text.endswith("numbers 1") and not seq.unsent_ids
    if end == "cancel":  # the pending text was written before the end
        assert one_out[-2].chunk_seq is not None and joined(chunks(out))[0] == one.emitted_text


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load("tiny", build(tmp_path_factory.mktemp("tiny-model")), dtype="float32")


def test_the_engine_streams_the_same_answers_in_fewer_chunks(tiny):
    prompts = [[100 + (i * 37 + k) % 5000 for i in range(12 + k)] for k in range(4)]

    def run(interval: int, ms: float) -> tuple[dict, WorkerMetrics]:
        metrics = WorkerMetrics(f"tiny-{interval}")
        cache = KVBudget.for_model(tiny.model, 256, 16, 1.0)
        eng = Engine(tiny.model, tiny.tokenizer, cache, metrics=metrics)
        seqs = [
            Sequence(
                f"r{k}",
                p,
                max_tokens=40,
                temperature=0,
                logprobs=2,
                stream_interval=interval,
                stream_interval_ms=ms,
            )
            for k, p in enumerate(prompts)
        ]
        return eng.generate(seqs), metrics

    one, _ = run(1, 0)
    got, metrics = run(5, 0)
    for rid, outputs in got.items():
        assert_gap_free(outputs)
        text, token_ids, reports = joined(outputs)
        assert (text, token_ids) == joined(one[rid])[:2]
        assert [r[:2] for r in reports] == [r[:2] for r in joined(one[rid])[2]]
        assert len(chunks(outputs)) < len(chunks(one[rid]))
        assert all(len(c.token_ids) == 5 for c in chunks(outputs)[1:-1])
    generated = sum(len(o.token_ids) for outputs in got.values() for o in outputs)
    counted = metrics.registry.get_sample_value("vllm:generation_tokens_total", {"model_name": "tiny-5"})
    assert counted >= generated  # counted once per step (EOS tokens are counted, never sent)
