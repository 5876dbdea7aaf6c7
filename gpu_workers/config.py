"""Worker knobs, from TOKENSTREAM_WORKER_* environment variables (CLI options override them)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class WorkerConfig(BaseSettings):
    """Everything one worker process needs besides the Kafka address (common.config)."""

    model_config = SettingsConfigDict(env_prefix="TOKENSTREAM_WORKER_", extra="ignore")

    backend: Literal["transformers", "vllm", "synthetic"] = Field(
        "transformers",
        description="the engine: the own engine over transformers, or vLLM's (in vLLM's virtualenv)",
    )
    model: str = Field("smollm2", description="served model name: the inference topic and consumer group")
    model_path: Path | None = Field(
        None, description="local Hugging Face model folder (default: offline SmolLM2)"
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    quantization: Literal["none", "8bit", "4bit"] = "none"
    device: str = Field("auto", description="cpu, cuda, cuda:1 ... (auto: cuda when present)")
    device_map: str | None = Field(None, description="'auto' shards the model across every visible GPU")

    enforce_eager: bool = Field(
        False,
        description="vllm backend: no torch.compile warm-up (starts in seconds "
        "instead of minutes on a CPU; slower steps); the own engine has nothing to skip",
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="vllm backend: processes each layer is sharded over"
    )
    pipeline_parallel_size: int = Field(1, ge=1, description="vllm backend: stages the layers are split into")
    block_size: int = Field(16, ge=1, description="tokens per KV page")
    kv_blocks: int | None = Field(None, description="KV pages in the pool (default: from kv_memory_fraction)")
    kv_memory_gb: float = Field(1.0, gt=0, description="KV pool size when kv_blocks is not given")
    max_running: int = Field(32, ge=1, description="most requests decoding in one batch")
    max_waiting: int = Field(32, ge=1, description="queued requests before the worker pauses fetching")
    prefill_chunk: int = Field(256, ge=1, description="most prompt tokens prefilled in one step")
    cpu_kernels: bool = Field(
        True,
        description="own engine on a CPU: its decode-attention kernel and, for a "
        "Llama, its own forward on fused kernels, where built (gpu_workers/cpu_kernels.py); "
        "false: SDPA and transformers' forward",
    )
    threads: int | None = Field(
        None,
        ge=1,
        description="CPU threads of the engine's kernels (default: every "
        "core); several workers on one host each take their share of the cores, or "
        "their OpenMP teams spin against each other",
    )
    spin_wait: bool = Field(
        True,
        description="the engine's OpenMP threads spin a while at each barrier before "
        "they sleep (OpenMP's default: the most tokens/s when the worker has its cores to "
        "itself); false: they sleep at once (OMP_WAIT_POLICY=passive), leaving the cores to the "
        "roles beside the worker on a shared host (the local stacks set it: the pipeline's "
        "overhead p50 went from 35.4-35.6 to 25.3-30.4 ms, a saturated worker's tokens/s down 18%)",
    )
    max_model_len: int | None = Field(
        None,
        ge=16,
        description="longest prompt + output, in tokens (default: "
        "the model's context, common.models.context_length)",
    )

    announce_prefixes: bool = Field(
        True,
        description="tell routers on ts.kv.prefixes which conversation "
        "prefixes this worker's KV cache holds (prefix-aware routing)",
    )
    worker_id: str = ""
    metrics_port: int | None = Field(
        None, description="port of /metrics and /health/live, /health/ready (None: no endpoint)"
    )
    broker_stale_s: float = Field(
        5.0, gt=0, description="not ready once the broker has not answered the group check for this long"
    )
    stuck_s: float = Field(
        30.0,
        gt=0,
        description="not ready, and not live, once the engine has made no step "
        "for this long with requests in it",
    )
    health_interval_s: float = Field(
        1.0, gt=0, description="seconds between two checks of the group's standing"
    )
    stream_interval: int = Field(
        32,
        ge=1,
        le=1024,
        description="stream interval, tokens: a request's pending text is written as one chunk once "
        "this many tokens are pending (its first text and its end at once; 1: every step, as vLLM's "
        "default); a request's own `stream_interval` overrides it (gpu_workers/streaming.py)",
    )
    stream_interval_ms: int = Field(
        20,
        ge=0,
        le=10_000,
        description="stream interval, milliseconds: pending text is written once this long has "
        "passed since the request's last chunk (0: tokens only); tokens further apart than this "
        "go out one by one; a request's own `stream_interval_ms` overrides it",
    )
    step_records: bool = Field(
        True,
        description="write a step's chunks of every request on one reply partition as one record "
        "(schemas/steps.py); false: each chunk a record of its own",
    )
    takeover_margin_s: float = Field(5.0, description="look this far before created_at for emitted tokens")
    step_delay_s: float = Field(0.0, ge=0, description="sleep after each step (throttling / failover tests)")
    grammar_timeout_s: float = Field(
        5.0,
        gt=0,
        description="longest wait for an output grammar to compile "
        "(tools, response_format); longer ends the request",
    )
    max_parallel_calls: int = Field(
        2,
        ge=1,
        description="most tool calls in one answer when parallel calls "
        "are allowed (small models repeat a call)",
    )
