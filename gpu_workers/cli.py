"""`tokenstream worker`: serve one model from its inference topic. Import-light: torch loads in the
command."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer

VENV_FLAG = "TOKENSTREAM_WORKER_IN_VLLM_VENV"


def worker(
    backend: str = typer.Option(
        None,
        help="transformers (the own engine, default) | vllm (vLLM's engine, run in "
        "vLLM's virtualenv: installed on first use, see gpu_workers/vllm_env.py)",
    ),
    model: str = typer.Option(
        None, help="served model name (topic ts.inference.<model>, group worker.<model>)"
    ),
    model_path: Path = typer.Option(None, help="local Hugging Face model folder (default: offline SmolLM2)"),
    dtype: str = typer.Option(None, help="auto | float32 | bfloat16 | float16"),
    quantization: str = typer.Option(None, help="none | 8bit | 4bit (bitsandbytes nf4)"),
    device: str = typer.Option(None, help="auto | cpu | cuda | cuda:N"),
    device_map: str = typer.Option(None, help="'auto' shards the model across all visible GPUs"),
    kv_blocks: int = typer.Option(None, help="KV pages in the pool (the KV budget)"),
    block_size: int = typer.Option(None, help="tokens per KV page"),
    enforce_eager: bool = typer.Option(
        None, "--enforce-eager", help="vllm backend: skip torch.compile (fast start, slower steps)"
    ),
    tensor_parallel_size: int = typer.Option(
        None, help="vllm backend: shard every layer over this many processes"
    ),
    pipeline_parallel_size: int = typer.Option(
        None, help="vllm backend: split the layers into this many stages"
    ),
    cpu_kernels: bool = typer.Option(
        None,
        "--cpu-kernels/--no-cpu-kernels",
        help="own engine on a CPU: its decode kernel and Llama forward where built (default on)",
    ),
    threads: int = typer.Option(
        None,
        help="CPU threads of the engine's kernels (default: every core; several "
        "workers on one host: each its share)",
    ),
    spin_wait: bool = typer.Option(
        None,
        "--spin-wait/--no-spin-wait",
        help="own engine: its threads spin at "
        "barriers (default; the worker has its cores) or sleep at once (a host shared "
        "with other roles)",
    ),
    max_running: int = typer.Option(None, help="most requests in the running batch"),
    prefill_chunk: int = typer.Option(None, help="most prompt tokens prefilled per step"),
    stream_interval: int = typer.Option(
        None,
        help="write a request's pending text once this many tokens are pending (default 32; 1: every step)",
    ),
    stream_interval_ms: int = typer.Option(
        None,
        help="... or once this many ms have passed since its last chunk (default 20; 0: tokens only)",
    ),
    metrics_port: int = typer.Option(None, help="serve Prometheus metrics on this port"),
    worker_id: str = typer.Option(None, help="name in emitted events (default host-pid)"),
    step_delay: float = typer.Option(None, help="sleep after each step, seconds (throttling, tests)"),
) -> None:
    """Run a GPU worker: iteration-level batching over a dense KV slot pool, fed from Kafka."""
    import asyncio
    import signal

    from gpu_workers.config import WorkerConfig

    given = dict(
        backend=backend,
        model=model,
        model_path=model_path,
        dtype=dtype,
        quantization=quantization,
        device=device,
        device_map=device_map,
        kv_blocks=kv_blocks,
        block_size=block_size,
        enforce_eager=enforce_eager,
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        cpu_kernels=cpu_kernels,
        threads=threads,
        spin_wait=spin_wait,
        max_running=max_running,
        prefill_chunk=prefill_chunk,
        stream_interval=stream_interval,
        stream_interval_ms=stream_interval_ms,
        metrics_port=metrics_port,
        worker_id=worker_id,
        step_delay_s=step_delay,
    )
    if (backend or os.environ.get("TOKENSTREAM_WORKER_BACKEND")) == "vllm":
        _into_vllm_venv(given)
    cfg = WorkerConfig(**{k: v for k, v in given.items() if v is not None})
    if not cfg.spin_wait:  # read once, when torch loads OpenMP (nothing above imports torch)
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

    async def main() -> None:
        from gpu_workers.startup import run_worker

        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await run_worker(cfg, stop)

    asyncio.run(main())


def _into_vllm_venv(given: dict) -> None:
    """Re-execute this command under vLLM's virtualenv (vLLM pins its own torch), with vLLM's CPU
    environment; prepares the venv first when it is not there (minutes, once). Exits with the reason
    when it cannot be had."""
    if os.environ.get(VENV_FLAG) == "1":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise SystemExit(
                f"worker --backend vllm: running under {sys.executable}, which cannot import vllm"
            )
        return
    from gpu_workers.vllm_env import ensure_worker_deps, vllm_dir, vllm_env, vllm_python, worker_ready

    ok, why = worker_ready()
    if not ok:
        print(
            f"worker --backend vllm: preparing vLLM's virtualenv under {vllm_dir()} ({why})",
            file=sys.stderr,
            flush=True,
        )
        ok, why = ensure_worker_deps(lambda m: print(m, file=sys.stderr, flush=True))
    if not ok:
        raise SystemExit(
            f"worker --backend vllm: vLLM's virtualenv is not usable: {why}\n"
            f"(prepare it with `python -m bench.peers vllm`; after a failure remove "
            f"{vllm_dir() / 'failed'} to retry)"
        )
    from gpu_workers.config import WorkerConfig

    cfg = WorkerConfig(**{k: v for k, v in given.items() if v is not None})
    env = vllm_env(ranks=cfg.tensor_parallel_size * cfg.pipeline_parallel_size, share=cfg.threads)
    env[VENV_FLAG] = "1"
    py = str(vllm_python())
    os.execve(py, [py, "-m", "tokenstream.cli", "worker", *sys.argv[sys.argv.index("worker") + 1 :]], env)
