#!/usr/bin/env bash
# Engine against vLLM on one GPU, same model, same prompts, same run: a random-initialised ~1.2B Llama
# (Llama-3.2-1B shape, SmolLM2 vocabulary and tokenizer) built from a config, 128-token prompts,
# up to 128 new tokens, sampled (temperature 0.8, top-p 0.95, a seed per request). The engine runs its
# real path: incremental detokenisation, EOS, stop handling, on-device sampling, prefix cache on.
# Then vLLM (if importable by $VLLM_PY, default: the same python) serves the same requests with
# the same sampling parameters. Prints tokens/s of both and the ratio; writes bench/results/gpu_worker.json.
# Modes: bf16 (both engines), then bitsandbytes 8-bit and 4-bit nf4 (engine only). About 5 minutes on an
# H100/H200-class GPU.
#
#   bench/gpu_worker.sh                                            # defaults below
#   VLLM_PY=/path/to/venv/bin/python bench/gpu_worker.sh           # vLLM from another virtualenv
#   SHAPE=tiny DEVICE=cpu REQUESTS=8 PROMPT=32 OUTPUT=16 KV_GB=0.05 MODES=bf16 VLLM=0 bench/gpu_worker.sh  # CPU smoke
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export SHAPE=${SHAPE:-1b} DEVICE=${DEVICE:-cuda} REQUESTS=${REQUESTS:-256} PROMPT=${PROMPT:-128} OUTPUT=${OUTPUT:-128}
export MAX_RUNNING=${MAX_RUNNING:-128} KV_GB=${KV_GB:-16} MODES=${MODES:-bf16,8bit,4bit} VLLM=${VLLM:-1}
export MODEL_DIR=${MODEL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tokenstream/models/random-${SHAPE}}
export WORK=${WORK:-$(mktemp -d)}
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
prompts = [[100 + (i * 7 + j) % 30000 for j in range(prompt)] for i in range(n)]
Path(env["WORK"], "prompts.json").write_text(json.dumps({"prompts": prompts, "output": output, "folder": str(folder)}))
sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
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
    eng = Engine(m.model, m.tokenizer, cache, max_running=int(env["MAX_RUNNING"]), prefill_chunk=8192,
                 max_model_len=prompt + output + 16)
    eng.generate([Sequence("w", list(range(100, 100 + prompt)), max_tokens=4, temperature=0)])
    if eng.prefix_cache is not None:
        eng.prefix_cache.clear()  # the measured run starts cold
    seqs = [Sequence(f"r{i}", p, max_tokens=output, temperature=0.8, top_p=0.95, seed=i) for i, p in enumerate(prompts)]
    for s in seqs:
        eng.add(s)
    peak_batch = peak_kv = 0
    sync(); t0 = time.perf_counter(); steps = 0
    while eng.has_work:
        eng.step(); steps += 1
        peak_batch = max(peak_batch, len(eng.running)); peak_kv = max(peak_kv, cache.usage())
    sync(); wall = time.perf_counter() - t0
    tokens = sum(len(s.generated) for s in seqs)
    r = {"tokens": tokens, "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 1),
         "peak_batch": peak_batch, "peak_kv_usage": round(peak_kv, 3), "steps": steps,
         "finished_by_eos": sum(s.finish_reason == "stop" for s in seqs),
         "kv_budget_gib": round(cache.nbytes() / 2**30, 2), "kv_pages": cache.allocator.num_blocks,
         "load_s": round(load_s, 1), "params_m": round(m.params / 1e6, 1),
         "weights_gib": round(m.model.get_memory_footprint() / 2**30, 2)}
    if device.startswith("cuda"):
        r["peak_gpu_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    runs[mode] = r
    print(f"engine {mode:5s} {r}", flush=True)
    del eng, cache, m
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
Path(env["WORK"], "engine.json").write_text(json.dumps(runs))
PYEOF
VLLM_JSON="$WORK/vllm.json"
if [ "$VLLM" = "1" ]; then
  VPY=${VLLM_PY:-$PY}
  if "$VPY" -c "import vllm" 2>/dev/null; then
    VLLM_ENABLE_V1_MULTIPROCESSING=0 "$VPY" - <<'PYEOF' || echo '{"skipped": "vLLM run failed (see above)"}' > "$VLLM_JSON"
import json, os, time
from pathlib import Path
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
spec = json.loads(Path(os.environ["WORK"], "prompts.json").read_text())
llm = LLM(model=spec["folder"], dtype="bfloat16", max_num_seqs=int(os.environ["MAX_RUNNING"]),
          max_model_len=len(spec["prompts"][0]) + spec["output"] + 16, seed=0)
params = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=spec["output"], seed=i)
          for i in range(len(spec["prompts"]))]
llm.generate([TokensPrompt(prompt_token_ids=spec["prompts"][0])], SamplingParams(max_tokens=4))
t0 = time.perf_counter()
outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]], params, use_tqdm=False)
wall = time.perf_counter() - t0
tokens = sum(len(o.outputs[0].token_ids) for o in outs)
import vllm
r = {"tokens": tokens, "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 1), "vllm": vllm.__version__}
print(f"vllm  bf16  {r}", flush=True)
Path(os.environ["WORK"], "vllm.json").write_text(json.dumps(r))
PYEOF
  else
    echo "vLLM: skipped: 'import vllm' fails for $VPY (set VLLM_PY to a python with vLLM installed)"
    echo "{\"skipped\": \"import vllm fails for $VPY\"}" > "$VLLM_JSON"
  fi
else
  echo '{"skipped": "VLLM=0"}' > "$VLLM_JSON"
fi
"$PY" - <<'PYEOF'
import json, os
from pathlib import Path
work, env = Path(os.environ["WORK"]), os.environ
runs = json.loads((work / "engine.json").read_text())
vllm = json.loads((work / "vllm.json").read_text())
ratio = None
if "tokens_per_s" in vllm and "bf16" in runs:
    ratio = round(runs["bf16"]["tokens_per_s"] / vllm["tokens_per_s"], 2)
print(f"engine bf16 vs vLLM bf16 on the same device: {ratio}x" if ratio else f"vLLM: {vllm.get('skipped')}")
out = Path("bench/results/gpu_worker.json")
out.parent.mkdir(parents=True, exist_ok=True)
out.write_text(json.dumps({"shape": env["SHAPE"], "device": env["DEVICE"], "requests": int(env["REQUESTS"]),
                           "prompt_tokens": int(env["PROMPT"]), "output_tokens": int(env["OUTPUT"]),
                           "runs": runs, "vllm": vllm, "engine_vs_vllm_bf16": ratio}, indent=2))
print(f"written {out}")
PYEOF
