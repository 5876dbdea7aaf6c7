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


def test_a_vllm_defaults_column_far_below_vllm_offline_is_invalid_and_forms_no_ratio():
    from bench.engine_checks import PLAUSIBLE, check_peers, usable

    sat = {
        "tokenstream": run(87.5, 9.0),
        "vllm-defaults": run(13.9, 84.3),  # the column of issue 51: four times slower than vLLM itself
        "vllm-offline": run(60.4, None),
    }
    invalid = check_peers(sat)
    assert set(invalid) == {"vllm-defaults"} and "vllm-offline" in invalid["vllm-defaults"]
    assert sat["vllm-defaults"]["invalid"] == invalid["vllm-defaults"]
    assert sat["vllm-defaults"]["tokens_per_s"] == 13.9  # its figures stay, marked
    assert usable(sat, "vllm-defaults") is None and usable(sat, "tokenstream") == 87.5
    assert PLAUSIBLE == 0.85


def test_a_vllm_defaults_column_within_the_bound_is_checked_and_usable():
    from bench.engine_checks import check_peers, usable

    sat = {"vllm-defaults": run(52.0, 3.0), "vllm-offline": run(60.0, None)}  # 0.87x
    assert check_peers(sat) == {}
    assert sat["vllm-defaults"]["checked_against"].startswith("vllm-offline: 0.87x")
    assert usable(sat, "vllm-defaults") == 52.0
    alone = {"vllm-defaults": run(52.0, 3.0), "vllm-offline": {"skipped": "exit 1"}}
    assert check_peers(alone) == {} and "unchecked" in alone["vllm-defaults"]["checked_against"]
    assert usable({"x": {"skipped": "exit 1"}}, "x") is None


async def test_the_readiness_wait_says_what_it_waits_for_and_ends_at_ready_or_at_the_starts_error():
    import asyncio

    import pytest

    from gpu_workers.startup import waited

    said: list[str] = []
    ready = asyncio.Event()

    async def start() -> None:  # a start that takes a while, then serves on
        await asyncio.sleep(0.05)
        ready.set()
        await asyncio.sleep(3600)

    task = asyncio.ensure_future(start())
    assert await waited(task, "the worker to be ready", said.append, 0.01, ready) is None
    assert ready.is_set() and not task.done()  # the wait ends at ready; the worker goes on serving
    assert said and all(m.startswith("worker: waiting for the worker to be ready: ") for m in said)
    task.cancel()

    async def failing() -> None:
        await asyncio.sleep(0.03)
        raise RuntimeError("vLLM could not start")

    with pytest.raises(RuntimeError, match="vLLM could not start"):  # no time limit, the start's own error
        await waited(failing(), "vLLM's engine to start", said.append, 0.01, asyncio.Event())
    assert await waited(
        asyncio.sleep(0.02, result="engine"), "vLLM's engine to start", said.append, 0.01
    ) == ("engine")
