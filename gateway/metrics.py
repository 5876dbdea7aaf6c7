"""Prometheus metrics of one gateway instance (served at /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from gateway import replays


class ResumeReads:
    """The resumes' readers (gateway/replays.py), counted where they count them, read at each scrape."""

    def collect(self):
        t = replays.totals()
        yield CounterMetricFamily(
            "gateway_resume_readers_started", "consumers started to read resumes", value=t.consumers_started
        )
        yield CounterMetricFamily(
            "gateway_resume_records_read", "ts.tokens records read for resumes", value=t.records_read
        )
        yield CounterMetricFamily(
            "gateway_resume_seeks", "seeks of the resumes' readers", value=t.seeks_total
        )
        starts = CounterMetricFamily(
            "gateway_resume_starts",
            "resumes by where their reading started: their request's first record (noted when written) "
            "or, without a note, its admission time",
            labels=["start"],
        )
        starts.add_metric(["first_record"], t.exact)
        starts.add_metric(["admission"], t.fallback)
        yield starts


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "gateway_requests_total",
            "chat completion requests by outcome",
            ["model", "stream", "status"],
            registry=r,
        )
        self.lag = Gauge(
            "gateway_admission_lag",
            "consumer lag of the model's worker group (requests)",
            ["model"],
            registry=r,
        )
        self.drain_rate = Gauge(
            "gateway_admission_drain_rate",
            "requests per second the worker group takes",
            ["model"],
            registry=r,
        )
        self.estimated_wait = Gauge(
            "gateway_admission_estimated_wait_seconds",
            "lag / drain rate at the last admission decision",
            ["model"],
            registry=r,
        )
        self.rejections = Counter(
            "gateway_admission_rejections_total", "requests refused with 429", ["model"], registry=r
        )
        self.active_streams = Gauge(
            "gateway_active_streams", "connections waiting on token events", registry=r
        )
        self.token_events = Counter(
            "gateway_token_events_total",
            "token and completion events consumed from owned partitions",
            ["partition"],
            registry=r,
        )
        self.coalesced = Counter(
            "gateway_coalesced_chunks_total",
            "token chunks merged into a pending chunk of a slow client",
            registry=r,
        )
        self.slow_readers = Counter(
            "gateway_slow_readers_dropped_total",
            "streams dropped because their reader fell too far behind (they resume from the log)",
            registry=r,
        )
        self.cancels = Counter("gateway_cancels_total", "cancel events written", ["reason"], registry=r)
        self.resumes = Counter("gateway_resumes_total", "streams resumed with Last-Event-ID", registry=r)
        r.register(ResumeReads())
        self.ttft = Histogram(
            "gateway_ttft_seconds",
            "time from request to first token sent",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.ratelimit_seconds = Histogram(
            "gateway_ratelimit_seconds",
            "rate limiter round trip per request",
            buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05),
            registry=r,
        )
        self.rate_limited = Counter(
            "gateway_rate_limited_total", "requests refused by a rate limit", ["kind"], registry=r
        )
        self.semantic_lookup_seconds = Histogram(
            "gateway_semantic_cache_lookup_seconds",
            "semantic cache: Weaviate query per eligible request",
            buckets=(0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25),
            registry=r,
        )
        self.cache = Counter(
            "gateway_cache_total", "response cache lookups by result", ["cache", "result"], registry=r
        )
        self.home_region = Counter(
            "gateway_home_region_total",
            "requests of keys at home in another region (proxied there, or refused)",
            ["region"],
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
