"""`tokenstream bench pipeline`: what the whole chain adds to a request's time to first token.

One run against a throwaway Kafka and Redis and every real role as its own process: the
conversation, safety and router processors, a SmolLM2 worker and two gateway instances, one per
screening order (`serial`: the input check finishes before the request is routed; `parallel`:
the request is routed at once and its answer held back until the verdict arrives). Requests go
one at a time, alternating between the two gateways, so both orders are measured side by side on
the same machine in the same minutes.

For each request:
  client TTFT    request sent -> first content chunk received (the client's clock)
  worker TTFT    the worker's own queue + prefill time, from the request's Completion
  overhead       client TTFT - worker TTFT: everything the pipeline adds (HTTP, five broker hops,
                 three processors with the input classifier, fan-out and SSE)
and each hop's share from the broker's record timestamps (all processes share this host's clock):
gateway (sent -> ts.chat.requests), conversation (-> ts.requests.prepared), safety
(-> ts.requests.screened, serial only), router (-> ts.inference.<model>), worker (-> first
ts.tokens record) and delivery (-> the client). Results go to bench/results/pipeline.json.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import typer

RESULTS = Path(__file__).parent / "results" / "pipeline.json"
MODEL = "smollm2"
MODES = ("serial", "parallel")
HOPS = ("gateway", "conversation", "safety", "router", "worker", "delivery")


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))], 2)


def main(
    requests: int = typer.Option(40, help="measured requests per screening order (after warm-up)"),
    max_tokens: int = typer.Option(4, help="tokens per answer (only the first one is timed)"),
    out: Path = typer.Option(RESULTS, help="where the JSON results go"),
) -> None:
    """Client TTFT through every role against the worker's own TTFT, serial and parallel screening."""
    import asyncio

    result = asyncio.run(_run(requests, max_tokens))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    _table(result)
    print(f"written to {out}")


async def _run(requests: int, max_tokens: int) -> dict:
    import tempfile

    from bench.system import LocalSystem

    tmp = Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    async with LocalSystem(tmp, MODEL, gateways={mode: {"TOKENSTREAM_GATEWAY_SCREENING": mode}
                                                 for mode in MODES}) as system:
        timeline = await system.timeline()
        samples: dict[str, list[dict]] = {mode: [] for mode in MODES}
        warm = 3
        for i in range(warm + requests):
            for mode in MODES:
                rid, sent, first = await system.stream_one(mode, f"Say the number {i} in words.", max_tokens)
                if i >= warm:
                    samples[mode].append({"rid": rid, "sent": sent, "first": first})
            print(f"\rrequests: {(i + 1) * len(MODES)}/{(warm + requests) * len(MODES)}", end="", flush=True)
        print()
        await timeline.settle([s["rid"] for ms in samples.values() for s in ms])
        by_mode = {mode: _summarise(samples[mode], timeline) for mode in MODES}
    return {
        "command": f"tokenstream bench pipeline --requests {requests} --max-tokens {max_tokens}",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_average_1m_at_end": round(os.getloadavg()[0], 2),
                    "note": "every role, the broker and the client share this host (loopback)"},
        "modes": by_mode,
        "targets": {"overhead_p50_ms": 30, "overhead_p99_ms": 100},
    }


def _summarise(samples: list[dict], timeline) -> dict:
    client, worker, overhead = [], [], []
    hops: dict[str, list[float]] = {h: [] for h in HOPS}
    for s in samples:
        marks = timeline.marks.get(s["rid"], {})
        done = marks.get("completion")
        if s["first"] is None or done is None:
            continue
        own = done.timings.queue_s + done.timings.prefill_s
        ttft = s["first"] - s["sent"]
        client.append(ttft * 1000)
        worker.append(own * 1000)
        overhead.append((ttft - own) * 1000)
        points = [("gateway", "chat"), ("conversation", "prepared"), ("safety", "screened"),
                  ("router", "inference"), ("worker", "first_token")]
        last = s["sent"]
        for hop, mark in points:
            if mark in marks:
                hops[hop].append((marks[mark] - last) * 1000)
                last = marks[mark]
        hops["delivery"].append((s["first"] - last) * 1000)
    return {
        "requests": len(overhead),
        "client_ttft_ms": {"p50": pct(client, 50), "p99": pct(client, 99)},
        "worker_ttft_ms": {"p50": pct(worker, 50), "p99": pct(worker, 99)},
        "overhead_ms": {"p50": pct(overhead, 50), "p90": pct(overhead, 90), "p99": pct(overhead, 99),
                        "max": pct(overhead, 100)},
        "hop_p50_ms": {h: pct(v, 50) for h, v in hops.items() if v},
    }


def _table(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table("screening", "requests", "client TTFT p50/p99", "worker TTFT p50/p99",
                  "overhead p50/p90/p99 ms", *(f"{h} p50" for h in HOPS),
                  title="pipeline overhead (client TTFT - worker TTFT), ms")
    for mode, m in r["modes"].items():
        o = m["overhead_ms"]
        table.add_row(mode, str(m["requests"]),
                      f"{m['client_ttft_ms']['p50']} / {m['client_ttft_ms']['p99']}",
                      f"{m['worker_ttft_ms']['p50']} / {m['worker_ttft_ms']['p99']}",
                      f"{o['p50']} / {o['p90']} / {o['p99']}",
                      *(str(m["hop_p50_ms"].get(h, "-")) for h in HOPS))
    Console().print(table)
    s, p = r["modes"]["serial"]["overhead_ms"], r["modes"]["parallel"]["overhead_ms"]
    if s["p50"] and p["p50"]:
        print(f"parallel / serial overhead: p50 {p['p50'] / s['p50']:.2f}x, p99 {p['p99'] / s['p99']:.2f}x "
              f"(targets: p50 <= {r['targets']['overhead_p50_ms']} ms, p99 <= {r['targets']['overhead_p99_ms']} ms)")
    print(f"load average (1 min) at the end: {r['machine']['load_average_1m_at_end']}")
