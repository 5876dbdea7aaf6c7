"""`tokenstream bench engine`'s bookkeeping: which of an engine's repeated runs it reports."""

from __future__ import annotations

from bench.engine import median_run


def run(tokens_per_s: float, ttft: float) -> dict:
    return {"tokens_per_s": tokens_per_s, "ttft_p50_s": ttft}


def test_the_run_of_median_throughput_is_reported_whole_with_every_runs_figure():
    runs = [run(150.0, 3.1), run(190.0, 2.9), run(142.0, 3.8)]
    chosen = median_run(runs)
    assert chosen["tokens_per_s"] == 150.0 and chosen["ttft_p50_s"] == 3.1  # one run's figures, not a mix
    assert chosen["runs_tokens_per_s"] == [150.0, 190.0, 142.0]  # in the order run
    assert "runs_tokens_per_s" not in runs[0]  # the runs themselves are left as they were


def test_of_an_even_number_of_runs_the_lower_middle_one_is_reported():
    assert median_run([run(100.0, 1), run(120.0, 1), run(110.0, 1), run(130.0, 1)])["tokens_per_s"] == 110.0


def test_a_single_run_is_reported_as_it_is():
    assert median_run([run(99.0, 2.0)]) == run(99.0, 2.0)


def test_the_workers_streamed_tokens_are_compared_with_the_reference_up_to_eos_and_max_tokens():
    from bench.engine import summarise

    eos = {2}
    reqs = [{"rid": "a", "max_tokens": 3}, {"rid": "b", "max_tokens": 4}, {"rid": "c", "max_tokens": 4}]
    got = {
        "aggregate": {"tokens": 9, "ttft": [0.1, 0.2, 0.3], "itl": [0.01]},
        "wall_s": 1.0,
        "outputs": {"a": [5, 6, 7], "b": [8, 9], "c": [1, 1, 1, 1]},
    }
    reference = {
        "a": [5, 6, 7, 9],  # the same up to max_tokens
        "b": [8, 9, 2, 4],  # the same up to EOS
        "c": [1, 1, 1, 3],
    }  # differs
    assert summarise(got, reqs, eos, reference)["greedy_agreement"] == "2/3"
    del got["outputs"]["a"]  # a request whose tokens never arrived does not agree
    assert summarise(got, reqs, eos, reference)["greedy_agreement"] == "1/3"
    assert summarise(got, reqs, eos, None)["greedy_agreement"] is None
