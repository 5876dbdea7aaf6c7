"""vLLM's runner for `tokenstream bench engine`; runs in vLLM's own virtualenv (stdlib + vllm only).

    <vllm venv>/bin/python bench/engine_vllm.py IN OUT

Same protocol as `bench/engine_runners.py`: requests submitted at their arrival offsets to an
`AsyncLLM` (its engine core in a child process: the peak RSS reported is this process's VmHWM plus
its descendants', read before they end), prompts given as
token ids, greedy, streamed as deltas; the time of every token is recorded. With `offline` in the
spec: vLLM's own offline API instead, `LLM.generate` on every request at once in its multiprocess
engine core (vLLM measuring itself: the check of the `vllm-defaults` column; no per-token times).

Every mode warms up outside the timed window on the workload's own shapes (every request, 4 tokens
each: the prefill batches and decode batches the run will step), then empties the prefix cache.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

WARM_TOKENS = 4


def peak_rss_mib(pid: str = "self") -> float:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    for line in text.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def children_peak_rss_mib() -> float:
    """The peaks of this process's descendants (vLLM's engine core and its worker), read before they end."""
    import psutil

    return sum(peak_rss_mib(str(c.pid)) for c in psutil.Process().children(recursive=True))


async def serve(spec: dict) -> dict:
    import torch
    import vllm
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    if spec.get("defaults"):  # vLLM as its users run it: nothing but the model (and no periodic stats log)
        args = AsyncEngineArgs(model=spec["model_dir"], disable_log_stats=True)
    else:  # the same batch limits as every engine: rows per step and tokens per step
        args = AsyncEngineArgs(
            model=spec["model_dir"],
            dtype="float32",
            max_num_seqs=spec["max_running"],
            max_num_batched_tokens=spec["prefill_chunk"],
            max_model_len=2048,
            enable_prefix_caching=spec.get("prefix_cache", True),
            disable_log_stats=True,
            seed=0,
        )
    llm = AsyncLLM.from_engine_args(args)
    reqs = sorted(spec["requests"], key=lambda r: r["arrival"])
    times: dict[str, list[float]] = {r["rid"]: [] for r in reqs}
    tokens: dict[str, list[int]] = {r["rid"]: [] for r in reqs}

    submitted: dict[str, float] = {}

    async def one(r: dict, t0: float, tag: str = "") -> None:
        wait = r["arrival"] - (time.perf_counter() - t0)
        if wait > 0 and not spec.get("sequential"):
            await asyncio.sleep(wait)
        if not tag:
            submitted[r["rid"]] = time.perf_counter() - t0
        params = SamplingParams(
            temperature=0, max_tokens=r["max_tokens"], output_kind=RequestOutputKind.DELTA
        )
        async for out in llm.generate(TokensPrompt(prompt_token_ids=r["prompt_ids"]), params, r["rid"] + tag):
            if tag:
                continue
            new = list(out.outputs[0].token_ids)
            stamp = time.perf_counter() - t0
            tokens[r["rid"]] += new
            times[r["rid"]] += [stamp] * len(new)

    warm = [dict(r, arrival=0.0, max_tokens=WARM_TOKENS) for r in reqs]
    await asyncio.gather(*(one(r, time.perf_counter(), tag="-warm") for r in warm))
    if llm.vllm_config.cache_config.enable_prefix_caching:
        await llm.reset_prefix_cache()
    t0 = time.perf_counter()
    if spec.get("sequential"):  # one stream: each request alone, the next when it has finished
        for r in reqs:
            await one(r, t0)
    else:
        await asyncio.gather(*(one(r, t0) for r in reqs))
    wall = time.perf_counter() - t0
    how = " at its defaults" if spec.get("defaults") else ", held to the benchmark's batch limits"
    info = {
        "engine": "vLLM AsyncLLM (CPU build)" + how,
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "dtype": str(llm.vllm_config.model_config.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "max_num_seqs": llm.vllm_config.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": llm.vllm_config.scheduler_config.max_num_batched_tokens,
        "prefix_caching": llm.vllm_config.cache_config.enable_prefix_caching,
        "max_model_len": llm.vllm_config.model_config.max_model_len,
        "compiled": not llm.vllm_config.model_config.enforce_eager,
        "omp_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
        "kv_cache_space_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
        "children_peak_rss_mib": round(children_peak_rss_mib(), 1),
    }
    llm.shutdown()
    return {
        "requests": [
            {"rid": rid, "times": times[rid], "tokens": tokens[rid], "submitted": submitted[rid]}
            for rid in times
        ],
        "wall_s": wall,
        "info": info,
    }


def offline(spec: dict) -> dict:
    """vLLM's `LLM.generate` at its defaults (its multiprocess engine core) on every request at once."""
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=spec["model_dir"], disable_log_stats=True)
    reqs = spec["requests"]
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_ids"]) for r in reqs]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=WARM_TOKENS), use_tqdm=False)
    llm.reset_prefix_cache()
    params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"]) for r in reqs]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    cfg = llm.llm_engine.vllm_config
    info = {
        "engine": "vLLM LLM.generate (offline, multiprocess engine core) at its defaults",
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "dtype": str(cfg.model_config.dtype).removeprefix("torch."),
        "max_num_seqs": cfg.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
        "prefix_caching": cfg.cache_config.enable_prefix_caching,
        "max_model_len": cfg.model_config.max_model_len,
        "compiled": not cfg.model_config.enforce_eager,
        "omp_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
        "kv_cache_space_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
        "multiprocessing": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0",
        "children_peak_rss_mib": round(children_peak_rss_mib(), 1),
    }
    return {
        "requests": [
            {"rid": r["rid"], "times": [], "tokens": list(o.outputs[0].token_ids), "submitted": 0.0}
            for r, o in zip(reqs, outs, strict=True)
        ],
        "wall_s": wall,
        "info": info,
        "no_latency": True,
    }


if __name__ == "__main__":
    src, dst = sys.argv[1:3]
    spec = json.loads(Path(src).read_text())
    got = offline(spec) if spec.get("offline") else asyncio.run(serve(spec))
    # the whole engine's peak: this process's and its engine core's (AsyncLLM and LLM run it in a child)
    got["peak_rss_mib"] = round(peak_rss_mib() + got["info"]["children_peak_rss_mib"], 1)
    Path(dst).write_text(json.dumps(got))
