"""Prometheus metrics of one worker, under vLLM's names where vLLM has one.

Each worker process serves its own registry on --metrics-port; `model_name` is the label
vLLM uses. Colons are legal in Prometheus metric names, so vLLM's `vllm:` prefix is kept.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
_LONG = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


class WorkerMetrics:
    def __init__(self, model: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.model = model
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token (from request arrival)",
            labels,
            buckets=_LATENCY,
            registry=r,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between successive output tokens",
            labels,
            buckets=_LATENCY,
            registry=r,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to completion", labels, buckets=_LONG, registry=r
        )
        self.queue = Histogram(
            "vllm:request_queue_time_seconds",
            "Time waiting before admission",
            labels,
            buckets=_LONG,
            registry=r,
        )
        self.prefill = Histogram(
            "vllm:request_prefill_time_seconds", "Admission to first token", labels, buckets=_LONG, registry=r
        )
        self.decode = Histogram(
            "vllm:request_decode_time_seconds", "First token to completion", labels, buckets=_LONG, registry=r
        )
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch", labels, registry=r)
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Requests admitted to the worker, waiting", labels, registry=r
        )
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc", "Fraction of KV pages in use (0-1)", labels, registry=r
        )
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefilled prompt tokens", labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens", labels, registry=r)
        self.finished_total = Counter(
            "vllm:request_success",
            "Finished requests by reason",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.takeovers = Counter(
            "tokenstream_worker_takeovers",
            "Requests resumed from another worker's tokens",
            labels,
            registry=r,
        )
        self.commits = Counter(
            "tokenstream_worker_offset_commits", "Offset commits to the inference topic", labels, registry=r
        )
        self.step_seconds = Histogram(
            "tokenstream_worker_step_seconds",
            "Duration of one engine step",
            labels,
            buckets=_LATENCY,
            registry=r,
        )

    # engine hooks
    def engine_state(self, running: int, waiting: int, kv: float) -> None:
        self.running.labels(self.model).set(running)
        self.waiting.labels(self.model).set(waiting)
        self.kv_usage.labels(self.model).set(kv)

    def scheduled(self, seq) -> None:
        self.queue.labels(self.model).observe(max(0.0, seq.scheduled_at - seq.arrival))
        self.prompt_tokens.labels(self.model).inc(len(seq.prompt_ids) + len(seq.generated))

    def token(self, seq, now: float) -> None:
        self.generation_tokens.labels(self.model).inc()
        if seq.first_token_at is None:
            self.ttft.labels(self.model).observe(max(0.0, now - seq.arrival))
        elif seq.last_token_at is not None:
            self.itl.labels(self.model).observe(now - seq.last_token_at)

    def finished(self, seq) -> None:
        _queue, prefill, decode = seq.timings()
        self.e2e.labels(self.model).observe(max(0.0, (seq.finished_at or 0) - seq.arrival))
        self.prefill.labels(self.model).observe(prefill)
        self.decode.labels(self.model).observe(decode)
        self.finished_total.labels(self.model, seq.finish_reason or "aborted").inc()
