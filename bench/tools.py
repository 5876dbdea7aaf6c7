"""Tool benchmark: the code interpreter's sandbox, file ingestion and file search, each beside a baseline.

    tokenstream bench tools [--calls 100] [--pages 40] [--queries 100]

sandbox    a trivial code_interpreter call (start-up, run, collect) through Sandbox.run, p50/p99,
           beside the same Python started bare (`python3 -I -c`, no sandbox) in the same run.
ingestion  pages/s of ~500-word text pages through extract, chunk, embed (MiniLM) and index
           (Weaviate), beside extract+chunk+embed alone (what Weaviate adds).
search     hybrid (BM25 + vector) search p50/p99 against Weaviate, the query's MiniLM embedding included
           (also shown alone), beside BM25 alone on the same index.

Weaviate is a throwaway one on free ports (Stack.ephemeral) unless --use-configured. Writes
bench/results/tools.json.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import typer

RESULTS = Path(__file__).resolve().parent / "results" / "tools.json"
WORDS = [
    "harbour",
    "ferry",
    "lighthouse",
    "library",
    "bakery",
    "island",
    "fjord",
    "winter",
    "keeper",
    "map",
    "loaf",
    "puffin",
    "cliff",
    "pier",
    "storm",
    "ticket",
    "crossing",
    "oven",
    "cellar",
    "season",
    "village",
    "club",
    "pitch",
    "goal",
    "tower",
    "lamp",
    "reef",
    "mason",
]


def percentiles_ms(samples_s: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples_s)
    q = statistics.quantiles(ms, n=100, method="inclusive")
    return {"p50": round(q[49], 1), "p99": round(q[98], 1), "n": len(ms)}


def page(rng: random.Random, n: int) -> str:
    sentences = [
        " ".join(rng.choice(WORDS) for _ in range(12)).capitalize() + f" (page {n})." for _ in range(40)
    ]
    return "\n\n".join(" ".join(sentences[i : i + 8]) for i in range(0, 40, 8))


def bench_sandbox(calls: int) -> dict:
    from tools.config import ToolSettings
    from tools.sandbox import Sandbox

    root = Path(tempfile.mkdtemp(prefix="ts-bench-sandbox-", dir="/tmp"))
    os.chmod(root, 0o711)
    sandbox = Sandbox(ToolSettings(sandbox_dir=root))
    try:
        return _time_sandbox(sandbox, calls)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _time_sandbox(sandbox, calls: int) -> dict:
    from tools.sandbox import PYTHON

    async def sandboxed() -> list[float]:
        out = []
        for i in range(calls + 3):
            t0 = time.perf_counter()
            run = await sandbox.run("bench", "conv", "1 + 1")
            if run.value != "2":
                raise RuntimeError(f"sandbox call failed: {run.error} {run.stderr[-300:]}")
            out.append(time.perf_counter() - t0)
        return out[3:]

    bare = []
    for i in range(calls + 3):
        t0 = time.perf_counter()
        subprocess.run([PYTHON, "-I", "-c", "1 + 1"], check=True)
        bare.append(time.perf_counter() - t0)
    return {
        "sandbox_trivial_call_ms": percentiles_ms(asyncio.run(sandboxed())),
        "baseline_bare_python_ms": percentiles_ms(bare[3:]),
    }


def bench_search(pages: int, queries: int) -> dict:
    from weaviate.classes.query import Filter

    from tools.search.embed import embedder
    from tools.search.extract import chunks, extract
    from tools.search.index import ChunkIndex, weaviate_tenant
    from tools.search.ingest import ingest

    rng = random.Random(7)
    docs = [page(rng, n).encode() for n in range(pages)]
    embed = embedder()
    embed(["warm up"])
    t0 = time.perf_counter()
    for d in docs:
        embed(chunks(extract("p.md", d).text))
    embed_only_s = time.perf_counter() - t0
    index = ChunkIndex.connect()
    try:
        tenant, store = f"bench-{uuid.uuid4().hex[:6]}", "vs_bench"
        t0 = time.perf_counter()
        for n, d in enumerate(docs):
            ingest(index, tenant, store, f"file-{n}", f"page-{n}.md", d)
        ingest_s = time.perf_counter() - t0
        questions = [" ".join(rng.choice(WORDS) for _ in range(6)) for _ in range(queries + 3)]
        embed_q = []
        for q in questions:
            t0 = time.perf_counter()
            embed([q])
            embed_q.append(time.perf_counter() - t0)
        hybrid = []
        for q in questions:
            t0 = time.perf_counter()
            index.search(tenant, [store], q, k=5)
            hybrid.append(time.perf_counter() - t0)
        shard = index.collection.with_tenant(weaviate_tenant(tenant))
        bm25 = []
        for q in questions:
            t0 = time.perf_counter()
            shard.query.bm25(
                query=q, limit=5, filters=Filter.by_property("vector_store_id").contains_any([store])
            )
            bm25.append(time.perf_counter() - t0)
    finally:
        index.close()
    return {
        "pages": pages,
        "ingest_pages_per_s": round(pages / ingest_s, 2),
        "baseline_embed_only_pages_per_s": round(pages / embed_only_s, 2),
        "hybrid_search_ms": percentiles_ms(hybrid[3:]),
        "query_embedding_ms": percentiles_ms(embed_q[3:]),
        "baseline_bm25_search_ms": percentiles_ms(bm25[3:]),
    }


def main(
    calls: Annotated[int, typer.Option(help="trivial sandbox calls timed")] = 100,
    pages: Annotated[int, typer.Option(help="~500-word pages ingested")] = 40,
    queries: Annotated[int, typer.Option(help="searches timed")] = 100,
    use_configured: Annotated[
        bool, typer.Option(help="use the Weaviate of TOKENSTREAM_WEAVIATE_* instead of a throwaway one")
    ] = False,
    out: Annotated[Path, typer.Option(help="where to write the JSON results")] = RESULTS,
) -> None:
    """Sandbox start-up, ingestion pages/s and search latency, each beside its baseline."""
    import logging

    from rich.console import Console
    from rich.table import Table

    from common.config import settings

    logging.getLogger("httpx").setLevel(logging.WARNING)
    console = Console()
    load_before = os.getloadavg()[0]
    with console.status("timing the sandbox"):
        sandbox = bench_sandbox(calls)
    stack = None
    if not use_configured:
        from tokenstream.stack import Stack

        weaviate_root = Path(tempfile.mkdtemp(prefix="ts-bench-weaviate-"))
        stack = Stack.ephemeral(weaviate_root)
        stack.weaviate.start(say=lambda m: None)
        os.environ["TOKENSTREAM_WEAVIATE_HTTP_PORT"] = str(stack.weaviate.port)
        os.environ["TOKENSTREAM_WEAVIATE_GRPC_PORT"] = str(stack.weaviate.grpc_port)
        settings.cache_clear()
    try:
        with console.status("ingesting and searching"):
            search = bench_search(pages, queries)
    finally:
        if stack is not None:
            stack.weaviate.stop(say=lambda m: None)
            shutil.rmtree(weaviate_root, ignore_errors=True)
    load_after = os.getloadavg()[0]

    table = Table("figure", "measured", "baseline (same run)", "baseline is", title="Tools")
    s, b = sandbox["sandbox_trivial_call_ms"], sandbox["baseline_bare_python_ms"]
    table.add_row(
        "sandbox trivial call p50 / p99 (ms)",
        f"{s['p50']} / {s['p99']}",
        f"{b['p50']} / {b['p99']}",
        "python3 -I -c, no sandbox",
    )
    table.add_row(
        "ingestion (pages/s)",
        f"{search['ingest_pages_per_s']}",
        f"{search['baseline_embed_only_pages_per_s']}",
        "extract+chunk+embed, no Weaviate",
    )
    h, m = search["hybrid_search_ms"], search["baseline_bm25_search_ms"]
    table.add_row(
        "hybrid search p50 / p99 (ms)",
        f"{h['p50']} / {h['p99']}",
        f"{m['p50']} / {m['p99']}",
        "BM25 alone, same index",
    )
    e = search["query_embedding_ms"]
    table.add_row("  of which: query embedding p50 / p99 (ms)", f"{e['p50']} / {e['p99']}", "", "MiniLM, CPU")
    console.print(table)
    console.print(f"load average before/after: {load_before:.1f} / {load_after:.1f} on {os.cpu_count()} CPUs")
    result = {
        "benchmark": "tools",
        "command": f"tokenstream bench tools --calls {calls} --pages {pages} --queries {queries}",
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_average_before": load_before,
            "load_average_after": load_after,
        },
        "sandbox": sandbox,
        "search": search,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"wrote {out}")
