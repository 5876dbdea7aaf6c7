"""`tokenstream bench routing`: prefix-aware routing across two workers, on against off, same run.

Two throwaway systems one after the other (Kafka, Redis, the three processors, two SmolLM2 workers,
a gateway), the router's prefix routing on in one (`TOKENSTREAM_ROUTER_PREFIX_ROUTING=true`, the
default) and off in the other. In each, `--conversations` conversations of `--turns` turns go
through the gateway by conversation id (the conversation processor holds their history), turn by
turn, one request at a time, each user message a paragraph of its own so that a turn's prompt is
mostly its history. Per turn: the client's TTFT (request sent -> first content frame), which worker
answered and how many prompt tokens came from its cache (`usage.prompt_tokens_details`). Without
routing a turn lands on either worker by its request id, so about half find their history there;
with it, every later turn goes to the worker that answered the turn before. Results go to
bench/results/routing.json.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import time
from pathlib import Path

import typer

from bench.broker_warmup import warm_broker
from bench.rawhttp import chat_post

RESULTS = Path(__file__).parent / "results" / "routing.json"
MODEL = "smollm2"
WORDS = [
    "harbour",
    "ferry",
    "lighthouse",
    "tide",
    "gull",
    "net",
    "anchor",
    "pier",
    "rope",
    "sail",
    "keel",
    "mast",
    "storm",
    "calm",
    "fog",
    "wave",
    "shore",
    "cliff",
    "island",
    "boat",
    "market",
    "fish",
    "salt",
    "wind",
    "rain",
    "sun",
    "moon",
    "star",
    "chart",
    "compass",
]


def paragraph(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def ask(port: int, key: str, body: dict) -> dict:
    """One streamed chat completion: TTFT, the answering worker's usage (from the last frame)."""
    request = chat_post(port, {**body, "stream_options": {"include_usage": True}}, key=key)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    sent = time.perf_counter()
    writer.write(request)
    buf, first = b"", None
    while chunk := await reader.read(65536):
        buf += chunk
        if first is None and b'"content":"' in buf.split(b"\r\n\r\n", 1)[-1].replace(b'"content":""', b""):
            first = time.perf_counter()
    writer.close()
    usage = {}
    for line in buf.decode(errors="replace").splitlines():
        if line.startswith("data: {") and '"usage"' in line:
            usage = json.loads(line[6:]).get("usage") or usage
    if first is None or not usage:
        raise RuntimeError(f"no answer: {buf[-400:]!r}")
    return {
        "ttft_s": first - sent,
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
    }


async def _run(
    routing: bool, conversations: int, turns: int, words: int, answer_tokens: int, seed: int
) -> dict:
    import tempfile

    from tokenstream.stack.local import LocalSystem

    tmp = Path(tempfile.mkdtemp(prefix="bench-routing-"))
    env = {"TOKENSTREAM_ROUTER_PREFIX_ROUTING": "true" if routing else "false"}
    async with LocalSystem(tmp, MODEL, gateways={"g": {}}, workers=2, processor_env=env) as system:
        await warm_broker(system.stack.kafka.address)
        port, rng = system.ports["g"], random.Random(seed)
        for i in range(6):  # untimed: each role's first requests, the group settled over both workers
            await ask(
                port,
                system.key,
                {
                    "model": MODEL,
                    "stream": True,
                    "max_tokens": 4,
                    "temperature": 0,
                    "messages": [{"role": "user", "content": f"Warm up {i}."}],
                },
            )
        names = [f"bench-{os.getpid()}-{routing}-{c}" for c in range(conversations)]
        per_turn: list[list[dict]] = []
        for t in range(turns):
            rows = []
            for name in names:
                got = await ask(
                    port,
                    system.key,
                    {
                        "model": MODEL,
                        "stream": True,
                        "max_tokens": answer_tokens,
                        "temperature": 0,
                        "conversation_id": name,
                        "messages": [{"role": "user", "content": paragraph(rng, words) + " Summarise this."}],
                    },
                )
                rows.append(got)
                await asyncio.sleep(0.1)  # a user reads the answer before the next question
            per_turn.append(rows)
            print(
                f"routing {'on' if routing else 'off'}: turn {t + 1}/{turns}, TTFT mean "
                f"{statistics.mean(r['ttft_s'] for r in rows):.3f} s",
                flush=True,
            )
    return {
        "turns": [
            {
                "turn": t + 1,
                "ttft_mean_s": round(statistics.mean(r["ttft_s"] for r in rows), 4),
                "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
                "cached_tokens": sum(r["cached_tokens"] for r in rows),
                "requests": rows,
            }
            for t, rows in enumerate(per_turn)
        ]
    }


def main(
    conversations: int = typer.Option(6, help="conversations, each its own history"),
    turns: int = typer.Option(5, help="turns per conversation"),
    words: int = typer.Option(80, help="words of each user message"),
    answer_tokens: int = typer.Option(48, help="max_tokens of each answer"),
    seed: int = typer.Option(0, help="seed of the messages' words"),
    out: Path = typer.Option(RESULTS, help="where the JSON results go"),
) -> None:
    """Turn-by-turn TTFT of multi-turn conversations over two workers, prefix routing on against off."""
    from rich.console import Console
    from rich.table import Table

    load_before = os.getloadavg()[0]
    runs = {
        label: asyncio.run(_run(on, conversations, turns, words, answer_tokens, seed))
        for label, on in (("on", True), ("off", False))
    }
    last = turns - 1
    on, off = runs["on"]["turns"][last], runs["off"]["turns"][last]
    result = {
        "command": (
            f"tokenstream bench routing --conversations {conversations} --turns {turns} --words {words} "
            f"--answer-tokens {answer_tokens} --seed {seed}"
        ),
        "at_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg()[0],
        "cpus": os.cpu_count(),
        "model": "SmolLM2-135M-Instruct fp32",
        "runs": runs,
        f"turn{turns}": {
            "ttft_ratio_on_vs_off": round(on["ttft_mean_s"] / off["ttft_mean_s"], 3),
            "cached_share_on": round(on["cached_tokens"] / max(on["prompt_tokens"], 1), 3),
            "cached_share_off": round(off["cached_tokens"] / max(off["prompt_tokens"], 1), 3),
            "target": "<= 0.6",
        },
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    table = Table(
        title=f"bench routing: {conversations} conversations x {turns} turns, two workers "
        f"(mean client TTFT per turn, share of prompt tokens from the cache)"
    )
    for c in ("turn", "TTFT on (s)", "TTFT off (s)", "cached on", "cached off"):
        table.add_column(c, justify="right")
    for a, b in zip(runs["on"]["turns"], runs["off"]["turns"]):
        table.add_row(
            str(a["turn"]),
            str(a["ttft_mean_s"]),
            str(b["ttft_mean_s"]),
            f"{a['cached_tokens'] / max(a['prompt_tokens'], 1):.0%}",
            f"{b['cached_tokens'] / max(b['prompt_tokens'], 1):.0%}",
        )
    Console(width=120).print(table)
    print(
        f"turn {turns}: TTFT with routing {result[f'turn{turns}']['ttft_ratio_on_vs_off']}x without "
        f"(target <= 0.6); written to {out}"
    )
