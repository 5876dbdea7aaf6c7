"""`tokenstream bench pipeline`: what the whole chain adds to a request's time to first token.

One run against a throwaway Kafka and Redis and every real role as its own process: the
conversation, safety and router processors, a SmolLM2 worker and two gateway instances, one per
screening order (`serial`: the input check finishes before the request is routed; `parallel`:
the request is routed at once and its answer held back until the verdict arrives). Requests go
one at a time, alternating between the two gateways, so both orders are measured side by side on
the same machine in the same minutes. What is measured is the steady state: the broker is warmed
first (`warm_broker`) and every role by untimed requests, and the client pauses after each answer
(`--think-ms`, as a user reading it would) so that a request does not meet the previous one's
bookkeeping after [DONE] (history, transcript, output verdict, commits) on the same cores.

For each request:
  client TTFT    request sent -> first content chunk received (the client's clock)
  worker TTFT    the worker's own queue + prefill time, from the request's Completion
  overhead       client TTFT - worker TTFT: everything the pipeline adds (HTTP, five broker hops,
                 three processors with the input classifier, fan-out and SSE)
and each hop's share from the broker's record timestamps (all processes share this host's clock),
computed by `audit.hops.hop_times` (what `tokenstream audit` shows per request): gateway (sent ->
ts.chat.requests), conversation (-> ts.requests.prepared), safety (-> ts.requests.screened, serial
only), router (-> ts.inference.<model>), fetch (-> received by the worker, from
Completion.timings.pipeline_s), engine (the worker's own TTFT), publish (-> the first ts.tokens
record) and delivery (-> the client). Results go to bench/results/pipeline.json.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import platform
import time
from pathlib import Path

import typer

from audit.hops import HOPS as ALL_HOPS
from audit.hops import Marks, hop_times
from bench.broker_warmup import WARM_ROUND_TRIPS, warm_broker
from bench.rawhttp import chat_post, first_token
from bench.stats import nearest_rank

log = logging.getLogger(__name__)
RESULTS = Path(__file__).parent / "results" / "pipeline.json"
MODEL = "smollm2"
MODES = ("serial", "parallel")
HOPS = tuple(h for h in ALL_HOPS if h != "decode")  # shares of the time to first token
WARM_REQUESTS = 20  # untimed requests per screening order before the measured ones


def pct(values: list[float], q: float) -> float | None:
    return round(nearest_rank(values, q), 2) if values else None


def main(
    requests: int = typer.Option(40, help="measured requests per screening order (after warm-up)"),
    max_tokens: int = typer.Option(4, help="tokens per answer (only the first one is timed)"),
    think_ms: float = typer.Option(
        100.0, help="the client's pause after each answer, before its next request"
    ),
    out: Path = typer.Option(RESULTS, help="where the JSON results go"),
    sealing: str = typer.Option(
        "on",
        help="on (as deployed), off, or both: off then on in one run, to show what "
        "sealing tenants' content costs (common/sealing.py)",
    ),
    kafka_security: str = typer.Option(
        "sasl_plaintext",
        help="the throwaway broker's: sasl_plaintext (SCRAM "
        "users and ACLs, as `make run`) or plaintext (no authentication)",
    ),
) -> None:
    """Client TTFT through every role against the worker's own TTFT, serial and parallel screening."""
    import asyncio

    from common.config import settings

    if kafka_security not in ("sasl_plaintext", "plaintext"):
        raise typer.BadParameter("sasl_plaintext or plaintext", param_hint="--kafka-security")
    if sealing not in ("on", "off", "both"):
        raise typer.BadParameter("on, off or both", param_hint="--sealing")
    os.environ["TOKENSTREAM_KAFKA_SECURITY"] = (
        kafka_security  # the stack, its roles and this process's clients
    )
    runs = {}
    for state in ("off", "on") if sealing == "both" else (sealing,):  # off first: this process then installs
        os.environ["TOKENSTREAM_SEALING"] = "true" if state == "on" else "false"  # the second stack's keyring
        settings.cache_clear()
        runs[state] = asyncio.run(_run(requests, max_tokens, think_ms))
        runs[state]["command"] += f" --kafka-security {kafka_security} --sealing {sealing}"
        runs[state]["kafka_security"] = kafka_security
        runs[state]["sealing"] = state
        _table(runs[state])
    result = (
        runs[sealing]
        if sealing != "both"
        else {
            "sealing_off": runs["off"],
            "sealing_on": runs["on"],
            "sealing_cost": _sealing_cost(runs["off"], runs["on"]),
        }
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written to {out}")


def _sealing_cost(off: dict, on: dict) -> dict:
    """What sealing adds (on - off, p50, each screening order): to the client's TTFT, and to the pipeline's
    overhead (client TTFT less the worker's own TTFT: every hop where sealing works, without the engine's
    run-to-run spread); and the codec's own cost per token event."""

    def added(figure: str) -> dict:
        return {
            mode: round(on["modes"][mode][figure]["p50"] - off["modes"][mode][figure]["p50"], 1)
            for mode in MODES
        }

    cost, overhead = added("client_ttft_ms"), added("overhead_ms")
    codec = on.get("codec", {})
    print(
        f"sealing on - off, p50 (ms): client TTFT {cost}, pipeline overhead {overhead} "
        f"(target < 2 ms; the run-to-run spread is a few ms)"
    )
    if codec:
        print(
            f"token event encode+decode: {codec['clear_us']} us clear, {codec['sealed_us']} us sealed "
            f"({codec['ratio']}x): {codec['sealed_and_opened_per_s']:,} token events sealed and opened "
            f"a second on one core"
        )
    return {"client_ttft_p50_added_ms": cost, "overhead_p50_added_ms": overhead, "codec": codec}


def _codec_cost(n: int = 20_000) -> dict:
    """Microseconds to encode and decode one token chunk, clear and sealed (this process's keyring)."""
    from schemas import TokenChunk, decode, encode
    from schemas.codec import sealer, use_sealer

    keys = sealer()
    chunk = TokenChunk(
        request_id="r" * 32, tenant="bench", conversation_id="c" * 32, seq=7, text=" word", token_ids=[1234]
    )
    figures = {}
    for name, using in (("clear", None), ("sealed", keys)):
        use_sealer(using)
        decode(encode(chunk), TokenChunk)
        started = time.perf_counter()
        for _ in range(n):
            decode(encode(chunk), TokenChunk)
        figures[name] = (time.perf_counter() - started) / n * 1e6
    use_sealer(keys)
    return {
        "clear_us": round(figures["clear"], 1),
        "sealed_us": round(figures["sealed"], 1),
        "ratio": round(figures["sealed"] / figures["clear"], 2),
        "sealed_and_opened_per_s": int(1e6 / figures["sealed"]),
    }


async def _run(requests: int, max_tokens: int, think_ms: float) -> dict:
    import tempfile

    from tokenstream.stack.local import LocalSystem

    tmp = Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    async with LocalSystem(
        tmp, MODEL, gateways={mode: {"TOKENSTREAM_GATEWAY_SCREENING": mode} for mode in MODES}
    ) as system:
        from common import sealing

        sealing.install(system.stack.redis.address)  # this process reads the roles' sealed events (if on)
        await warm_broker(system.stack.kafka.address)
        timeline = await Timeline(system.stack.kafka.address, MODEL).start()
        samples: dict[str, list[dict]] = {mode: [] for mode in MODES}
        warm = WARM_REQUESTS
        for i in range(warm + requests):
            for mode in MODES:
                port = system.ports[mode]
                rid, sent, first = await first_token(
                    port,
                    chat_post(
                        port,
                        {
                            "model": MODEL,
                            "stream": True,
                            "max_tokens": max_tokens,
                            "temperature": 0,
                            "messages": [{"role": "user", "content": f"Say the number {i} in words."}],
                        },
                        key=system.key,
                    ),
                )
                if i >= warm:
                    samples[mode].append({"rid": rid, "sent": sent, "first": first})
                # a user reads the answer before asking again: the pipeline's work after [DONE] (the
                # history and transcript, the output verdict, commits, the gateway's cache and usage
                # notes, some 10-30 ms on these cores) is not timed against the next request
                await asyncio.sleep(think_ms / 1000)
            if (i + 1) % 10 == 0:
                print(f"requests: {(i + 1) * len(MODES)}/{(warm + requests) * len(MODES)}", flush=True)
        await timeline.settle([s["rid"] for ms in samples.values() for s in ms])
        await timeline.stop()
        by_mode = {mode: _summarise(samples[mode], timeline) for mode in MODES}
        from schemas.codec import sealer

        codec = _codec_cost() if sealer() is not None else {}
    return {
        "codec": codec,
        "command": (
            f"tokenstream bench pipeline --requests {requests} --max-tokens {max_tokens} "
            f"--think-ms {think_ms:g}"
        ),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_average_1m_at_end": round(os.getloadavg()[0], 2),
            "note": "every role, the broker and the client share this host (loopback)",
        },
        "warm_up": {
            "broker_round_trips": WARM_ROUND_TRIPS,
            "requests_per_order": WARM_REQUESTS,
            "why": "steady state: a broker started seconds before serves its first produce and fetch "
            "requests interpreted (about 4 ms a round trip on this host, 1.8-2.4 ms once compiled)",
        },
        "modes": by_mode,
        "targets": {"overhead_p50_ms": 30, "overhead_p99_ms": 100},
    }


class Timeline:
    """When each request's events reached the broker: record timestamps of every hop's topic."""

    def __init__(self, bootstrap: str, model: str) -> None:
        from topics import CHAT_REQUESTS, PREPARED, SCREENED, TOKENS, inference_topic

        self.bootstrap = bootstrap
        self.marks: dict[str, Marks] = {}
        self.topics = {
            CHAT_REQUESTS.name: "chat",
            PREPARED.name: "prepared",
            SCREENED.name: "screened",
            inference_topic(model).name: "inference",
            TOKENS.name: "tokens",
        }

    async def start(self) -> Timeline:
        from aiokafka.structs import TopicPartition

        from producers import start_consumer

        self.consumer = await start_consumer(group=None, bootstrap=self.bootstrap)
        from topics.registry import spec_for

        tps = [TopicPartition(t, p) for t in self.topics for p in range(spec_for(t).partitions)]
        self.consumer.assign(tps)
        await self.consumer.seek_to_end(*tps)
        for tp in tps:
            await self.consumer.position(tp)
        self._task = asyncio.create_task(self._run())
        return self

    async def _run(self) -> None:
        from producers.publish import decode_record
        from schemas import ChatRequest, Completion, TokenChunk
        from schemas.steps import unpack_all
        from topics.registry import spec_for

        while True:
            for tp, records in (await self.consumer.getmany(timeout_ms=100)).items():
                spec = spec_for(tp.topic)
                for record in unpack_all(records):  # a step record: its chunks, in order
                    try:
                        event = decode_record(record, spec)
                    except Exception as exc:  # noqa: BLE001 - not ours to judge here
                        log.debug("timeline: %s@%d not decoded: %s", tp, record.offset, exc)
                        continue
                    marks = self.marks.setdefault(event.request_id, Marks())
                    name = self.topics[tp.topic]
                    if name == "tokens":
                        if isinstance(event, TokenChunk):
                            marks.first("first_token", record.timestamp / 1000)
                        elif isinstance(event, Completion):
                            marks.timings = event.timings
                            marks.first("completion", record.timestamp / 1000)
                    else:
                        if isinstance(event, ChatRequest):
                            marks.admitted = event.created_at
                        marks.first(name, record.timestamp / 1000)

    async def settle(self, rids: list[str], timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while (
            any(getattr(self.marks.get(r), "timings", None) is None for r in rids)
            and time.monotonic() < deadline
        ):
            await asyncio.sleep(0.1)

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self.consumer.stop()


def _summarise(samples: list[dict], timeline: Timeline) -> dict:
    client, worker, overhead = [], [], []
    hops: dict[str, list[float]] = {h: [] for h in HOPS}
    for s in samples:
        marks = timeline.marks.get(s["rid"])
        if s["first"] is None or marks is None or marks.timings is None or marks.first_token is None:
            continue
        own = marks.timings.queue_s + marks.timings.prefill_s
        ttft = s["first"] - s["sent"]
        client.append(ttft * 1000)
        worker.append(own * 1000)
        overhead.append((ttft - own) * 1000)
        for hop, seconds in hop_times(marks, sent=s["sent"], delivered=s["first"], through="first_token"):
            hops[hop].append(seconds * 1000)
    return {
        "requests": len(overhead),
        "client_ttft_ms": {"p50": pct(client, 50), "p99": pct(client, 99)},
        "worker_ttft_ms": {"p50": pct(worker, 50), "p99": pct(worker, 99)},
        "overhead_ms": {
            "p50": pct(overhead, 50),
            "p90": pct(overhead, 90),
            "p99": pct(overhead, 99),
            "max": pct(overhead, 100),
        },
        "hop_p50_ms": {h: pct(v, 50) for h, v in hops.items() if v},
    }


def _table(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=120)
    table = Table(
        "screening",
        "requests",
        "client TTFT p50 / p99",
        "worker TTFT p50 / p99",
        "overhead p50 / p90 / p99",
        title="pipeline overhead = client TTFT - worker TTFT (ms)",
    )
    for mode, m in r["modes"].items():
        o = m["overhead_ms"]
        table.add_row(
            mode,
            str(m["requests"]),
            f"{m['client_ttft_ms']['p50']} / {m['client_ttft_ms']['p99']}",
            f"{m['worker_ttft_ms']['p50']} / {m['worker_ttft_ms']['p99']}",
            f"{o['p50']} / {o['p90']} / {o['p99']}",
        )
    console.print(table)
    hops = Table("screening", *HOPS, title="time to first token by hop, p50 (ms)")
    for mode, m in r["modes"].items():
        hops.add_row(mode, *(str(m["hop_p50_ms"].get(h, "-")) for h in HOPS))
    console.print(hops)
    s, p = r["modes"]["serial"]["overhead_ms"], r["modes"]["parallel"]["overhead_ms"]
    if s["p50"] and p["p50"]:
        print(
            f"parallel / serial overhead: p50 {p['p50'] / s['p50']:.2f}x, p99 {p['p99'] / s['p99']:.2f}x "
            f"(targets: p50 <= {r['targets']['overhead_p50_ms']} ms, "
            f"p99 <= {r['targets']['overhead_p99_ms']} ms)"
        )
    print(f"load average (1 min) at the end: {r['machine']['load_average_1m_at_end']}")
