"""One engine per process for `tokenstream bench engine`: `python -m bench.engine_runners ENGINE IN OUT`.

Every runner reads the same workload (IN, JSON: requests with arrival offset, prompt token ids,
max_tokens; batch limits; threads), serves it, and writes OUT (JSON): per request the time of
every generated token (seconds after the runner's start of submission) and the token ids, the
wall time, what it ran (versions, dtype, limits) and its own peak RSS (VmHWM). One process per
engine keeps peak memory per engine honest. vLLM's runner is `bench/engine_vllm.py` (its venv).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

from bench.runenv import broker_and_keyring


def peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _setup(spec: dict, dtype: str):
    import torch

    torch.set_num_threads(spec["threads"])
    from gpu_workers.model_loader import load

    return load("smollm2", dtype=dtype)


def _has_prefix_cache(engine_cls) -> bool:
    import inspect

    return "prefix_cache" in inspect.signature(engine_cls).parameters


def run_tokenstream(spec: dict) -> dict:
    """The engine in-process: requests added at their arrival times, one step after another."""
    import torch

    from gpu_workers.engine import Engine, Sequence
    from gpu_workers.kv_cache import KVBudget

    loaded = _setup(spec, spec.get("dtype", "auto"))  # the worker's default: bf16 where the CPU has it
    cache = KVBudget.for_model(loaded.model, None, spec.get("block_size", 16), spec.get("kv_gb", 1.0))
    kw = {"prefix_cache": spec.get("prefix_cache", True)} if _has_prefix_cache(Engine) else {}
    if (
        "packed_linears" in spec
    ):  # A/B of the packed linear layers (gpu_workers/linears.py; RESULTS.md, streams)
        kw["packed_linears"] = spec["packed_linears"]
    eng = Engine(
        loaded.model,
        loaded.tokenizer,
        cache,
        max_running=spec["max_running"],
        prefill_chunk=spec["prefill_chunk"],
        **kw,
    )
    warm = Sequence("warm", spec["requests"][0]["prompt_ids"], max_tokens=4, temperature=0)
    eng.generate([warm])
    prefix = getattr(eng, "prefix_cache", None)
    if prefix is not None:
        prefix.clear()
    reqs = sorted(spec["requests"], key=lambda r: r["arrival"])
    seqs = {
        r["rid"]: Sequence(r["rid"], r["prompt_ids"], max_tokens=r["max_tokens"], temperature=0) for r in reqs
    }
    times: dict[str, list[float]] = {r["rid"]: [] for r in reqs}
    steps0 = eng.steps
    cpu0 = time.process_time()
    submitted: dict[str, float] = {}
    one_by_one = spec.get("sequential", False)
    t0 = time.perf_counter()
    i = 0
    while i < len(reqs) or eng.has_work:
        now = time.perf_counter() - t0
        while i < len(reqs) and (reqs[i]["arrival"] <= now if not one_by_one else not eng.has_work):
            at = now if one_by_one else reqs[i]["arrival"]
            seqs[reqs[i]["rid"]].arrival = time.time() - (now - at)
            submitted[reqs[i]["rid"]] = at
            eng.add(seqs[reqs[i]["rid"]])
            i += 1
        if not eng.has_work:
            time.sleep(max(0.0, reqs[i]["arrival"] - now))
            continue
        counts = {rid: len(s.generated) for rid, s in seqs.items()}
        eng.step()
        stamp = time.perf_counter() - t0
        for rid, s in seqs.items():
            new = len(s.generated) - counts[rid]
            if new > 0:
                times[rid] += [stamp] * new
    wall = time.perf_counter() - t0
    cpu = round(time.process_time() - cpu0, 2)
    info = {
        "engine": "tokenstream Engine (in-process)",
        "torch": torch.__version__,
        "dtype": loaded.dtype,
        "threads": torch.get_num_threads(),
        "max_running": spec["max_running"],
        "prefill_chunk": spec["prefill_chunk"],
        "kv_pages": cache.allocator.num_blocks,
        "page_size": cache.block_size,
        "prefix_cache": prefix is not None,
        "steps": eng.steps - steps0,
        "process_cpu_s": cpu,
        "packed_linears": getattr(eng, "packed_linears", 0),
        "decode_kernel": getattr(eng, "decode_kernel", False),
        "own_llama_forward": getattr(eng, "llama_step", None) is not None,
    }
    if prefix is not None:
        info["prefix_cache_hit_tokens"] = prefix.hit_tokens
    return {
        "requests": [
            {"rid": rid, "times": times[rid], "tokens": seqs[rid].generated, "submitted": submitted[rid]}
            for rid in times
        ],
        "wall_s": wall,
        "info": info,
    }


def run_transformers(spec: dict) -> dict:
    """transformers' own continuous batching (paged KV cache), streaming, fed at arrival times."""
    import torch
    import transformers
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    loaded = _setup(spec, "float32")
    model, tok = loaded.model, loaded.tokenizer
    gen = GenerationConfig(
        do_sample=False,
        max_new_tokens=max(r["max_tokens"] for r in spec["requests"]),
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    cb = ContinuousBatchingConfig(
        page_size=16,
        num_blocks=2048,
        max_batch_tokens=spec["prefill_chunk"],
        max_requests_per_batch=spec["max_running"],
    )
    manager = model.init_continuous_batching(gen, cb)
    manager.start()
    reqs = sorted(spec["requests"], key=lambda r: r["arrival"])
    times: dict[str, list[float]] = {r["rid"]: [] for r in reqs}
    tokens: dict[str, list[int]] = {r["rid"]: [] for r in reqs}
    done = threading.Event()
    finished: set[str] = set()
    t0 = time.perf_counter()

    def feed():
        for r in reqs:
            wait = r["arrival"] - (time.perf_counter() - t0)
            if wait > 0:
                time.sleep(wait)
            manager.add_request(
                r["prompt_ids"], request_id=r["rid"], max_new_tokens=r["max_tokens"], streaming=True
            )

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    while len(finished) < len(reqs):
        out = manager.get_result(timeout=1.0)
        if out is None:
            if not manager.is_running():
                raise RuntimeError("transformers continuous batching stopped")
            continue
        stamp = time.perf_counter() - t0
        new = out.generated_tokens[len(tokens[out.request_id]) :]
        tokens[out.request_id] += new
        times[out.request_id] += [stamp] * len(new)
        if out.is_finished():
            finished.add(out.request_id)
    wall = time.perf_counter() - t0
    done.set()
    manager.stop(block=True, timeout=10)
    info = {
        "engine": "transformers continuous batching",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "dtype": loaded.dtype,
        "threads": torch.get_num_threads(),
        "max_requests_per_batch": spec["max_running"],
        "max_batch_tokens": spec["prefill_chunk"],
        "page_size": 16,
        "num_blocks": 2048,
    }
    return {
        "requests": [{"rid": rid, "times": times[rid], "tokens": tokens[rid]} for rid in times],
        "wall_s": wall,
        "info": info,
    }


def run_reference(spec: dict) -> dict:
    """HF generate(), greedy, one request at a time: the outputs every engine is compared with."""
    import torch

    loaded = _setup(spec, "float32")
    out = []
    t0 = time.perf_counter()
    for k, r in enumerate(spec["requests"]):
        ids = loaded.model.generate(
            torch.tensor([r["prompt_ids"]]), max_new_tokens=r["max_tokens"], do_sample=False
        )[0, len(r["prompt_ids"]) :].tolist()
        out.append({"rid": r["rid"], "times": [], "tokens": ids})
        print(f"reference {k + 1}/{len(spec['requests'])}", file=sys.stderr, flush=True)
    return {"requests": out, "wall_s": time.perf_counter() - t0, "info": {"engine": "HF generate()"}}


def run_worker(spec: dict, backend: str = "transformers", dtype: str = "auto", sealing: bool = True) -> dict:
    """The worker through Kafka (bench/worker.py's path): a throwaway broker and durable Redis (the
    keyring), the real service. With `backend="vllm"` (run in vLLM's virtualenv) its engine is vLLM's at
    vLLM's own batch limits and, unless `dtype` says otherwise, vLLM's own dtype: `tokenstream worker
    --backend vllm` as it runs when none of them is given. `sealing=False`: content in clear on the
    topics (the `worker-clear` column, to show what sealing costs in throughput)."""
    import asyncio
    import logging

    import torch

    from bench.worker import Work, run_worker_bench
    from gpu_workers.torch_thread import run_on_torch_thread

    logging.getLogger("aiokafka").setLevel(logging.ERROR)
    loaded = None
    if backend == "transformers":
        loaded = run_on_torch_thread(
            _setup, spec, dtype
        )  # where the worker steps: one OpenMP team (torch_thread.py)
    limits = (spec["max_running"], spec["prefill_chunk"]) if backend == "transformers" else (None, None)
    work = [
        Work(r["rid"], r["arrival"], r["messages"], r["max_tokens"], r["prompt_ids"])
        for r in spec["requests"]
    ]
    with broker_and_keyring(
        "bench-engine-", lambda m: print(m, file=sys.stderr, flush=True), sealing
    ) as stack:
        res = asyncio.run(
            run_worker_bench(
                loaded,
                work,
                stack.kafka.address,
                *limits,
                broker_pid=stack.kafka.pid(),
                backend=backend,
                model_path=Path(spec["model_dir"]),
                dtype=dtype,
            )
        )
    info = {
        "engine": "worker via Kafka (run_worker in-process, client in its own process on ts.tokens)"
        + (", vLLM backend at vLLM's batch limits" if backend == "vllm" else "")
        + ("" if sealing else ", sealing off (content in clear on the topics)"),
        "torch": torch.__version__,
        "dtype": res.extra.pop("dtype"),
        "threads": torch.get_num_threads(),
        "max_running": limits[0] or "vLLM's default",
        "prefill_chunk": limits[1] or "vLLM's default",
        **res.extra,
    }
    from schemas.codec import sealer

    info["sealing"] = sealer() is not None  # what the run's clients really did (a keyring installed)
    if backend == "vllm":
        import vllm

        info["vllm"] = vllm.__version__
    return {
        "aggregate": {"tokens": res.tokens, "ttft": res.ttft, "itl": res.itl},
        "outputs": res.outputs,
        "wall_s": res.wall_s,
        "info": info,
    }


def run_conversations(spec: dict) -> dict:
    """Multi-turn chats through the engine, with and without prefix reuse: per turn TTFT and prefill
    tokens."""
    from gpu_workers.engine import Engine, Sequence
    from gpu_workers.kv_cache import KVBudget

    loaded = _setup(spec, "float32")
    tok = loaded.tokenizer
    result = {}
    for reuse in (False, True):
        cache = KVBudget.for_model(loaded.model, None, 16, spec.get("kv_gb", 1.0))
        eng = Engine(
            loaded.model,
            tok,
            cache,
            max_running=spec["max_running"],
            prefill_chunk=spec["prefill_chunk"],
            prefix_cache=reuse,
        )
        eng.generate([Sequence("warm", tok("warm up")["input_ids"], max_tokens=2, temperature=0)])
        if eng.prefix_cache is not None:
            eng.prefix_cache.clear()
        turns: list[list[dict]] = [[] for _ in range(spec["turns"])]
        histories = [[] for _ in range(spec["conversations"])]
        for t in range(spec["turns"]):
            seqs = []
            for c, hist in enumerate(histories):
                hist.append({"role": "user", "content": spec["questions"][(c + t) % len(spec["questions"])]})
                ids = tok.apply_chat_template(hist, add_generation_prompt=True, tokenize=True)
                ids = list(ids if isinstance(ids, list) else ids["input_ids"])
                seqs.append(
                    Sequence(
                        f"c{c}-t{t}",
                        ids,
                        max_tokens=spec["answer_tokens"],
                        temperature=0,
                        tenant=f"tenant-{c % 2}",
                    )
                )
            eng.generate(seqs)
            for c, s in enumerate(seqs):
                histories[c].append({"role": "assistant", "content": s.emitted_text})
                turns[t].append(
                    {
                        "prompt_tokens": len(s.prompt_ids),
                        "cached_tokens": s.cached_tokens,
                        "prefill_tokens": len(s.prompt_ids) - s.cached_tokens,
                        "ttft_s": s.first_token_at - s.arrival,
                        "tokens": list(s.generated),
                    }
                )
        result["with_reuse" if reuse else "without_reuse"] = turns
    return result


RUNNERS = {
    "tokenstream": run_tokenstream,
    "tokenstream-fp32": lambda spec: run_tokenstream(dict(spec, dtype="float32")),
    "transformers": run_transformers,
    "reference": run_reference,
    "worker": run_worker,
    "worker-clear": lambda spec: run_worker(spec, sealing=False),
    "worker-vllm": lambda spec: run_worker(spec, "vllm"),
    "worker-vllm-fp32": lambda spec: run_worker(spec, "vllm", "float32"),
    "conversations": run_conversations,
}

if __name__ == "__main__":
    engine, src, dst = sys.argv[1:4]
    spec = json.loads(Path(src).read_text())
    got = RUNNERS[engine](spec)
    got["peak_rss_mib"] = round(peak_rss_mib(), 1)
    Path(dst).write_text(json.dumps(got))
