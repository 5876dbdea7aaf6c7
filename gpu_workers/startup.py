"""A worker's start: load the model, build the KV pool and the engine on the torch thread (or, with
`backend="vllm"`, vLLM's engine: gpu_workers/backend_vllm.py), check the topics, then serve (`Worker`
in service.py) until stopped. The health endpoint answers from the moment the model is loaded; it
reports ready once the consumer holds partitions."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time

import torch

from common import tracing
from common.config import settings
from common.health import HealthServer
from common.models import context_length
from gpu_workers import model_loader
from gpu_workers.config import WorkerConfig
from gpu_workers.engine import Engine
from gpu_workers.health import WorkerHealth
from gpu_workers.kv_cache import KVBudget
from gpu_workers.metrics import WorkerMetrics
from gpu_workers.service import Worker
from gpu_workers.torch_thread import on_torch_thread
from topics import CONTROL, SHADOW_ANSWERS, TOKENS, TOOL_CALLS, inference_topic
from topics.admin import require

log = logging.getLogger(__name__)


def needed_topics(model: str) -> list:
    """Every topic a worker of `model` writes or reads; it checks at start that each exists."""
    return [inference_topic(model), TOKENS, CONTROL, TOOL_CALLS, SHADOW_ANSWERS]


async def run_worker(
    cfg: WorkerConfig,
    stop: asyncio.Event | None = None,
    *,
    loaded=None,
    bootstrap: str | None = None,
    on_ready=None,
) -> None:
    """Load the model (unless given), build the engine and serve until `stop` is set. The metrics and
    health endpoint answers once the model is loaded (not ready until the consumer holds partitions)."""
    stop = stop or asyncio.Event()
    bootstrap = bootstrap or settings().kafka_bootstrap
    metrics = WorkerMetrics(cfg.model)
    health = WorkerHealth(cfg)
    server: HealthServer | None = None
    try:
        if cfg.backend == "vllm":
            health.phase = "starting vLLM"
            engine = await waited(
                on_torch_thread(_vllm_engine, cfg, metrics),
                "vLLM's engine to start (a first start on a cold compile cache compiles its graphs: minutes; "
                "`make vllm-venv` warms that cache)",
                log.info,
            )
            if cfg.metrics_port:
                server = HealthServer(cfg.metrics_port, health.report, metrics.registry)
            log.info(
                "worker: backend=vllm model=%s dtype=%s context=%d max_num_seqs=%d max_num_batched_tokens=%d "
                "kv=%s GiB metrics=%s",
                cfg.model,
                engine.dtype,
                engine.max_model_len,
                engine.max_running,
                engine.prefill_chunk,
                os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
                cfg.metrics_port or "off",
            )
        elif cfg.backend == "synthetic":  # `tokenstream bench tokens`' stand-in for a GPU, never served
            from gpu_workers.backend_synthetic import synthetic_engine

            engine = synthetic_engine(cfg, metrics)
            if cfg.metrics_port:
                server = HealthServer(cfg.metrics_port, health.report, metrics.registry)
        else:
            engine, server = await _own_engine(cfg, metrics, health, loaded)
        tracing.setup("worker")
        # only checked: topics are the operator's (`tokenstream topics apply`), a worker never rewrites them
        await require(needed_topics(cfg.model), bootstrap)
        health.phase = f"joining group worker.{cfg.model}"
        worker = Worker(cfg, engine, metrics, bootstrap, health)
        if on_ready is not None:
            asyncio.get_running_loop().create_task(_when_ready(worker, on_ready))
        await worker.run(stop)
    finally:
        if server is not None:
            server.close()


async def _own_engine(cfg: WorkerConfig, metrics: WorkerMetrics, health: WorkerHealth, loaded):
    """The transformers backend: the model, its KV pool and the own engine, all on the torch thread."""
    server = None
    vllm_only = [
        name
        for name, given in (
            ("--enforce-eager", cfg.enforce_eager),
            ("--tensor-parallel-size", cfg.tensor_parallel_size > 1),
            ("--pipeline-parallel-size", cfg.pipeline_parallel_size > 1),
        )
        if given
    ]
    if vllm_only:  # (the own engine shards a model over GPUs with --device-map auto)
        raise SystemExit(
            f"worker: {', '.join(vllm_only)}: vLLM options (--backend vllm), not the own engine's"
        )
    if cfg.threads:  # before the first parallel region: the torch thread's team is this size from the start
        await on_torch_thread(torch.set_num_threads, cfg.threads)
    if loaded is None:
        loaded = await on_torch_thread(
            model_loader.load,
            cfg.model,
            cfg.model_path,
            cfg.dtype,
            cfg.quantization,
            cfg.device,
            cfg.device_map,
        )
    # the pool's allocation and the engine's construction (packing the linears) open parallel regions:
    # on the torch thread, like every step (gpu_workers/torch_thread.py)
    cache = await on_torch_thread(
        KVBudget.for_model, loaded.model, cfg.kv_blocks, cfg.block_size, cfg.kv_memory_gb
    )
    health.phase = "building the engine"
    if cfg.metrics_port:  # (its port answering means the model is loaded, as it always has)
        server = HealthServer(cfg.metrics_port, health.report, metrics.registry)
    context = (
        cfg.max_model_len
        or context_length(cfg.model, cfg.model_path)
        or loaded.model.config.max_position_embeddings
    )
    if cache.capacity_tokens < context:
        log.warning(
            "worker: the KV pool holds %d tokens, less than the %d-token context: longer prompts "
            "are refused here although the conversation processor lets them through",
            cache.capacity_tokens,
            context,
        )
    engine = await on_torch_thread(
        Engine,
        loaded.model,
        loaded.tokenizer,
        cache,
        max_running=cfg.max_running,
        prefill_chunk=cfg.prefill_chunk,
        max_model_len=context,
        metrics=metrics,
        cpu_kernels=cfg.cpu_kernels,
    )
    log.info(
        "worker: device=%s model=%s (%s, %.1fM params) dtype=%s quantization=%s "
        "kv budget=%d pages x %d tokens = %d tokens (%.1f MiB) context=%d max_running=%d prefill_chunk=%d "
        "decode kernel=%s own llama forward=%s threads=%d spin_wait=%s metrics=%s",
        loaded.device,
        cfg.model,
        loaded.source,
        loaded.params / 1e6,
        loaded.dtype,
        loaded.quantization,
        cache.allocator.num_blocks,
        cache.block_size,
        cache.capacity_tokens,
        cache.nbytes() / 2**20,
        engine.max_model_len,
        cfg.max_running,
        cfg.prefill_chunk,
        "on" if engine.decode_kernel else "off",
        "on" if engine.llama_step is not None else "off",
        await on_torch_thread(torch.get_num_threads),
        os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE",
        cfg.metrics_port or "off",
    )
    return engine, server


def _vllm_engine(cfg: WorkerConfig, metrics: WorkerMetrics):
    """The vLLM backend (gpu_workers/backend_vllm.py), built on the torch thread. Options that have no
    meaning for vLLM are refused rather than ignored."""
    from common.models import model_folder
    from gpu_workers.backend_vllm import VllmEngine

    refused = [
        name
        for name, given in (
            ("--quantization", cfg.quantization != "none"),
            ("--device-map", cfg.device_map is not None),
            ("--kv-blocks", cfg.kv_blocks is not None),
            ("--no-cpu-kernels", not cfg.cpu_kernels),
        )
        if given
    ]
    if refused:
        raise SystemExit(
            f"worker --backend vllm: {', '.join(refused)} not supported with vLLM "
            "(its KV budget is TOKENSTREAM_WORKER_KV_MEMORY_GB, in whole GiB)"
        )
    if cfg.device not in ("auto", "cpu"):
        raise SystemExit(
            f"worker --backend vllm: device {cfg.device!r}: the vLLM installed here is its CPU build"
        )
    folder = cfg.model_path or model_folder(cfg.model) or model_loader.smollm2_dir()
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(
        max(1, math.ceil(cfg.kv_memory_gb))
    )  # read when the engine starts
    context = cfg.max_model_len or context_length(cfg.model, cfg.model_path) or 2048
    dtype = cfg.dtype  # "auto": vLLM's choice (on a CPU with bf16 support, bfloat16 for an fp32 model)
    # vLLM's own batch limits and page size unless they are asked for (its CPU kernels want pages of a
    # multiple of 32 tokens; the own engine's defaults are no vLLM user's)
    asked = cfg.model_fields_set
    return VllmEngine(
        folder,
        dtype=dtype,
        max_running=cfg.max_running if "max_running" in asked else None,
        prefill_chunk=cfg.prefill_chunk if "prefill_chunk" in asked else None,
        max_model_len=context,
        metrics=metrics,
        block_size=cfg.block_size if "block_size" in asked else None,
        enforce_eager=cfg.enforce_eager,
        tensor_parallel_size=cfg.tensor_parallel_size,
        pipeline_parallel_size=cfg.pipeline_parallel_size,
    )


async def waited(aw, what: str, say, every: float = 15.0, done: asyncio.Event | None = None):
    """Await `aw` (or, given `done`, until `done` is set or `aw` ends, whichever is first), saying every
    `every` seconds what is awaited and for how long so far. No time limit: a start that compiles for
    minutes is waited for; one that fails ends the wait with its error."""
    task = asyncio.ensure_future(aw)
    waits = {task} if done is None else {task, asyncio.ensure_future(done.wait())}
    t0 = time.monotonic()
    try:
        while True:
            finished, _ = await asyncio.wait(waits, timeout=every, return_when=asyncio.FIRST_COMPLETED)
            if task in finished:
                return task.result()
            if finished:  # `done` was set
                return None
            say(f"worker: waiting for {what}: {time.monotonic() - t0:.0f} s so far")
    finally:
        for w in waits - {task}:
            w.cancel()


async def _when_ready(worker: Worker, on_ready) -> None:
    await worker.ready.wait()
    on_ready(worker)
