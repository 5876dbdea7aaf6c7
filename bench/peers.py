"""Peer engines for `tokenstream bench engine`, each in its own virtualenv under the cache dir.

vLLM's recipe lives with the worker that runs it (`gpu_workers/vllm_env.py`: `tokenstream worker
--backend vllm` runs in that venv); this module re-exports it for the benchmark.
Runnable on its own to prepare the venv ahead of a benchmark: `python -m bench.peers vllm` (vLLM, then
the project and the worker's light dependencies in it, then one start of vLLM per configuration the
project starts it in, which builds its compile cache: `make vllm-venv`).
"""

from __future__ import annotations

import sys
import time

from gpu_workers.vllm_env import (  # noqa: F401 - the benchmark's names
    SKIP_REQS,
    VLLM_TORCH,
    VLLM_VERSION,
    ensure_vllm,
    ensure_worker_deps,
    peers_dir,
    vllm_dir,
    vllm_env,
    vllm_python,
    vllm_status,
    warm_vllm,
    worker_ready,
)

if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "vllm"
    if what != "vllm":
        raise SystemExit(f"unknown peer {what!r}")
    say = lambda m: print(time.strftime("%H:%M:%S"), m, flush=True)
    ready, reason = ensure_worker_deps(say)
    if ready:
        ready, reason = warm_vllm(say)
    print("ready" if ready else f"not ready: {reason}")
    raise SystemExit(0 if ready else 1)
