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
        m = self.model
        self._ttft, self._itl, self._e2e = self.ttft.labels(m), self.itl.labels(m), self.e2e.labels(m)
        self._queue, self._prefill, self._decode = (
            self.queue.labels(m),
            self.prefill.labels(m),
            self.decode.labels(m),
        )
        self._running, self._waiting = self.running.labels(m), self.waiting.labels(m)
        self._kv_usage, self._prompt_tokens = self.kv_usage.labels(m), self.prompt_tokens.labels(m)
        self._generation_tokens = self.generation_tokens.labels(m)

    # engine hooks (the label's children looked up once: these run every step)
    def engine_state(self, running: int, waiting: int, kv: float) -> None:
        self._running.set(running)
        self._waiting.set(waiting)
        self._kv_usage.set(kv)

    def scheduled(self, seq) -> None:
        self._queue.observe(max(0.0, seq.scheduled_at - seq.arrival))
        self._prompt_tokens.inc(len(seq.prompt_ids) + len(seq.generated))

    def latency(self, seq, now: float) -> None:
        """A step brought `seq` new tokens at `now` (before its first_token_at / last_token_at move):
        its time to first token, or the time since its previous step's tokens."""
        if seq.first_token_at is None:
            self._ttft.observe(max(0.0, now - seq.arrival))
        elif seq.last_token_at is not None:
            self._itl.observe(now - seq.last_token_at)

    def generated(self, n: int) -> None:
        """A step's generated tokens, all requests together."""
        if n:
            self._generation_tokens.inc(n)

    def finished(self, seq) -> None:
        _queue, prefill, decode = seq.timings()
        self._e2e.observe(max(0.0, (seq.finished_at or 0) - seq.arrival))
        self._prefill.observe(prefill)
        self._decode.observe(decode)
        self.finished_total.labels(self.model, seq.finish_reason or "aborted").inc()
