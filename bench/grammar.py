"""`tokenstream bench grammar`: what grammar-constrained decoding costs the worker's engine.

One run, one workload: `rows` requests (default 32, one batch), each offering one of the tools of
bench/tool_schemas.py with the same prompt in both columns. The baseline column generates them
free; the constrained column gives every row its grammar (tool_choice "required"), so every step
fills and applies 32 token masks. Both columns run in-process on the same engine and model
(SmolLM2-135M-Instruct), alternating `repeats` times; throughput is generated tokens per second
of wall time (median over the repeats). Then grammar compile time (llguidance, uncached) over the
50 tool schemas: p50 and p99. Import-light at module level: torch loads inside `main`.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path

import typer

RESULTS = Path(__file__).parent / "results" / "grammar.json"


def main(
    rows: int = typer.Option(32, help="requests in the batch (0: compile times only)"),
    max_tokens: int = typer.Option(48, help="most new tokens per request"),
    repeats: int = typer.Option(2, help="runs of each column, alternating"),
    device: str = typer.Option("auto", help="auto | cpu | cuda"),
    out: Path = typer.Option(RESULTS, help="where the JSON figures go"),
) -> None:
    """Token throughput with a grammar on every row against the same batch without, and compile times."""
    from rich.console import Console

    from bench.tool_schemas import tools
    from gateway.tool_params import Tool, output_spec
    from gpu_workers.grammar import Grammars, grammar_text

    console = Console()
    pairs = tools(50)
    figures: dict = {"rows": rows, "max_tokens": max_tokens, "repeats": repeats, "library": "llguidance"}
    if rows:
        grammars = _throughput(rows, max_tokens, repeats, device, pairs, figures, console)
    else:
        from tokenstream.models import load_tokenizer

        tok = load_tokenizer("smollm2")
        grammars = Grammars(tok, {tok.eos_token_id}, timeout_s=60)
    compile_ms = []
    for tool, _ in pairs:
        text = grammar_text(output_spec([Tool(**tool)], "required", None, None))
        grammars.cache.clear()
        started = time.perf_counter()
        grammars.compile_now(text)
        compile_ms.append((time.perf_counter() - started) * 1000)
    q = statistics.quantiles(compile_ms, n=100, method="inclusive")
    figures.update(compile_p50_ms=round(q[49], 2), compile_p99_ms=round(q[98], 2), schemas=len(compile_ms))
    console.print(f"compile over {len(compile_ms)} tool schemas: p50 {q[49]:.2f} ms, p99 {q[98]:.2f} ms")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(figures, indent=2) + "\n")


def _throughput(rows, max_tokens, repeats, device, pairs, figures, console):
    """The two columns: free and constrained tokens/s of one batch of `rows` requests."""
    from rich.table import Table

    from gateway.tool_params import Tool, output_spec
    from gpu_workers.engine import Engine, Sequence
    from gpu_workers.grammar import Grammars
    from gpu_workers.kv_cache import PagedKVCache
    from gpu_workers.model_loader import load
    from schemas import ChatMessage
    from schemas.prompt import prompt_ids

    loaded = load("smollm2", device=device)
    engine = Engine(loaded.model, loaded.tokenizer, PagedKVCache.for_model(loaded.model, 4096, 16, 1.0),
                    max_running=rows, prefill_chunk=2048)
    grammars = Grammars(loaded.tokenizer, engine.eos_ids, timeout_s=60)
    work = []
    for i in range(rows):
        tool, prompt = pairs[i % len(pairs)]
        spec = output_spec([Tool(**tool)], "required", None, None)
        request = InferenceRequest(request_id=f"g{i}", model="smollm2", output=spec,
                                   messages=[ChatMessage(role="user", content=prompt)])
        work.append((spec, prompt_ids(loaded.tokenizer, request)))

    async def batch(constrained: bool) -> tuple[int, float]:
        seqs = []
        for i, (spec, ids) in enumerate(work):
            seq = Sequence(f"r{i}", list(ids), max_tokens=max_tokens, temperature=0)
            if constrained:
                seq.grammar = await grammars.state_for(spec)
            seqs.append(seq)
        started = time.perf_counter()
        engine.generate(seqs)
        return sum(len(s.generated) + (s.finish_reason == "stop") for s in seqs), time.perf_counter() - started

    runs: dict[str, list[float]] = {"free": [], "constrained": []}
    tokens: dict[str, int] = {}
    asyncio.run(batch(True))  # warm-up: caches the grammars, first masks
    for r in range(repeats):
        for name in ("free", "constrained") if r % 2 == 0 else ("constrained", "free"):
            n, wall = asyncio.run(batch(name == "constrained"))
            runs[name].append(n / wall)
            tokens[name] = n
            console.print(f"run {r + 1}/{repeats} {name}: {n} tokens in {wall:.2f} s")

    free, constrained = statistics.median(runs["free"]), statistics.median(runs["constrained"])
    figures.update(device=loaded.device, free_tok_s=round(free, 1), constrained_tok_s=round(constrained, 1),
                   constrained_vs_free=round(constrained / free, 3), tokens=tokens)
    table = Table(title=f"grammar-constrained decoding, {rows} rows, {loaded.device}")
    for col in ("column", "tokens/s", "vs free"):
        table.add_column(col)
    table.add_row("free (baseline)", f"{free:.1f}", "1.00")
    table.add_row("constrained (every row)", f"{constrained:.1f}", f"{constrained / free:.2f}")
    console.print(table)
    return grammars
