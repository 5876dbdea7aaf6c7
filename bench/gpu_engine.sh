#!/usr/bin/env bash
# The engine in-process, without Kafka (no broker, no worker service: Engine.step() called directly),
# against its peers on one GPU, same model, same prompts, same run: a random-initialised
# ~1.2B Llama (Llama-3.2-1B shape, SmolLM2 vocabulary and tokenizer) built from a config, 128-token
# prompts, up to 128 new tokens, sampled (temperature 0.8, top-p 0.95, a seed per request). Stages
# (bench/gpu_engine.py, one process each): the engine's real path (incremental detokenisation, EOS,
# stops, on-device sampling, prefix cache on) in bf16, bitsandbytes 8-bit and 4-bit nf4; transformers
# on the same requests as the baseline of this run; greedy agreement of the engine with HF generate()
# (fp32); vLLM if importable by $VLLM_PY (default: the same python). Prints tokens/s and the ratios;
# writes bench/results/gpu_engine.json. About 4 minutes on an H100/H200-class GPU.
#
#   bench/gpu_engine.sh                                            # defaults below
#   VLLM_PY=/path/to/venv/bin/python bench/gpu_engine.sh           # vLLM from another virtualenv
#   SHAPE=tiny DEVICE=cpu REQUESTS=8 PROMPT=32 OUTPUT=16 KV_GB=0.05 MODES=bf16 AGREEMENT=2 VLLM=0 bench/gpu_engine.sh  # CPU smoke
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export SHAPE=${SHAPE:-1b} DEVICE=${DEVICE:-cuda} REQUESTS=${REQUESTS:-256} PROMPT=${PROMPT:-128} OUTPUT=${OUTPUT:-128}
export MAX_RUNNING=${MAX_RUNNING:-128} KV_GB=${KV_GB:-16} MODES=${MODES:-bf16,8bit,4bit} AGREEMENT=${AGREEMENT:-8}
export MODEL_DIR=${MODEL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tokenstream/models/random-${SHAPE}}
export WORK=${WORK:-$(mktemp -d)}
VLLM=${VLLM:-1}
export HF_HUB_DISABLE_PROGRESS_BARS=1 TQDM_DISABLE=1
T="timeout ${STAGE_TIMEOUT:-0}"  # seconds per stage (0: none), for a GPU lent for minutes

$T "$PY" -m bench.gpu_engine engine || echo "engine stage stopped (rc $?): reporting the modes it finished"
$T "$PY" -m bench.gpu_engine agreement || echo "{\"skipped\": \"agreement stage failed or timed out (see above)\"}" > "$WORK/agreement.json"
$T "$PY" -m bench.gpu_engine profile || echo "{\"skipped\": \"profile stage failed or timed out (see above)\"}" > "$WORK/profile.json"
$T "$PY" -m bench.gpu_engine transformers || echo "{\"skipped\": \"transformers stage failed or timed out (see above)\"}" > "$WORK/transformers.json"
if [ "$VLLM" = "1" ]; then
  VPY=${VLLM_PY:-$PY}
  if "$VPY" -c "import vllm" 2>/dev/null; then
    VLLM_ENABLE_V1_MULTIPROCESSING=0 $T "$VPY" -m bench.gpu_engine vllm \
      || echo '{"skipped": "vLLM run failed (see above)"}' > "$WORK/vllm.json"
  else
    echo "vLLM: skipped: 'import vllm' fails for $VPY (set VLLM_PY to a python with vLLM installed)"
    echo "{\"skipped\": \"import vllm fails for $VPY\"}" > "$WORK/vllm.json"
  fi
else
  echo '{"skipped": "VLLM=0"}' > "$WORK/vllm.json"
fi
"$PY" -m bench.gpu_engine report
