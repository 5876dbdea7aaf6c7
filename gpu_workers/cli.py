"""`tokenstream worker`: serve one model from its inference topic. Import-light: torch loads in the command."""

from __future__ import annotations

from pathlib import Path

import typer


def worker(
    model: str = typer.Option(None, help="served model name (topic ts.inference.<model>, group worker.<model>)"),
    model_path: Path = typer.Option(None, help="local Hugging Face model folder (default: offline SmolLM2)"),
    dtype: str = typer.Option(None, help="auto | float32 | bfloat16 | float16"),
    quantization: str = typer.Option(None, help="none | 8bit | 4bit (bitsandbytes nf4)"),
    device: str = typer.Option(None, help="auto | cpu | cuda | cuda:N"),
    device_map: str = typer.Option(None, help="'auto' shards the model across all visible GPUs"),
    kv_blocks: int = typer.Option(None, help="KV pages in the pool (the KV budget)"),
    block_size: int = typer.Option(None, help="tokens per KV page"),
    max_running: int = typer.Option(None, help="most requests in the running batch"),
    prefill_chunk: int = typer.Option(None, help="most prompt tokens prefilled per step"),
    metrics_port: int = typer.Option(None, help="serve Prometheus metrics on this port"),
    worker_id: str = typer.Option(None, help="name in emitted events (default host-pid)"),
    step_delay: float = typer.Option(None, help="sleep after each step, seconds (throttling, tests)"),
) -> None:
    """Run a GPU worker: iteration-level batching over a paged KV cache, fed from Kafka."""
    import asyncio
    import signal

    from gpu_workers.config import WorkerConfig

    given = dict(model=model, model_path=model_path, dtype=dtype, quantization=quantization, device=device,
                 device_map=device_map, kv_blocks=kv_blocks, block_size=block_size, max_running=max_running,
                 prefill_chunk=prefill_chunk, metrics_port=metrics_port, worker_id=worker_id,
                 step_delay_s=step_delay)
    cfg = WorkerConfig(**{k: v for k, v in given.items() if v is not None})

    async def main() -> None:
        from gpu_workers.startup import run_worker

        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await run_worker(cfg, stop)

    asyncio.run(main())
