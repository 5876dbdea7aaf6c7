"""`tokenstream bench tokens`: the token path's ceiling, measured against Kafka's own producer.

One run on a throwaway Kafka (one broker, SASL/SCRAM and the registry's ACLs, as shipped) and Redis:
the real conversation, safety (output screening on, as always) and router processors, the real
gateway, and the real worker process with the synthetic backend (gpu_workers/backend_synthetic.py):
a stand-in for a GPU that gives each running request one token every `--step-ms` and does nothing
else, its tokens taking the worker's real path (streaming, the stream interval, publishing). The
streaming clients (chat completions, stream: true) are a process of their own (bench/sse_clients.py).
The output check judges with the bundled classifier on this CPU (`--judge model`), or with the
stand-in for a classifier on an accelerator (`--judge stand-in`, safety_model/stand_in.py): the
safety processor does all its work but the forward pass, which on 2 CPU cores caps the chain near a
thousand tokens a second whatever the log carries.

Stages raise the offered token rate (`--streams` concurrent streams, each at 1000 / `--step-ms`
tokens a second): each stage opens its streams, waits until all stream, lets them run `--warm-s`,
then measures a window of `--window-s`:

- delivered tokens/s: tokens of the chunks written in the window that reached their client;
- delivery lag: the client's receipt of a chunk (or of a later frame carrying it, when the gateway
  merges for a slow reader) minus the chunk's created_at (one host, one clock), p50 / p99 / max;
- CPU microseconds per delivered token of each process (worker, processors, gateway, broker, Redis,
  the clients), from psutil's CPU times at the window's edges;
- records and bytes written per delivered token on each topic (end offsets; the broker's log segment
  sizes, batch framing included);
- how long after the stage's streams ended each consumer group of ts.tokens (the processors) took to
  commit past all of the stage (or how many records it was still behind).

A stage is sustained when its lag p99 is within `--lag-limit-ms` (100), every chunk of the window
reached its client, and the worker wrote at least 90% of the tokens its stand-in GPU offered (a worker
whose host work falls behind slows its GPU down); with `--catch-up-s`, also every processor committed
past the stage within that many seconds after its streams ended (by default only reported: a
processor may hold its commits back by design, as the safety processor does for its open windows).
Stages stop at the first that is not; the capacity is the delivered tokens/s of the last sustained one
(without `--catch-up-s`, a delivery capacity: it names the processors still behind at that stage).
Then, on the same broker, Kafka's ProducerPerformance (bench/producer_perf.py) writes records of the
mean ts.tokens record's size at Kafka's producer defaults with acks=all: capacity / its records/s is
the ratio. Results go to bench/results/tokens.json.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import platform
import signal
import time
from bisect import bisect_left
from pathlib import Path

import typer

from bench.stats import nearest_rank

RESULTS = Path(__file__).parent / "results" / "tokens.json"
MODEL = "smollm2"  # the name served (its tokenizer renders prompts); no model is loaded
GATEWAY = "tokens"
JUDGES = ("model", "stand-in")
KEPT_UP = 0.9  # least share of the offered tokens the worker must write for a stage to count


def main(
    streams: str = typer.Option("2,4,8,16,32,64,128,256", help="concurrent streams of each stage, rising"),
    step_ms: float = typer.Option(20.0, help="the synthetic GPU's step time (one token per stream a step)"),
    window_s: float = typer.Option(5.0, help="measured seconds of each stage"),
    warm_s: float = typer.Option(1.0, help="seconds each stage runs before its window"),
    lag_limit_ms: float = typer.Option(100.0, help="a stage is sustained while its lag p99 is within this"),
    catch_up_s: float = typer.Option(
        0.0,
        help="also require every processor to commit past the stage within this after its streams end "
        "(0: only reported; a processor may hold its commits back by design)",
    ),
    perf_records: int = typer.Option(300_000, help="records of the ProducerPerformance baseline (0: none)"),
    judge: str = typer.Option(
        "model",
        help="the output check's judge: model (the bundled classifier on this CPU) or stand-in (a wait of "
        "TOKENSTREAM_BENCH_STAND_IN_JUDGE_MS per call, as a classifier on an accelerator: "
        "safety_model/stand_in.py)",
    ),
    out: Path = typer.Option(RESULTS, help="where the JSON results go"),
) -> None:
    """The token path's capacity (tokens/s at lag p99 <= 100 ms) against Kafka's own producer."""
    import resource

    plan = [int(s) for s in streams.split(",") if s.strip()]
    if not plan or any(n < 1 for n in plan) or step_ms <= 0 or window_s <= 0:
        raise typer.BadParameter("streams: positive counts; step, window: above 0")
    if judge not in JUDGES:
        raise typer.BadParameter(f"judge: one of {', '.join(JUDGES)}")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 65536)), hard))
    options = dict(
        step_ms=step_ms,
        window_s=window_s,
        warm_s=warm_s,
        lag_limit_ms=lag_limit_ms,
        catch_up_s=catch_up_s,
        perf_records=perf_records,
        judge=judge,
    )
    try:
        result = asyncio.run(_interruptible(run(plan, **options)))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("bench tokens: interrupted; every process it started is stopped", flush=True)
        raise typer.Exit(130) from None
    result["command"] = (
        f"tokenstream bench tokens --streams {streams} --step-ms {step_ms:g} --window-s {window_s:g} "
        f"--warm-s {warm_s:g} --lag-limit-ms {lag_limit_ms:g} --catch-up-s {catch_up_s:g} "
        f"--perf-records {perf_records} --judge {judge}"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    _summary(result)
    print(f"written to {out}")


async def _interruptible(work):
    """`work`, cancelled by SIGTERM as by Ctrl-C, so that every process it started is stopped."""
    task = asyncio.ensure_future(work)
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    return await task


@contextlib.asynccontextmanager
async def _started(system):
    """`system` started, and stopped however its start or its use ends (interrupted half-started too:
    LocalSystem's own `async with` stops nothing when its start is what was interrupted)."""
    try:
        await system.__aenter__()
        yield system
    finally:
        await system.__aexit__(None, None, None)


def machine() -> dict:
    """The CPU model and its vector ISA (/proc/cpuinfo), cores, Python."""
    model, flags = platform.processor(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and ":" in line:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = next((i for i in ("avx512f", "avx2", "avx", "sse4_2") if i in flags), "")
    return {
        "cpu": model,
        "isa": isa.replace("avx512f", "avx512"),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }


async def run(
    plan: list[int],
    *,
    step_ms: float = 20.0,
    window_s: float = 5.0,
    warm_s: float = 1.0,
    lag_limit_ms: float = 100.0,
    catch_up_s: float = 0.0,
    perf_records: int = 300_000,
    judge: str = "model",
    say=lambda m: print(m, flush=True),
) -> dict:
    """The stages of `plan` (streams each) on a throwaway system, then the baseline; the results."""
    import shutil
    import tempfile

    from bench.producer_perf import baseline
    from bench.token_meter import Meter
    from gpu_workers.backend_synthetic import ENABLE_ENV, STEP_ENV
    from tokenstream.keys import KeyStore
    from tokenstream.stack.local import LocalSystem
    from topics import TOKENS

    os.environ[ENABLE_ENV] = "1"  # the worker's synthetic backend, this system's only
    os.environ[STEP_ENV] = str(step_ms)
    if judge == "stand-in":
        from safety_model import stand_in

        os.environ[stand_in.ENABLE_ENV] = "1"  # the safety processor's judge: this system's only
    tmp = Path(tempfile.mkdtemp(prefix="bench-tokens-"))
    say(f"bench tokens: a throwaway system under {tmp} (logs there)")
    worker = ("--backend", "synthetic", "--max-running", str(max(plan)))
    ok = False
    try:
        async with _started(LocalSystem(tmp, MODEL, {GATEWAY: {}}, worker_args=worker)) as system:
            from common import sealing

            sealing.install(system.stack.redis.address)  # the chunks' sealed content is read back
            key, _ = KeyStore(system.stack.redis.address).create(
                "bench", tier="paid", name="bench tokens", max_streams=-1, exact_cache=False
            )
            port = system.ports[GATEWAY]
            pids = {proc.name.rsplit("-", 1)[0]: proc.popen.pid for proc in system.procs.values()}
            pids |= {"kafka": system.stack.kafka.pid(), "redis": system.stack.redis.pid()}
            meter = await Meter(system.stack.kafka.address, system.stack.kafka.data_dir / "log", pids).start()
            try:
                stage = Stage(meter, port, key, step_ms / 1000, window_s, warm_s, catch_up_s)
                say("warm-up: 4 streams, untimed")
                await stage.run(-1, 4, measure=False)
                stages = []
                for number, streams in enumerate(plan):
                    figures = await stage.run(number, streams)
                    figures["sustained"], figures["why_not"] = _judge(figures, lag_limit_ms, catch_up_s)
                    stages.append(figures)
                    say(_line(number, len(plan), figures))
                    if not figures["sustained"]:
                        break
            finally:
                await meter.stop()
            held = [s for s in stages if s["sustained"]]
            capacity = held[-1] if held else None
            sized = capacity or stages[-1]
            base = None
            if perf_records and sized["tokens_topic_record_bytes_mean"]:
                base = await baseline(
                    system.stack.kafka,
                    round(sized["tokens_topic_record_bytes_mean"]),
                    perf_records,
                    TOKENS.partitions,
                    say,
                )
        ok = True
    finally:
        if ok:
            shutil.rmtree(tmp, ignore_errors=True)
    rate = capacity["delivered_tokens_per_s"] if capacity else None
    return {
        "machine": {
            **machine(),
            "load_average_1m_at_end": round(os.getloadavg()[0], 2),
            "note": "every role, the broker and the clients share this host (loopback)",
        },
        "step_ms": step_ms,
        "judge": judge,
        "lag_limit_ms": lag_limit_ms,
        "capacity_tokens_per_s": rate,
        "capacity_stage": capacity["streams"] if capacity else None,
        # what the capacity leaves out unless --catch-up-s makes it a criterion: the consumer groups of
        # ts.tokens still behind when the meter stopped waiting for them at that stage
        "capacity_requires_catch_up": bool(catch_up_s),
        "behind_at_capacity": _behind(capacity) if capacity else [],
        "baseline": base,
        "capacity_vs_baseline": round(rate / base["records_per_s"], 3) if rate and base else None,
        "stages": stages,
    }


def _judge(f: dict, lag_limit_ms: float, catch_up_s: float) -> tuple[bool, list[str]]:
    why = []
    if f["lag_ms"]["p99"] is None or f["lag_ms"]["p99"] > lag_limit_ms:
        why.append(f"lag p99 {f['lag_ms']['p99']} ms > {lag_limit_ms:g}")
    if f["chunks_missing"]:
        why.append(f"{f['chunks_missing']} chunks never reached their client")
    if f["frames_out_of_order"]:
        why.append(f"{f['frames_out_of_order']} frames out of order")
    if f["written_tokens_per_s"] < KEPT_UP * f["offered_tokens_per_s"]:
        why.append("the worker wrote under 90% of what its GPU offered")
    late = [g for g, s in f["catch_up_s"].items() if not isinstance(s, float | int) or s > catch_up_s]
    if catch_up_s and late:
        why.append(f"not caught up {catch_up_s:g} s after the streams' end: {', '.join(late)}")
    return not why, why


class Stage:
    """One stage: `streams` streams opened at once, measured over a window once all of them stream."""

    def __init__(
        self, meter, port: int, key: str, step_s: float, window_s: float, warm_s: float, catch_up_s: float
    ):
        self.meter, self.port, self.key, self.catch_up_s = meter, port, key, catch_up_s
        self.step_s, self.window_s, self.warm_s = step_s, window_s, warm_s

    async def run(self, number: int, streams: int, measure: bool = True) -> dict:
        from bench.rawhttp import chat_post
        from bench.sse_clients import Clients
        from topics import TOKENS

        opening_s = 3.0 + streams / 200  # the time all of them may take to open, generously
        max_tokens = math.ceil((opening_s + self.warm_s + self.window_s + 1.0) / self.step_s)
        if not measure:
            max_tokens = math.ceil(2.0 / self.step_s)
        bodies = [
            chat_post(
                self.port,
                {
                    "model": MODEL,
                    "stream": True,
                    "max_tokens": max_tokens,
                    "messages": [{"role": "user", "content": f"Stage {number}, stream {i}: a story."}],
                },
                key=self.key,
            )
            for i in range(streams)
        ]
        clients = Clients(self.port, bodies)
        self.meter.pids["clients"] = clients.start()._proc.pid
        try:
            first = None
            deadline = time.monotonic() + 60 + streams / 20
            while clients.settled < streams and time.monotonic() < deadline:
                if first is None and clients.opened.value:
                    first = time.time()
                await asyncio.sleep(0.02)
            first = first or time.time()
            if not measure:
                await clients.result(timeout=120)
                return {}
            opened_s = time.time() - first
            await asyncio.sleep(self.warm_s)
            start = await self.meter.sample()
            # every stream still runs to the window's end: the first one opened ends max_tokens steps later
            end_at = min(start.at + self.window_s, first + max_tokens * self.step_s - 0.5)
            await asyncio.sleep(max(0.5, end_at - time.time()))
            end = await self.meter.sample()
            seen = await clients.result(timeout=max_tokens * self.step_s + 120)
            # every stream has ended: each processor commits past all of the stage, or it fell behind
            caught = await self.meter.catch_up(
                TOKENS.name, await self.meter.offsets(), limit_s=(self.catch_up_s or 10.0) + 5
            )
        finally:
            clients.stop()
            self.meter.pids.pop("clients", None)
        chunks = await self.meter.chunks(TOKENS.name, start, end)
        return _figures(streams, self.step_s, opened_s, start, end, chunks, seen, caught)


def _figures(streams, step_s, opened_s, start, end, chunks, seen, caught) -> dict:
    """A stage's figures from its window's two samples, the chunks written and what the clients saw."""
    seconds = end.at - start.at
    inside = [c for c in chunks if start.at <= c.created_at < end.at]
    arrivals: dict[str, tuple[list[int], list[float]]] = {}
    for rid, got in seen.received.items():
        seqs = sorted(s for s in got if s >= 0)
        times = [got[s] for s in seqs]
        for i in range(len(times) - 2, -1, -1):  # a frame carries every chunk up to its own number
            times[i] = min(times[i], times[i + 1])
        arrivals[rid] = (seqs, times)
    lags, missing, delivered = [], 0, 0
    for c in inside:
        seqs, times = arrivals.get(c.request_id, ([], []))
        at = bisect_left(seqs, c.seq)
        if at == len(seqs):
            missing += 1
            continue
        lags.append((times[at] - c.created_at) * 1000)
        delivered += c.tokens
    written = sum(c.tokens for c in inside)
    per_token = max(1, delivered)
    cpu = {
        name: round((end.cpu_s[name] - start.cpu_s[name]) / per_token * 1e6, 1)
        for name in end.cpu_s
        if name in start.cpu_s
    }
    cores = {name: round((end.cpu_s[name] - start.cpu_s[name]) / seconds, 2) for name in cpu}
    topics = {}
    for topic in sorted({t for t, _ in end.offsets}):
        records = sum(off - start.offsets.get((t, p), 0) for (t, p), off in end.offsets.items() if t == topic)
        written_bytes = end.log_bytes.get(topic, 0) - start.log_bytes.get(topic, 0)
        if records > 0:
            topics[topic] = {
                "records": records,
                "bytes": written_bytes,
                "records_per_token": round(records / per_token, 3),
                "bytes_per_token": round(written_bytes / per_token, 1),
            }
    return {
        "streams": streams,
        "offered_tokens_per_s": round(streams / step_s, 1),
        "written_tokens_per_s": round(written / seconds, 1),
        "delivered_tokens_per_s": round(delivered / seconds, 1),
        "window_s": round(seconds, 2),
        "all_open_after_s": round(opened_s, 2),
        "streams_open": sum(1 for r in seen.rid_of if r),
        "http_statuses": seen.statuses,
        "refusals": seen.refusals,
        "chunks_in_window": len(inside),
        "tokens_per_chunk": round(written / max(1, len(inside)), 2),
        "chunks_missing": missing,
        "frames_out_of_order": seen.out_of_order,
        "lag_ms": {
            "p50": round(nearest_rank(lags, 50), 1) if lags else None,
            "p99": round(nearest_rank(lags, 99), 1) if lags else None,
            "max": round(max(lags), 1) if lags else None,
        },
        "cpu_us_per_token": cpu,
        "cpu_cores_busy": cores,
        "topics": topics,
        "tokens_topic_record_bytes_mean": round(  # a step record counted once (its chunks share it)
            sum(c.size for c in inside) / max(1, len({c.record for c in inside})), 1
        ),
        "catch_up_s": caught,
    }


def _behind(f: dict) -> list[str]:
    """The processors' consumer groups still behind the stage when the meter stopped waiting."""
    return [g for g, s in f["catch_up_s"].items() if not isinstance(s, float | int)]


def _line(number: int, total: int, f: dict) -> str:
    roles = ", ".join(f"{n} {v:g}" for n, v in sorted(f["cpu_us_per_token"].items(), key=lambda kv: -kv[1]))
    caught = ", ".join(
        f"{g} {s:g} s" if isinstance(s, float | int) else f"{g} {s['behind_records']} behind"
        for g, s in f["catch_up_s"].items()
    )
    verdict = "sustained" if f["sustained"] else "NOT sustained: " + "; ".join(f["why_not"])
    return (
        f"stage {number + 1}/{total}: {f['streams']} streams, "
        f"offered {f['offered_tokens_per_s']:,.0f} tok/s, "
        f"written {f['written_tokens_per_s']:,.0f}, delivered {f['delivered_tokens_per_s']:,.0f} tok/s; "
        f"lag p50/p99 {f['lag_ms']['p50']}/{f['lag_ms']['p99']} ms; CPU us/token: {roles}; "
        f"caught up: {caught}; {verdict}"
    )


def _summary(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    columns = ("streams", "offered", "delivered tok/s", "lag p50 / p99 ms", "sustained")
    table = Table(*columns, title="tokenstream bench tokens")
    for s in r["stages"]:
        table.add_row(
            str(s["streams"]),
            f"{s['offered_tokens_per_s']:,.0f}",
            f"{s['delivered_tokens_per_s']:,.0f}",
            f"{s['lag_ms']['p50']} / {s['lag_ms']['p99']}",
            "yes" if s["sustained"] else "no: " + "; ".join(s["why_not"]),
        )
    Console(width=160).print(table)
    base = r["baseline"]
    if base:
        behind = r.get("behind_at_capacity") or []
        caveat = f" (delivered; behind at that stage: {', '.join(behind)})" if behind else ""
        print(
            f"capacity {r['capacity_tokens_per_s']} tokens/s{caveat}; Kafka's ProducerPerformance "
            f"{base['records_per_s']:,.0f} records/s of {base['record_size']} bytes (acks=all): "
            f"ratio {r['capacity_vs_baseline']}"
        )
    print(f"output check's judge: {r['judge']}")
    print(f"machine: {r['machine']['cpu']} ({r['machine']['isa']}), {r['machine']['cpus']} cores")
