#!/usr/bin/env bash
# Worker engine throughput on a GPU: a random-initialised ~1.2B Llama (Llama-3.2-1B shape, SmolLM2
# vocabulary) built from a config, fixed prompt and output lengths (EOS ignored), in bf16 and with
# bitsandbytes 8-bit and 4-bit (nf4). Reports tokens/s, batch size reached and KV usage per run and
# writes bench/results/gpu_worker.json. One short run: about 5 minutes on one H100/H200-class GPU.
#
#   bench/gpu_worker.sh                         # defaults below
#   SHAPE=tiny DEVICE=cpu REQUESTS=16 bench/gpu_worker.sh   # smoke test without a GPU
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
SHAPE=${SHAPE:-1b} DEVICE=${DEVICE:-cuda} REQUESTS=${REQUESTS:-256} PROMPT=${PROMPT:-128} OUTPUT=${OUTPUT:-128} \
MAX_RUNNING=${MAX_RUNNING:-128} KV_GB=${KV_GB:-16} MODES=${MODES:-bf16,8bit,4bit} \
MODEL_DIR=${MODEL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tokenstream/models/random-${SHAPE:-1b}} \
"$PY" - <<'PYEOF'
import json, os, time
from pathlib import Path

import torch

from gpu_workers.engine import Engine, Sequence
from gpu_workers.kv_cache import PagedKVCache
from gpu_workers.model_loader import load
from gpu_workers.random_model import build

env = os.environ
shape, device = env["SHAPE"], env["DEVICE"]
n, prompt, output = int(env["REQUESTS"]), int(env["PROMPT"]), int(env["OUTPUT"])
folder = build(env["MODEL_DIR"], shape, dtype="bfloat16" if device.startswith("cuda") else "float32")
print(f"device: {torch.cuda.get_device_name(0) if device.startswith('cuda') else 'cpu'}; model {folder}")
runs = {}
for mode in env["MODES"].split(","):
    quant = {"bf16": "none", "8bit": "8bit", "4bit": "4bit"}[mode]
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    if device.startswith("cuda"):
        torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    m = load(shape, folder, dtype=dtype, quantization=quant, device=device)
    load_s = time.perf_counter() - t
    cache = PagedKVCache.for_model(m.model, None, 16, float(env["KV_GB"]))
    eng = Engine(m.model, m.tokenizer, cache, max_running=int(env["MAX_RUNNING"]), prefill_chunk=2048,
                 max_model_len=prompt + output + 16)
    eng.eos_ids = set()  # fixed output lengths
    eng.tokenizer = type("NoText", (), {"decode": staticmethod(lambda ids, **k: "")})()  # skip detokenising
    warm = [Sequence("w", list(range(100, 100 + prompt)), max_tokens=4, temperature=0)]
    eng.generate(warm)
    seqs = [Sequence(f"r{i}", [100 + (i * 7 + j) % 30000 for j in range(prompt)], max_tokens=output,
                     temperature=0.8, top_p=0.95, seed=i) for i in range(n)]
    for s in seqs:
        eng.add(s)
    peak_batch = peak_kv = 0
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync(); t0 = time.perf_counter(); steps = 0
    while eng.has_work:
        eng.step(); steps += 1
        peak_batch = max(peak_batch, len(eng.running)); peak_kv = max(peak_kv, cache.usage())
    sync(); wall = time.perf_counter() - t0
    tokens = sum(len(s.generated) for s in seqs)
    r = {"tokens": tokens, "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 1),
         "peak_batch": peak_batch, "peak_kv_usage": round(peak_kv, 3), "steps": steps,
         "kv_pool_gib": round(cache.nbytes() / 2**30, 2), "kv_pages": cache.allocator.num_blocks,
         "load_s": round(load_s, 1), "params_m": round(m.params / 1e6, 1),
         "weights_gib": round(m.model.get_memory_footprint() / 2**30, 2)}
    if device.startswith("cuda"):
        r["peak_gpu_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    runs[mode] = r
    print(f"{mode:5s} {r}", flush=True)
    del eng, cache, m
out = Path("bench/results/gpu_worker.json")
out.parent.mkdir(parents=True, exist_ok=True)
out.write_text(json.dumps({"shape": shape, "device": device, "requests": n, "prompt_tokens": prompt,
                           "output_tokens": output, "runs": runs}, indent=2))
print(f"written {out}")
PYEOF
