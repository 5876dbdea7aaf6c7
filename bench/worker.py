"""`tokenstream bench worker`: sequential generate() vs static batches of 8 vs the worker through Kafka,
and the constrained column (decode tokens/s at 32 running rows with a grammar on every row against
the same rows without: bench/grammar.py's `constrained_column`).

One run, one workload: N requests (default 64) of mixed prompt lengths (short questions, notes
to summarise, long documents) and output lengths (16-64 new tokens, greedy), arriving over time
(Poisson). Each system serves the same arrivals on the same model (SmolLM2-135M-Instruct, fp32
on the CPUs here); the worker is started in-process against a throwaway Kafka broker and fed
through the inference topic like production, with TTFT/ITL measured by a client on the tokens
topic, in a process of its own as the gateway is (bench/worker_client.py). Output lengths are
capped at 64 so the sequential baseline finishes in minutes on 2 cores.
Import-light at module level: torch and transformers load inside `main`.
"""

from __future__ import annotations

import itertools
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import typer

from bench.runenv import broker_and_keyring
from bench.stats import inclusive

RESULTS = Path(__file__).parent / "results" / "worker.json"
WARM_REQUESTS, WARM_TOKENS = 16, 16  # the worker's untimed warm-up through Kafka (run_worker_bench)
SUBJECTS = [
    "Kafka consumer groups",
    "the water cycle",
    "Roman aqueducts",
    "sourdough bread",
    "black holes",
    "the French revolution",
    "photosynthesis",
    "TCP congestion control",
    "honey bees",
    "chess openings",
    "volcanoes",
    "the printing press",
    "GPU memory",
    "jazz harmony",
    "glaciers",
    "compound interest",
]
NOTE = (
    "The team met on Tuesday to review the quarterly roadmap. Latency targets were missed twice, "
    "mostly because of cold caches after deploys. Two engineers proposed warming the caches from "
    "the access logs, and the on-call rotation asked for clearer runbooks. "
)


@dataclass
class Work:
    rid: str
    arrival: float
    messages: list[dict]
    max_tokens: int
    prompt_ids: list[int] = field(default_factory=list)


@dataclass
class Result:
    name: str
    tokens: int = 0
    wall_s: float = 0.0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    mem_per_request: list[float] = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    outputs: dict[str, list[int]] = field(default_factory=dict)  # token ids per request, as streamed

    def summary(self) -> dict:
        pct = inclusive
        return {
            "tokens": self.tokens,
            "wall_s": round(self.wall_s, 2),
            "throughput_tok_s": round(self.tokens / self.wall_s, 2) if self.wall_s else 0,
            "ttft_p50_s": pct(self.ttft, 50),
            "ttft_p99_s": pct(self.ttft, 99),
            "itl_p50_s": pct(self.itl, 50),
            "itl_p99_s": pct(self.itl, 99),
            "mem_per_running_request_mib": round(statistics.mean(self.mem_per_request) / 2**20, 2)
            if self.mem_per_request
            else None,
            **self.extra,
        }


def workload(tokenizer, n: int, rate: float, seed: int) -> list[Work]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        subject = rng.choice(SUBJECTS)
        kind = rng.random()
        if kind < 0.55:
            text = f"Explain {subject} in a few sentences."
        elif kind < 0.85:
            text = "Summarise these notes, then relate them to " + subject + ":\n" + NOTE * rng.randint(1, 3)
        else:
            text = "Read this log and list the problems:\n" + NOTE * rng.randint(4, 7)
        messages = [{"role": "user", "content": text}]
        t += rng.expovariate(rate)
        w = Work(f"bench-{i}", t, messages, rng.choice([16, 24, 32, 48, 64]))
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        w.prompt_ids = list(ids if isinstance(ids, list) else ids["input_ids"])
        out.append(w)
    return out


def useful(tokens: list[int], limit: int, eos: set[int]) -> int:
    n = 0
    for t in tokens[:limit]:
        if t in eos:
            break
        n += 1
    return n


def run_sequential(model, tok, work: list[Work], bpt: int, eos: set[int]) -> Result:
    import torch

    res = Result("sequential generate()")

    class Stamps:
        def __init__(self):
            self.times = []
            self.first = True

        def put(self, value):
            if self.first:
                self.first = False
            else:
                self.times.append(time.perf_counter())

        def end(self):
            pass

    t0 = time.perf_counter()
    for w in work:
        wait = w.arrival - (time.perf_counter() - t0)
        if wait > 0:
            time.sleep(wait)
        s = Stamps()
        out = model.generate(
            torch.tensor([w.prompt_ids]), max_new_tokens=w.max_tokens, do_sample=False, streamer=s
        )
        n = useful(out[0, len(w.prompt_ids) :].tolist(), w.max_tokens, eos)
        res.tokens += n
        res.ttft.append(s.times[0] - t0 - w.arrival)
        res.itl += [b - a for a, b in zip(s.times[: n - 1], s.times[1:n])]
        res.mem_per_request.append((len(w.prompt_ids) + n) * bpt)
    res.wall_s = time.perf_counter() - t0
    return res


def run_static(model, tok, work: list[Work], bpt: int, eos: set[int], batch: int = 8) -> Result:
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    res = Result(f"static batches of {batch}")

    class Stamp(LogitsProcessor):
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    tok.padding_side = "left"
    t0 = time.perf_counter()
    for i in range(0, len(work), batch):
        group = work[i : i + batch]
        wait = group[-1].arrival - (time.perf_counter() - t0)  # the batch starts when it is full
        if wait > 0:
            time.sleep(wait)
        width = max(len(w.prompt_ids) for w in group)
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        ids = torch.tensor([[pad] * (width - len(w.prompt_ids)) + w.prompt_ids for w in group])
        mask = torch.tensor([[0] * (width - len(w.prompt_ids)) + [1] * len(w.prompt_ids) for w in group])
        stamp = Stamp()
        longest = max(w.max_tokens for w in group)
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=longest,
            do_sample=False,
            logits_processor=LogitsProcessorList([stamp]),
            pad_token_id=pad,
        )
        for r, w in enumerate(group):
            n = useful(out[r, width:].tolist(), w.max_tokens, eos)
            res.tokens += n
            res.ttft.append(stamp.times[0] - t0 - w.arrival)
            res.itl += [b - a for a, b in zip(stamp.times[: n - 1], stamp.times[1:n])]
            res.mem_per_request.append((width + out.shape[1] - width) * bpt)  # padded rows hold the batch max
    res.wall_s = time.perf_counter() - t0
    return res


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) a process has used so far."""
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


async def run_worker_bench(
    loaded,
    work: list[Work],
    bootstrap: str,
    max_running: int | None,
    prefill_chunk: int | None,
    broker_pid: int | None = None,
    backend: str = "transformers",
    model_path: Path | None = None,
    dtype: str = "auto",
) -> Result:
    """The worker in this process (its torch thread: the model loaded here), fed and read by
    bench/worker_client.py in a process of its own, as the gateway is in production: the client's
    decoding of every token record does not compete with the worker for this process's GIL."""
    import asyncio
    import sys
    import tempfile

    from bench.runenv import py_env
    from gpu_workers.config import WorkerConfig
    from gpu_workers.startup import needed_topics, run_worker, waited
    from topics.admin import apply

    res = Result("worker via Kafka" + (" (vLLM backend)" if backend == "vllm" else ""))
    limits = {
        k: v for k, v in (("max_running", max_running), ("prefill_chunk", prefill_chunk)) if v is not None
    }
    cfg = WorkerConfig(
        model="smollm2-bench",
        backend=backend,
        max_waiting=64,
        kv_memory_gb=1.0,
        worker_id="bench",
        model_path=model_path,
        dtype=dtype,
        **limits,
    )
    await apply(needed_topics(cfg.model), bootstrap)  # what run_worker requires
    stop, ready = asyncio.Event(), asyncio.Event()
    holder = {}
    task = asyncio.create_task(
        run_worker(
            cfg,
            stop,
            loaded=loaded,
            bootstrap=bootstrap,
            on_ready=lambda w: (holder.update(w=w), ready.set()),
        )
    )
    # no fixed limit: vLLM's first start on a cold compile cache takes minutes; a failed start ends it
    await waited(task, "the worker to be ready", lambda m: print(m, file=sys.stderr, flush=True), 30, ready)
    if not ready.is_set():
        raise RuntimeError("the worker ended before it was ready")
    engine = holder["w"].engine
    pool = getattr(engine, "cache", None)  # the own engine's KV pool (vLLM's is its own)
    page_bytes = pool.nbytes() / pool.allocator.num_blocks if pool is not None else 0.0
    peak = {"running": 0, "kv": 0.0}
    # Untimed warm-up, like the in-process runner's warm-up request: the engine's first forwards, the
    # worker's publish and commit paths and a broker started seconds ago (its JVM compiles its produce
    # and fetch paths under its first requests, on the same cores as the engine) are start-up costs,
    # not the worker's serving rate. Then the prefix cache is emptied, as the in-process runner does,
    # so no measured request finds pages of the warm-up.
    spec = {
        "model": cfg.model,
        "warm": [
            {
                "rid": f"warm-{i}",
                "arrival": 0.0,
                "messages": w.messages,
                "max_tokens": min(w.max_tokens, WARM_TOKENS),
            }
            for i, w in enumerate(work[:WARM_REQUESTS])
        ],
        "requests": [
            {"rid": w.rid, "arrival": w.arrival, "messages": w.messages, "max_tokens": w.max_tokens}
            for w in work
        ],
    }
    with tempfile.TemporaryDirectory(prefix="bench-client-") as tmp:
        src, dst = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        src.write_text(json.dumps(spec))
        client = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "bench.worker_client",
            bootstrap,
            str(src),
            str(dst),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=py_env(),
        )
        try:
            line = await asyncio.wait_for(client.stdout.readline(), 600)
            if line.strip() != b"warm":
                raise RuntimeError(
                    f"bench client: expected 'warm', got {line!r} (exit {await client.wait()})"
                )
            while engine.has_work:  # the warm-up's last step: the engine idles before the clock starts
                await asyncio.sleep(0.01)
            engine.reset_prefix_cache()
            steps0 = engine.steps
            cpu0 = time.process_time()
            broker0 = process_cpu_s(broker_pid) if broker_pid else None
            client.stdin.write(b"go\n")
            await client.stdin.drain()
            waiting = asyncio.create_task(client.wait())
            while not waiting.done():  # the memory the running requests hold, every 0.1 s
                running = len(engine.running)
                if running:
                    if pool is not None:
                        res.mem_per_request.append(pool.allocator.used * page_bytes / running)
                    peak["running"] = max(peak["running"], running)
                    peak["kv"] = max(peak["kv"], engine.kv_usage())
                await asyncio.wait([waiting], timeout=0.1)
            cpu = {"process_cpu_s": round(time.process_time() - cpu0, 2)}  # the worker and torch's threads
            if broker0 is not None:  # the broker shares the cores here: its CPU during the measured run
                cpu["broker_cpu_s"] = round(process_cpu_s(broker_pid) - broker0, 2)
            if waiting.result() != 0:
                raise RuntimeError(f"bench client exited with {waiting.result()}")
            got = json.loads(dst.read_text())
        finally:
            if client.returncode is None:
                client.kill()
                await client.wait()
    res.wall_s = got["wall_s"]
    cpu["client_cpu_s"] = got["cpu_s"]
    for w in work:
        c = got["chunks"][w.rid]
        res.tokens += got["completion_tokens"][w.rid]
        if w.rid in got["outputs"]:
            res.outputs[w.rid] = got["outputs"][w.rid]
        if c:
            res.ttft.append(c[0][0] - got["sent"][w.rid])
            for (a, _), (b, n) in itertools.pairwise(c):
                res.itl += [(b - a) / max(n, 1)] * max(n, 1)
    res.extra = {
        "dtype": getattr(engine, "dtype", None) or str(loaded.dtype),
        "max_batch": peak["running"],
        "peak_kv_usage": round(peak["kv"], 3),
        "kv_pool_mib": round(pool.nbytes() / 2**20, 1) if pool is not None else None,
        "steps": engine.steps - steps0,
        **cpu,
    }
    stop.set()
    await task
    return res


def main(
    requests: int = typer.Option(64, help="number of requests"),
    rate: float = typer.Option(2.0, help="mean arrivals per second (Poisson)"),
    seed: int = typer.Option(0, help="workload seed"),
    max_running: int = typer.Option(32, help="worker batch limit"),
    prefill_chunk: int = typer.Option(256, help="worker: most prompt tokens prefilled per step"),
    grammar_rows: int = typer.Option(32, help="constrained column: running rows (0: leave it out)"),
    out: Path = typer.Option(RESULTS, help="where the JSON figures go"),
) -> None:
    """Sequential vs static batching vs the Kafka worker on SmolLM2: throughput, TTFT, ITL, memory."""
    import asyncio
    import logging
    import os

    import torch
    from rich.console import Console
    from rich.table import Table

    from gpu_workers.kv_cache import KVBudget
    from gpu_workers.model_loader import load
    from gpu_workers.torch_thread import run_on_torch_thread

    console = Console()
    load_before = os.getloadavg()[0]
    logging.getLogger("aiokafka").setLevel(logging.ERROR)
    # every torch call on one thread, the one the worker steps on: a second OpenMP team in the process
    # would slow every team's barriers (gpu_workers/torch_thread.py), baselines and worker alike
    loaded = run_on_torch_thread(load, "smollm2")
    model, tok = loaded.model, loaded.tokenizer
    cfg = model.config
    bpt = KVBudget.bytes_per_token(
        cfg.num_hidden_layers,
        cfg.num_key_value_heads,
        cfg.hidden_size // cfg.num_attention_heads,
        torch.float32,
    )
    eos = {tok.eos_token_id}
    work = workload(tok, requests, rate, seed)
    console.print(
        f"workload: {len(work)} requests over {work[-1].arrival:.1f} s, prompts "
        f"{min(len(w.prompt_ids) for w in work)}-{max(len(w.prompt_ids) for w in work)} tokens, "
        f"outputs 16-64 tokens (greedy); torch threads {torch.get_num_threads()}"
    )
    run_on_torch_thread(
        model.generate, torch.tensor([work[0].prompt_ids]), max_new_tokens=4, do_sample=False
    )  # warm-up
    results = []
    console.print("[bold]1/3 sequential generate()[/]")
    results.append(run_on_torch_thread(run_sequential, model, tok, work, bpt, eos))
    console.print("[bold]2/3 static batching[/]")
    results.append(run_on_torch_thread(run_static, model, tok, work, bpt, eos))
    console.print("[bold]3/3 worker through Kafka[/]")
    with broker_and_keyring("bench-worker-", lambda m: console.print(m, highlight=False)) as stack:
        results.append(
            asyncio.run(run_worker_bench(loaded, work, stack.kafka.address, max_running, prefill_chunk))
        )
    constrained = None
    if grammar_rows:
        from bench.grammar import column_table, constrained_column

        console.print(f"[bold]constrained column: {grammar_rows} rows with and without grammars[/]")
        constrained, _ = run_on_torch_thread(
            constrained_column, loaded, grammar_rows, say=lambda m: console.print(m, highlight=False)
        )
    summaries = {r.name: r.summary() for r in results}
    seq, static, worker = (summaries[r.name] for r in results)
    ratios = {
        "worker_vs_sequential": round(worker["throughput_tok_s"] / seq["throughput_tok_s"], 2),
        "worker_vs_static8": round(worker["throughput_tok_s"] / static["throughput_tok_s"], 2),
    }
    table = Table(title=f"bench worker: {len(work)} requests, SmolLM2-135M-Instruct fp32, {loaded.device}")
    table.add_column("metric")
    for r in results:
        table.add_column(r.name, justify="right")
    for key in (
        "throughput_tok_s",
        "tokens",
        "wall_s",
        "ttft_p50_s",
        "ttft_p99_s",
        "itl_p50_s",
        "itl_p99_s",
        "mem_per_running_request_mib",
    ):
        table.add_row(key, *(str(summaries[r.name].get(key)) for r in results))
    console.print(table)
    console.print(
        f"worker throughput: {ratios['worker_vs_sequential']}x sequential (target 3x), "
        f"{ratios['worker_vs_static8']}x static batching (target 1.5x); "
        f"batch reached {worker.get('max_batch')}, peak KV usage {worker.get('peak_kv_usage')}"
    )
    if constrained is not None:
        console.print(column_table(constrained))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "workload": {
                    "requests": len(work),
                    "rate_per_s": rate,
                    "seed": seed,
                    "output_tokens": "16-64 (greedy)",
                    "device": loaded.device,
                    "worker_max_running": max_running,
                    "worker_prefill_chunk": prefill_chunk,
                    "load_avg_1m_before_after": [load_before, os.getloadavg()[0]],
                    "torch_threads": torch.get_num_threads(),
                    "requests_detail": [asdict(w) | {"prompt_ids": len(w.prompt_ids)} for w in work],
                },
                "results": summaries,
                "ratios": ratios,
                "constrained_column": constrained,
            },
            indent=2,
        )
    )
    console.print(f"figures written to {out}")
