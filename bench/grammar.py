"""`tokenstream bench grammar`: what grammar-constrained decoding costs the worker's engine.

One run, one workload: `rows` requests (default 32, one batch), each offering one of the tools of
bench/tool_schemas.py with the same prompt in both columns. The baseline column generates them
free; the constrained column gives every row its grammar (tool_choice "required"), so every step
fills and applies 32 token masks. Both columns run in-process on the same engine and model
(SmolLM2-135M-Instruct), alternating `repeats` times; the figure is decode tokens/s at exactly
`rows` running rows (`constrained_column`, also the constrained column of `tokenstream bench
worker`), median over the repeats. Then grammar compile time (llguidance, uncached) over the
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
    max_tokens: int = typer.Option(64, help="most new tokens per request"),
    repeats: int = typer.Option(3, help="runs of each column, alternating"),
    device: str = typer.Option("auto", help="auto | cpu | cuda"),
    out: Path = typer.Option(RESULTS, help="where the JSON figures go"),
) -> None:
    """Token throughput with a grammar on every row against the same batch without, and compile times."""
    import os

    from rich.console import Console

    from bench.tool_schemas import tools
    from gateway.tool_params import Tool, output_spec
    from gpu_workers.grammar import Grammars, grammar_text

    console = Console()
    pairs = tools(50)
    figures: dict = {
        "rows": rows,
        "max_tokens": max_tokens,
        "repeats": repeats,
        "library": "llguidance",
        "command": f"tokenstream bench grammar --rows {rows} --max-tokens {max_tokens} --repeats {repeats}",
        "load_avg_1m_before": os.getloadavg()[0],
    }
    if rows:
        from gpu_workers.model_loader import load

        column, grammars = constrained_column(
            load("smollm2", device=device), rows, max_tokens, repeats, say=console.print
        )
        figures.update(column)
        console.print(column_table(column))
    else:
        from common.models import load_tokenizer

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
    figures["load_avg_1m_after"] = os.getloadavg()[0]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(figures, indent=2) + "\n")


def constrained_column(
    loaded, rows: int = 32, max_tokens: int = 64, repeats: int = 3, timed_steps: int = 32, *, say=print
):
    """Decode tokens/s of the engine at exactly `rows` running rows, with a grammar on every row
    (tool_choice "required", one of the 50 benchmark tools each) against the same rows without one.

    Both columns use the same prompts (the tools rendered into them), the same engine and model.
    Only the steps in which all `rows` requests are running and decoding are timed (each samples
    `rows` tokens), `timed_steps` of them per run; a request that ends is replaced at once by the
    same request anew, and the steps that prefill it are not timed. So the figure is decode
    throughput at `rows` running rows, with and without masking, not diluted by prefill or by a
    tail of fewer rows. The columns alternate `repeats` times, back to back; the ratio is the median
    of the pairs' ratios (the host's load moves between pairs far more than within one).
    Returns (figures, the Grammars used).
    """
    from bench.tool_schemas import tools
    from gateway.tool_params import Tool, output_spec
    from gpu_workers.engine import Engine, Sequence
    from gpu_workers.grammar import Grammars
    from gpu_workers.kv_cache import KVBudget
    from schemas import ChatMessage
    from schemas.prompt import prompt_ids

    pairs = tools(50)
    engine = Engine(
        loaded.model,
        loaded.tokenizer,
        KVBudget.for_model(loaded.model, 4096, 16, 1.0),
        max_running=rows,
        prefill_chunk=2048,
    )
    grammars = Grammars(loaded.tokenizer, engine.eos_ids, timeout_s=60)
    work = []
    for i in range(rows):
        tool, prompt = pairs[i % len(pairs)]
        spec = output_spec([Tool(**tool)], "required", None, None)
        work.append((spec, prompt_ids(loaded.tokenizer, [ChatMessage(role="user", content=prompt)], spec)))

    serial = iter(range(10**9))

    def fresh(i: int, constrained: bool) -> Sequence:
        spec, ids = work[i]
        seq = Sequence(f"r{i}-{next(serial)}", list(ids), max_tokens=max_tokens, temperature=0)
        seq.tag = i
        if constrained:
            seq.grammar = asyncio.run(
                grammars.state_for(spec)
            )  # compiled once, then a copy of the cached one
        return seq

    def batch(constrained: bool) -> tuple[int, float, int]:
        """(tokens sampled in the timed steps, their seconds, how many steps)."""
        for i in range(rows):
            engine.add(fresh(i, constrained))
        tokens, seconds, steps = 0, 0.0, 0
        while steps < timed_steps:
            full = (
                len(engine.running) == rows
                and not engine.waiting
                and all(s.pending == 1 for s in engine.running)
            )
            started = time.perf_counter()
            outputs = engine.step()
            if full:
                seconds += time.perf_counter() - started
                tokens += rows
                steps += 1
            for out in outputs:  # a request that ended is replaced at once by the same one anew
                if out.finish_reason is not None:
                    engine.add(fresh(out.seq.tag, constrained))
        for seq in [*engine.running, *engine.waiting, *engine._inbox]:
            engine.cancel(seq.request_id)
        while engine.has_work:
            engine.step()
        return tokens, seconds, steps

    batch(True)  # warm-up: compiles and caches the grammars, first masks
    runs: dict[str, list[float]] = {"free": [], "constrained": []}
    for r in range(repeats):
        for name in ("free", "constrained") if r % 2 == 0 else ("constrained", "free"):
            n, wall, steps = batch(name == "constrained")
            runs[name].append(n / wall)
            say(f"run {r + 1}/{repeats} {name}: {steps} steps of {rows} rows, {n / wall:.1f} tokens/s")
    free, constrained = statistics.median(runs["free"]), statistics.median(runs["constrained"])
    # each pair ran back to back: the ratio within a pair is what the host's load swings least
    ratio = statistics.median(c / f for f, c in zip(runs["free"], runs["constrained"]))
    return {
        "rows": rows,
        "max_tokens": max_tokens,
        "repeats": repeats,
        "timed_steps_per_run": timed_steps,
        "device": loaded.device,
        "free_tok_s": round(free, 1),
        "constrained_tok_s": round(constrained, 1),
        "constrained_vs_free": round(ratio, 3),
        "masking_cost": round(1 - ratio, 3),
        "runs_tok_s": {k: [round(x, 1) for x in v] for k, v in runs.items()},
    }, grammars


def column_table(column: dict):
    from rich.table import Table

    table = Table(
        title=f"grammar-constrained decoding: decode tokens/s at {column['rows']} running rows, "
        f"{column['device']}"
    )
    for col in ("column", "tokens/s", "vs free"):
        table.add_column(col)
    table.add_row("free (baseline)", f"{column['free_tok_s']:.1f}", "1.00")
    table.add_row(
        "constrained (grammar on every row)",
        f"{column['constrained_tok_s']:.1f}",
        f"{column['constrained_vs_free']:.2f}  (masking cost {column['masking_cost']:.1%}, target <= 10%)",
    )
    return table
