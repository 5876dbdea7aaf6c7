"""The stages of `bench/gpu_engine.sh`: the engine in-process, without Kafka, against its peers on one
GPU, in one run. Nothing here starts a broker or the worker service: each stage drives `Engine.step()`
(or the peer's own API) directly, so the figures are the engine's, not the worker's through Kafka
(that is `tokenstream bench engine`'s `worker` column).

Each stage is a separate process (`python -m bench.gpu_engine STAGE`) so that every engine starts
with the GPU to itself; the stages share a work folder ($WORK) and the knobs in the environment
(see the shell script). Stages:

  engine        tokenstream's engine, real path (incremental detokenisation, EOS, stops, on-device
                seeded sampling, prefix cache on), per quantization mode: bf16, bitsandbytes 8-bit
                and 4-bit nf4
  transformers  the baseline in the same run: transformers' continuous batching (`generate_batch`),
                or static batches of `generate()` where that is missing, same prompts and sampling
  agreement     greedy outputs of the engine against HF `generate()` for a few requests, in fp32
                (bf16 rounding makes near-ties flip, so agreement is checked where it is meaningful)
  profile       a full batch's decode step: wall time against device-busy time, top host operators
  vllm          vLLM serving the same requests (run by vLLM's python, if it has vLLM)
  report        the table and bench/results/gpu_engine.json

Import-light at module level: the `vllm` stage runs under another virtualenv.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

ENV = os.environ
WORK = Path(ENV.get("WORK", "/tmp"))
ROOT = Path(__file__).resolve().parent.parent


def knobs() -> dict:
    return {
        "shape": ENV.get("SHAPE", "1b"),
        "device": ENV.get("DEVICE", "cuda"),
        "requests": int(ENV.get("REQUESTS", "256")),
        "prompt": int(ENV.get("PROMPT", "128")),
        "output": int(ENV.get("OUTPUT", "128")),
        "max_running": int(ENV.get("MAX_RUNNING", "128")),
        "kv_gb": float(ENV.get("KV_GB", "16")),
        "modes": ENV.get("MODES", "bf16,8bit,4bit").split(","),
        "agreement": int(ENV.get("AGREEMENT", "8")),
    }


def prompts(k: dict) -> list[list[int]]:
    """Fixed synthetic prompts (token ids in the vocabulary's body), distinct per request."""
    return [[100 + (i * 7 + j) % 30000 for j in range(k["prompt"])] for i in range(k["requests"])]


def on_gpu(k: dict) -> bool:
    return k["device"].startswith("cuda")


def dtype_name(k: dict) -> str:
    return "bfloat16" if on_gpu(k) else "float32"


def folder(k: dict) -> Path:
    from gpu_workers.random_model import build

    return build(ENV["MODEL_DIR"], k["shape"], dtype=dtype_name(k))


def write(name: str, data: dict) -> None:
    (WORK / f"{name}.json").write_text(json.dumps(data))


def read(name: str) -> dict:
    path = WORK / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else {"skipped": f"stage {name} wrote nothing"}


def versions() -> dict:
    import torch
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    try:
        import bitsandbytes

        out["bitsandbytes"] = bitsandbytes.__version__
    except Exception:  # noqa: BLE001 - reported, not needed for bf16
        out["bitsandbytes"] = None
    return out


def _sync(k: dict):
    import torch

    return torch.cuda.synchronize if on_gpu(k) else (lambda: None)


def _engine_run(k: dict, mode: str) -> dict:
    import torch

    from gpu_workers.engine import Engine, Sequence
    from gpu_workers.kv_cache import KVBudget
    from gpu_workers.model_loader import load

    quant = {"bf16": "none", "8bit": "8bit", "4bit": "4bit"}[mode]
    if on_gpu(k):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    m = load(k["shape"], folder(k), dtype=dtype_name(k), quantization=quant, device=k["device"])
    load_s = time.perf_counter() - t
    cache = KVBudget.for_model(m.model, None, 16, k["kv_gb"])
    eng = Engine(
        m.model,
        m.tokenizer,
        cache,
        max_running=k["max_running"],
        prefill_chunk=8192,
        max_model_len=k["prompt"] + k["output"] + 16,
    )
    # warm-up at the measured shapes (a full batch's prefill and decode: lazy CUDA initialisation and
    # kernel selection happen here, not in the measured run)
    eng.generate(
        [
            Sequence(f"w{i}", p, max_tokens=8, temperature=0.8, top_p=0.95, seed=i)
            for i, p in enumerate(prompts(k)[: k["max_running"]])
        ]
    )
    if eng.prefix_cache is not None:
        eng.prefix_cache.clear()  # the measured run starts cold
    seqs = [
        Sequence(f"r{i}", p, max_tokens=k["output"], temperature=0.8, top_p=0.95, seed=i)
        for i, p in enumerate(prompts(k))
    ]
    for s in seqs:
        eng.add(s)
    sync = _sync(k)
    peak_batch = peak_kv = steps = 0
    sync()
    t0 = time.perf_counter()
    while eng.has_work:
        eng.step()
        steps += 1
        peak_batch = max(peak_batch, len(eng.running))
        peak_kv = max(peak_kv, cache.usage())
    sync()
    wall = time.perf_counter() - t0
    tokens = sum(len(s.generated) for s in seqs)
    r = {
        "tokens": tokens,
        "wall_s": round(wall, 2),
        "tokens_per_s": round(tokens / wall, 1),
        "peak_batch": peak_batch,
        "peak_kv_usage": round(peak_kv, 3),
        "steps": steps,
        "step_ms": round(1000 * wall / max(steps, 1), 2),
        "finished_by_eos": sum(s.finish_reason == "stop" for s in seqs),
        "kv_budget_gib": round(cache.nbytes() / 2**30, 2),
        "kv_pages": cache.allocator.num_blocks,
        "load_s": round(load_s, 1),
        "params_m": round(m.params / 1e6, 1),
        "weights_gib": round(m.model.get_memory_footprint() / 2**30, 2),
    }
    if on_gpu(k):
        r["peak_gpu_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    del eng, cache, m
    if on_gpu(k):
        torch.cuda.empty_cache()
    return r


def stage_engine() -> None:
    k = knobs()
    v = versions()
    write("versions", v)
    print(f"model {folder(k)}; {v}", flush=True)
    runs = {}
    for mode in k["modes"]:
        try:
            runs[mode] = _engine_run(k, mode)
        except Exception as exc:  # noqa: BLE001 - one mode failing must not lose the others
            traceback.print_exc()
            runs[mode] = {"skipped": f"{type(exc).__name__}: {exc}"[:300]}
        print(f"engine {mode:5s} {runs[mode]}", flush=True)
        write("engine", runs)  # after every mode: a stage stopped by its time limit keeps what it measured


def stage_transformers() -> None:
    """transformers over the same requests (sampled, same lengths): its continuous batching
    (`generate_batch`) and static batches of `generate()`; the faster is the baseline."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    k = knobs()
    model = (
        AutoModelForCausalLM.from_pretrained(folder(k), dtype=getattr(torch, dtype_name(k)))
        .to(k["device"])
        .eval()
    )
    gen = GenerationConfig(
        do_sample=True,
        temperature=0.8,
        top_p=0.95,
        top_k=0,
        max_new_tokens=k["output"],
        eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.eos_token_id,
    )
    out = {}
    for name, run in (("static", _hf_static), ("continuous", _hf_continuous)):
        try:
            out[name] = run(model, gen, k)
        except Exception as exc:  # noqa: BLE001 - one API missing must not lose the other
            traceback.print_exc()
            out[name] = {"skipped": f"{type(exc).__name__}: {exc}"[:300]}
        print(f"transformers {name} {out[name]}", flush=True)
        write("transformers", out)


def _timed(k: dict, fn) -> tuple[float, int]:
    sync = _sync(k)
    sync()
    t0 = time.perf_counter()
    tokens = fn()
    sync()
    return time.perf_counter() - t0, tokens


def _hf_static(model, gen, k: dict) -> dict:
    """Batches of `max_running` rows through `generate()` (equal-length prompts: no padding)."""
    import torch

    ps, dev, rows = prompts(k), k["device"], k["max_running"]
    torch.manual_seed(0)

    def run(batch_prompts):
        tokens = 0
        for i in range(0, len(batch_prompts), rows):
            batch = torch.tensor(batch_prompts[i : i + rows], device=dev)
            with torch.inference_mode():
                done = model.generate(batch, attention_mask=torch.ones_like(batch), generation_config=gen)
            tokens += int((done[:, batch.shape[1] :] != gen.pad_token_id).sum())
        return tokens

    run(ps[:4])  # warm-up
    wall, tokens = _timed(k, lambda: run(ps))
    return {
        "how": f"static batches of generate() ({rows} rows)",
        "tokens": tokens,
        "wall_s": round(wall, 2),
        "tokens_per_s": round(tokens / wall, 1),
    }


def _hf_continuous(model, gen, k: dict) -> dict:
    import inspect

    ps, kwargs = prompts(k), {}
    if "continuous_batching_config" in inspect.signature(model.generate_batch).parameters:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        accepted = inspect.signature(ContinuousBatchingConfig.__init__).parameters
        wanted = {
            "page_size" if "page_size" in accepted else "block_size": 16,
            "max_batch_tokens": 8192,
            "max_requests_per_batch": k["max_running"],
        }
        kwargs["continuous_batching_config"] = ContinuousBatchingConfig(
            **{key: v for key, v in wanted.items() if key in accepted}
        )
    model.generate_batch(ps[:4], generation_config=gen, progress_bar=False, **kwargs)  # warm-up
    wall, tokens = _timed(
        k,
        lambda: sum(
            len(o.generated_tokens)
            for o in model.generate_batch(ps, generation_config=gen, progress_bar=False, **kwargs).values()
        ),
    )
    return {
        "how": "continuous batching (generate_batch)",
        "tokens": tokens,
        "wall_s": round(wall, 2),
        "tokens_per_s": round(tokens / wall, 1),
    }


def stage_agreement() -> None:
    """Greedy: the engine's outputs against HF generate(), one request at a time, fp32."""
    import torch

    from gpu_workers.engine import Engine, Sequence
    from gpu_workers.kv_cache import KVBudget
    from gpu_workers.model_loader import load

    k = knobs()
    n, length = k["agreement"], 32
    if n <= 0:
        write("agreement", {"skipped": "AGREEMENT=0"})
        return
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    m = load(k["shape"], folder(k), dtype="float32", quantization="none", device=k["device"])
    eng = Engine(
        m.model,
        m.tokenizer,
        KVBudget.for_model(m.model, None, 16, 1.0),
        max_running=n,
        prefill_chunk=8192,
        max_model_len=k["prompt"] + length + 16,
    )
    ps = prompts(k)[:n]
    seqs = [Sequence(f"g{i}", p, max_tokens=length, temperature=0) for i, p in enumerate(ps)]
    eng.generate(seqs)
    same, first_diff = 0, []
    with torch.inference_mode():
        for p, s in zip(ps, seqs):
            ref = m.model.generate(
                torch.tensor([p], device=m.device),
                do_sample=False,
                max_new_tokens=length,
                eos_token_id=None,
                pad_token_id=m.tokenizer.eos_token_id,
            )[0, len(p) :].tolist()
            got = s.generated[:length]
            same += got == ref[: len(got)] and len(got) > 0
            first_diff.append(next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), len(got)))
    r = {
        "requests": n,
        "tokens_each": length,
        "identical": same,
        "first_difference_at": first_diff,
        "dtype": "float32",
    }
    print(f"agreement {r}", flush=True)
    write("agreement", r)


def stage_profile() -> None:
    """Where a decode step's time goes at a full batch: wall time per step against the time the
    device was busy (kernels), and the top operators by host time (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    from gpu_workers.engine import Engine, Sequence
    from gpu_workers.kv_cache import KVBudget
    from gpu_workers.model_loader import load

    k = knobs()
    m = load(k["shape"], folder(k), dtype=dtype_name(k), quantization="none", device=k["device"])
    eng = Engine(
        m.model,
        m.tokenizer,
        KVBudget.for_model(m.model, None, 16, k["kv_gb"]),
        max_running=k["max_running"],
        prefill_chunk=8192,
        max_model_len=k["prompt"] + k["output"] + 16,
    )
    for i, p in enumerate(prompts(k)[: k["max_running"]]):
        eng.add(Sequence(f"p{i}", p, max_tokens=k["output"], temperature=0.8, top_p=0.95, seed=i))
    for _ in range(8):  # prefill, then a few decodes
        eng.step()
    sync, steps = _sync(k), 16
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu(k) else [])
    sync()
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        sync()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events) if on_gpu(k) else 0
    r = {
        "rows": len(eng.running),
        "step_ms": round(1000 * wall / steps, 2),
        "device_busy_ms_per_step": round(device_us / 1000 / steps, 2),
        "device_busy_share": round(device_us / 1e6 / wall, 3) if on_gpu(k) else None,
        "kernel_launches_per_step": round(
            sum(e.count for e in events if e.key.startswith("cudaLaunch")) / steps
        ),
    }
    print(f"profile {r}", flush=True)
    print(events.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=48), flush=True)
    write("profile", r)


def stage_vllm() -> None:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    k = knobs()
    ps = prompts(k)
    llm = LLM(
        model=ENV["MODEL_DIR"],
        dtype="bfloat16",  # the folder the engine stage built
        max_num_seqs=k["max_running"],
        max_model_len=k["prompt"] + k["output"] + 16,
        seed=0,
    )
    params = [
        SamplingParams(temperature=0.8, top_p=0.95, max_tokens=k["output"], seed=i) for i in range(len(ps))
    ]
    llm.generate([TokensPrompt(prompt_token_ids=ps[0])], SamplingParams(max_tokens=4))
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    r = {
        "tokens": tokens,
        "wall_s": round(wall, 2),
        "tokens_per_s": round(tokens / wall, 1),
        "vllm": vllm.__version__,
    }
    print(f"vllm  bf16  {r}", flush=True)
    write("vllm", r)


def ratio(a: dict, b: dict) -> float | None:
    if "tokens_per_s" in a and "tokens_per_s" in b:
        return round(a["tokens_per_s"] / b["tokens_per_s"], 2)
    return None


def stage_report() -> None:
    k = knobs()
    runs, vl, agree, prof = read("engine"), read("vllm"), read("agreement"), read("profile")
    peers = read("transformers")
    measured = [r for r in peers.values() if isinstance(r, dict) and "tokens_per_s" in r]
    hf = max(measured, key=lambda r: r["tokens_per_s"]) if measured else {"skipped": str(peers)[:300]}
    bf16 = runs.get("bf16", {})
    print(f"\nthe engine in-process, without Kafka, against its peers on {k['device']}")
    print(f"{'engine':28s} {'tokens/s':>9s} {'wall s':>7s} {'peak GiB':>9s}")
    for name, r in [
        *((f"tokenstream {mode}", r) for mode, r in runs.items()),
        *((f"transformers {name}", r) for name, r in peers.items() if isinstance(r, dict)),
        ("vLLM bf16", vl),
    ]:
        if "tokens_per_s" in r:
            peak = r.get("peak_gpu_mem_gib", "-")
            print(f"{name[:28]:28s} {r['tokens_per_s']:9.1f} {r['wall_s']:7.2f} {peak!s:>9s}")
        else:
            print(f"{name[:28]:28s} skipped: {r.get('skipped')}")
    out = {
        **{key: k[key] for key in ("shape", "device", "requests", "prompt", "output", "max_running")},
        "runs": runs,
        "transformers": peers,
        "vllm": vl,
        "profile_bf16": prof,
        "greedy_agreement": agree,
        "engine_vs_vllm_bf16": ratio(bf16, vl),
        "engine_vs_transformers_bf16": ratio(bf16, hf),
        "versions": read("versions"),
    }
    print(
        f"engine bf16 / vLLM bf16: {out['engine_vs_vllm_bf16']}x; "
        f"engine bf16 / transformers' faster ({hf.get('how', '-')}): {out['engine_vs_transformers_bf16']}x; "
        f"greedy agreement: {agree.get('identical', '-')}/{agree.get('requests', '-')}"
    )
    target = Path(ENV.get("RESULT", ROOT / "bench" / "results" / "gpu_engine.json"))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(out, indent=2))
    print(f"written {target}")


STAGES = {
    "engine": stage_engine,
    "transformers": stage_transformers,
    "agreement": stage_agreement,
    "profile": stage_profile,
    "vllm": stage_vllm,
    "report": stage_report,
}

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in STAGES:
        sys.exit(
            f"usage: python -m bench.gpu_engine {{{'|'.join(STAGES)}}}\n"
            "one stage of bench/gpu_engine.sh: the engine in-process, without Kafka, on one GPU"
        )
    STAGES[sys.argv[1]]()
