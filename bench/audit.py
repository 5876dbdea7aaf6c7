"""Audit benchmark: how fast `audit range` replays the log, and whether its memory stays flat.

    tokenstream bench audit [--events 1000000] [--chunks 20]

Writes a run of complete requests (chat request, prepared, input verdict, screened, inference
request, `--chunks` token chunks, completion, re-keyed turn, transcript: chunks + 8 events each)
to a Kafka started on free loopback ports, then reads the whole range twice over the same
spans: the baseline is a bare group-less consumer counting records (no decoding), the measured
run is `audit range` (time-ordered merge, decoding, folding, the gap check on every request).
Peak memory is the process's RSS sampled every 50,000 records; "flat" compares the RSS at a
quarter of the scan with the RSS at its end. Beside the wall-clock rates, the CPU time each scan
used (this process's, `time.process_time`) per event: on a machine shared with other work the
wall-clock rate is what the scan got, the CPU time what it costs. Writes bench/results/audit.json.

The run is written in well under a minute, so the audit's horizon (how long after admission a
request may still write) is set to 10 s here; on a real log, requests spread over the range and
the default 600 s horizon keeps memory flat in the same way.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import time
from pathlib import Path

import typer

from bench.runenv import broker_and_keyring
from common import kafka_auth

RESULTS = Path(__file__).resolve().parent / "results" / "audit.json"
MODEL = "bench-audit"
#: How long after admission a request may still write, for this compressed run (see the docstring).
HORIZON_S = 10.0


async def write_run(bootstrap: str, requests: int, chunks: int, say) -> tuple[int, int, int]:
    from common import id_key
    from producers import publish, start_producer
    from schemas import (
        ChatMessage,
        ChatRequest,
        Completion,
        InferenceRequest,
        SafetyVerdict,
        TokenChunk,
        Transcript,
        Usage,
    )
    from schemas.ids import new_request_id
    from topics import (
        CHAT_REQUESTS,
        CONVERSATION_TURNS,
        PREPARED,
        SCREENED,
        TOKENS,
        TRANSCRIPTS,
        VERDICTS,
        inference_topic,
    )

    id_key.install()
    producer = await start_producer(bootstrap, linger_ms=20, max_batch_size=1024 * 1024)
    inference = inference_topic(MODEL)
    words = [f"word{i} " for i in range(chunks)]
    answer = "".join(words)
    events = 0
    since = int(time.time() * 1000) - 1
    pending = []
    try:
        for n in range(requests):
            p = n % 12
            rid = new_request_id(p, time.time())
            ids = dict(request_id=rid, conversation_id=rid, tenant="bench")
            question = [ChatMessage(role="user", content=f"Question number {n}: what is the weather like?")]
            inf = InferenceRequest(**ids, model=MODEL, messages=question, reply_partition=p)
            done = Completion(
                **ids,
                seq=chunks,
                finish_reason="stop",
                text=answer,
                usage=Usage(prompt_tokens=12, completion_tokens=chunks),
                worker_id="w",
            )
            out = [
                (
                    CHAT_REQUESTS,
                    ChatRequest(**ids, model=MODEL, messages=question, reply_partition=p),
                    rid,
                    None,
                ),
                (PREPARED, inf, rid, None),
                (
                    VERDICTS,
                    SafetyVerdict(**ids, stage="input", blocked=False, policy_version="v1"),
                    rid,
                    None,
                ),
                (SCREENED, inf, rid, None),
                (inference, inf, rid, None),
            ]
            out += [
                (TOKENS, TokenChunk(**ids, seq=i, text=w, token_ids=[i], worker_id="w"), rid, p)
                for i, w in enumerate(words)
            ]
            out += [
                (TOKENS, done, rid, p),
                (CONVERSATION_TURNS, done, rid, None),
                (TRANSCRIPTS, Transcript(**ids, question=question, answer=done), rid, None),
            ]
            for spec, event, key, partition in out:
                pending.append(await publish(producer, spec, event, key=key, partition=partition, wait=False))
            if (events + len(out)) // 100_000 != events // 100_000:
                say(f"  written {events + len(out):,} events")
            events += len(out)
            if len(pending) >= 2_000:  # acknowledged in small groups: a request's events keep close times
                await asyncio.gather(*pending)
                pending.clear()
        await asyncio.gather(*pending)
    finally:
        await producer.stop()
    return events, since, int(time.time() * 1000) + 1


async def baseline_scan(bootstrap: str, spans) -> tuple[int, float, float]:
    """A bare consumer over the same spans: records counted, nothing decoded. (records, seconds, CPU s)"""
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        **kafka_auth.client_options(),
        group_id=None,
        enable_auto_commit=False,
        max_partition_fetch_bytes=4 * 1024 * 1024,
        fetch_max_wait_ms=100,
    )
    await consumer.start()
    try:
        stop = {s.tp: s.stop for s in spans if s.size}
        consumer.assign(list(stop))
        for s in spans:
            if s.size:
                consumer.seek(s.tp, s.start)
        count, started, cpu = 0, time.perf_counter(), time.process_time()
        while stop:
            batch = await consumer.getmany(timeout_ms=500, max_records=5000)
            for tp, records in batch.items():
                count += sum(1 for r in records if r.offset < stop.get(tp, 0))
                if records and records[-1].offset + 1 >= stop.get(tp, 0):
                    stop.pop(tp, None)
        return count, time.perf_counter() - started, time.process_time() - cpu
    finally:
        await consumer.stop()


async def audit_scan(bootstrap: str, since: int, until: int) -> dict:
    import psutil

    from audit.run import Auditor, Options

    proc = psutil.Process()
    samples: list[tuple[int, int]] = []  # (records read, RSS bytes)
    last = [0]
    checked = {"requests": 0, "failed": 0}

    def progress(done: int, total: int) -> None:
        if done - last[0] >= 50_000 or (done == total and done != last[0]):
            last[0] = done
            samples.append((done, proc.memory_info().rss))

    def keep(audit) -> None:
        checked["requests"] += 1
        checked["failed"] += bool(audit.problems(open_ok=False))

    rss_before = proc.memory_info().rss
    async with Auditor(Options(bootstrap, horizon_s=HORIZON_S, progress=progress)) as auditor:
        auditor.timelines = False  # as `audit range` runs without --timeline
        started, cpu = time.perf_counter(), time.process_time()
        outcome = await auditor.range(since, until, keep)
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
        spans = auditor.last_spans
    return {
        "records": outcome.records,
        "seconds": elapsed,
        "cpu_seconds": cpu,
        "requests": outcome.requests,
        "failed": outcome.failed,
        "rss_before": rss_before,
        "samples": samples,
        "spans": spans,
    }


def main(
    events: int = typer.Option(1_000_000, help="events to write and replay (at least)"),
    chunks: int = typer.Option(20, help="token chunks per request"),
    out: Path = typer.Option(RESULTS, help="where the JSON figures go"),
) -> None:
    """`audit range` over a long run: events/s beside a bare consumer, and peak memory."""
    import logging

    from rich.console import Console
    from rich.table import Table

    from topics.admin import apply
    from topics.registry import all_topics

    console = Console()
    say = lambda m: console.print(m, highlight=False)
    logging.getLogger("aiokafka").setLevel(logging.ERROR)
    per_request = chunks + 8
    requests = -(-events // per_request)
    load_before = os.getloadavg()[0]
    with broker_and_keyring("bench-audit-", say) as stack:
        bootstrap = stack.kafka.address
        asyncio.run(apply(all_topics([MODEL]), bootstrap))
        say(f"writing {requests:,} requests x {per_request} events")
        written, since, until = asyncio.run(write_run(bootstrap, requests, chunks, say))
        say(f"written {written:,} events; replaying")
        measured = asyncio.run(audit_scan(bootstrap, since, until))
        base_count, base_s, base_cpu = asyncio.run(baseline_scan(bootstrap, measured["spans"]))
    samples = measured["samples"]
    rates = {
        "audit_range_events_per_s": measured["records"] / measured["seconds"],
        "bare_consumer_events_per_s": base_count / base_s,
    }
    peak = max(r for _, r in samples) if samples else measured["rss_before"]
    quarter = next((r for n, r in samples if n >= measured["records"] / 4), peak)
    end = samples[-1][1] if samples else peak
    result = {
        "command": f"tokenstream bench audit --events {events} --chunks {chunks}",
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_avg_1m_before_after": [load_before, os.getloadavg()[0]],
        },
        "events_written": written,
        "requests": requests,
        "audit": {
            "records": measured["records"],
            "seconds": round(measured["seconds"], 2),
            "events_per_s": round(rates["audit_range_events_per_s"]),
            "cpu_seconds": round(measured["cpu_seconds"], 2),
            "cpu_us_per_event": round(measured["cpu_seconds"] / measured["records"] * 1e6, 2),
            "requests_checked": measured["requests"],
            "requests_failing": measured["failed"],
            "rss_mib_before": round(measured["rss_before"] / 2**20, 1),
            "rss_mib_peak": round(peak / 2**20, 1),
            "rss_mib_at_quarter": round(quarter / 2**20, 1),
            "rss_mib_at_end": round(end / 2**20, 1),
            "rss_mib_by_records": [[n, round(r / 2**20, 1)] for n, r in samples],
        },
        "baseline_bare_consumer": {
            "records": base_count,
            "seconds": round(base_s, 2),
            "events_per_s": round(rates["bare_consumer_events_per_s"]),
            "cpu_seconds": round(base_cpu, 2),
            "cpu_us_per_event": round(base_cpu / base_count * 1e6, 2),
        },
        "ratio_audit_vs_bare": round(
            rates["audit_range_events_per_s"] / rates["bare_consumer_events_per_s"], 3
        ),
        "target_events_per_s": 50_000,
    }
    table = Table(
        "measure", "audit range", "bare consumer (baseline)", title=f"bench audit: {written:,} events"
    )
    table.add_row(
        "events/s",
        f"{result['audit']['events_per_s']:,}",
        f"{result['baseline_bare_consumer']['events_per_s']:,}",
    )
    table.add_row(
        "seconds", str(result["audit"]["seconds"]), str(result["baseline_bare_consumer"]["seconds"])
    )
    table.add_row(
        "CPU µs per event",
        str(result["audit"]["cpu_us_per_event"]),
        str(result["baseline_bare_consumer"]["cpu_us_per_event"]),
    )
    table.add_row(
        "RSS MiB before / at 1/4 / peak / end",
        f"{result['audit']['rss_mib_before']} / "
        f"{result['audit']['rss_mib_at_quarter']} / {result['audit']['rss_mib_peak']} / "
        f"{result['audit']['rss_mib_at_end']}",
        "-",
    )
    table.add_row("requests checked / failing", f"{measured['requests']:,} / {measured['failed']}", "-")
    console.print(table)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    say(f"figures in {out}")
