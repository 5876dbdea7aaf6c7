"""`tokenstream plan`: workers, partitions, gateways and cost from measured throughput, with the arithmetic.

The way a capacity plan is done from a benchmark: demand in tokens per second over what one
worker sustains, with headroom; the latency target then limits how busy a worker may run.

    demand      D = rps x (prompt + output) tokens/s
    capacity    C = tokens (prompt + output) one worker processes per second, from `bench worker`
                (its prompts and outputs over its wall time; a prompt token is counted like an
                output token, which overstates prefill cost on a GPU: give --worker-tokens-per-s)
    TTFT        the benchmark's TTFT p99 was measured at utilisation u_b = its demand / C; TTFT grows
                with the batch a step carries, so the utilisation allowed is u = min(target,
                u_b x SLO / TTFT_p99), and never above the target
    workers     N = ceil(D / (C x u))
    partitions  the worker group's topic needs >= N partitions, and 2N to scale out without regrowing
    gateways    concurrent streams (Little's law: rps x stream duration) / streams one gateway held
    cost        N x price per worker-hour; per million requests = hourly cost / (rps x 3600) x 1e6
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

WORKER_RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results" / "worker.json"
GATEWAY_RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results" / "gateway.json"
WORKER_COLUMN = "worker via Kafka"


@dataclass
class Measured:
    """What `bench worker` and `bench gateway` measured (or what the operator gives instead)."""

    tokens_per_s: float  # prompt + output tokens one worker processes per second
    output_tokens_per_s: float
    ttft_p99_s: float
    itl_p50_s: float
    utilisation: float  # of the benchmark's worker during the run
    streams_per_gateway: int
    source: str

    @classmethod
    def from_bench(cls, worker: Path = WORKER_RESULTS, gateway: Path = GATEWAY_RESULTS) -> Measured:
        data = json.loads(worker.read_text())
        result = data["results"][WORKER_COLUMN]
        requests = data["workload"]["requests_detail"]
        prompt = sum(r["prompt_ids"] for r in requests)
        total = (prompt + result["tokens"]) / result["wall_s"]
        arrivals = max(r["arrival"] for r in requests)
        offered = (prompt + result["tokens"]) / arrivals  # tokens/s the benchmark asked for
        streams = 1000
        if gateway.exists():
            streams = json.loads(gateway.read_text())["fanout"]["streams_open"]
        return cls(
            total,
            result["throughput_tok_s"],
            result["ttft_p99_s"],
            result["itl_p50_s"],
            min(1.0, offered / total),
            streams,
            f"{worker.name} ({WORKER_COLUMN}), {gateway.name}",
        )


@dataclass
class Plan:
    workers: int
    partitions: int
    gateways: int
    hourly_cost: float | None
    cost_per_million: float | None
    utilisation: float
    lines: list[tuple[str, str, str]] = field(default_factory=list)  # (quantity, arithmetic, value)


def plan(
    rps: float,
    prompt_tokens: int,
    output_tokens: int,
    ttft_slo_s: float,
    m: Measured,
    target_utilisation: float = 0.7,
    price_per_worker_hour: float | None = None,
) -> Plan:
    if rps <= 0 or prompt_tokens < 0 or output_tokens < 1 or ttft_slo_s <= 0:
        raise ValueError("need rps > 0, prompt tokens >= 0, output tokens >= 1 and a TTFT SLO > 0")
    lines = []
    demand = rps * (prompt_tokens + output_tokens)
    lines.append(
        ("demand D", f"{rps:g} rps x ({prompt_tokens} + {output_tokens}) tokens", f"{demand:,.1f} tokens/s")
    )
    lines.append(("worker capacity C", f"measured ({m.source})", f"{m.tokens_per_s:,.1f} tokens/s"))
    allowed = m.utilisation * ttft_slo_s / m.ttft_p99_s
    u = min(target_utilisation, allowed)
    lines.append(
        (
            "utilisation allowed",
            (
                f"min(target {target_utilisation:g}, measured u_b {m.utilisation:.2f} x SLO "
                f"{ttft_slo_s:g} s / TTFT p99 {m.ttft_p99_s:.2f} s = {allowed:.2f})"
            ),
            f"{u:.2f}",
        )
    )
    workers = max(1, math.ceil(demand / (m.tokens_per_s * u)))
    lines.append(("workers N", f"ceil({demand:,.1f} / ({m.tokens_per_s:,.1f} x {u:.2f}))", str(workers)))
    partitions = max(12, 2 * workers)
    lines.append(("partitions", f"max(12, 2 x {workers}) (N <= partitions; room to double)", str(partitions)))
    duration = m.ttft_p99_s + output_tokens * m.itl_p50_s
    concurrent = rps * duration
    gateways = max(1, math.ceil(concurrent / m.streams_per_gateway))
    lines.append(
        (
            "concurrent streams",
            f"{rps:g} rps x ({m.ttft_p99_s:.2f} + {output_tokens} x {m.itl_p50_s:.3f}) s",
            f"{concurrent:,.0f}",
        )
    )
    lines.append(
        (
            "gateways",
            f"ceil({concurrent:,.0f} / {m.streams_per_gateway:,} streams measured per gateway)",
            str(gateways),
        )
    )
    hourly = per_million = None
    if price_per_worker_hour is not None:
        hourly = workers * price_per_worker_hour
        per_million = hourly / (rps * 3600) * 1e6
        lines.append(("cost per hour", f"{workers} x {price_per_worker_hour:g}", f"{hourly:,.2f}"))
        lines.append(
            ("cost per million requests", f"{hourly:,.2f} / ({rps:g} x 3600) x 1e6", f"{per_million:,.2f}")
        )
    if allowed < 0.05:
        lines.append(
            (
                "warning",
                f"TTFT SLO {ttft_slo_s:g} s is far below the measured p99 {m.ttft_p99_s:.2f} s",
                "faster workers needed",
            )
        )
    return Plan(workers, partitions, gateways, hourly, per_million, u, lines)
