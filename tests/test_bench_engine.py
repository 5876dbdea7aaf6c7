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
