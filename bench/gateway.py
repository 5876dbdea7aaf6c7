"""`tokenstream bench gateway`: SSE fan-out at scale and the gateway's share of time to first token.

One run against a throwaway Kafka and Redis and a real `tokenstream gateway` process:

(a) fan-out: `--streams` (default 1,000) concurrent SSE streams, all open at once, fed by
    synthetic token events that this benchmark writes to each request's reply partition at a
    fixed rate (`--rate` tokens per second per stream). Delivery lag = the client's receipt time
    minus the token event's created_at (same clock: one host). Gateway RSS is sampled throughout.
(b) pipeline overhead at light load: one request at a time; the client's TTFT (request sent ->
    first content chunk) minus the synthetic worker's own TTFT (ChatRequest received -> first
    token written). That difference is what the gateway and the broker add: HTTP, the
    ChatRequest write, two broker hops and the SSE frame. Targets: p50 <= 15 ms, p99 <= 50 ms.

The synthetic worker reads ts.chat.requests directly (the conversation processor is not part of
what is measured). Clients are raw asyncio sockets speaking HTTP/1.0, so the load generator costs
little CPU next to the gateway. Results go to bench/results/gateway.json.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import typer

from bench.rawhttp import chat_post, first_token
from bench.stats import nearest_rank

RESULTS = Path(__file__).parent / "results" / "gateway.json"
MODEL = "bench-synthetic"
OPEN_DEADLINE_S = 300  # how long part (a) waits for all its streams to open


_pct = nearest_rank


def main(
    streams: int = typer.Option(1000, help="concurrent SSE streams in part (a)"),
    rate: float = typer.Option(2.0, help="tokens per second per stream in part (a)"),
    tokens: int = typer.Option(20, help="tokens per stream in part (a)"),
    light_requests: int = typer.Option(200, help="sequential requests in part (b)"),
    out: Path = typer.Option(RESULTS, help="where the JSON results go"),
) -> None:
    """Fan-out delivery lag and RSS with 1,000+ SSE streams; gateway TTFT overhead at light load."""
    import asyncio
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 65536)), hard))
    result = asyncio.run(_run(streams, rate, tokens, light_requests))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    _table(result)
    print(f"written to {out}")


@contextlib.asynccontextmanager
async def synthetic_gateway(stack, tmp: Path, key_name: str):
    """A real `tokenstream gateway` process serving the synthetic model on a free port, and an
    unlimited API key for it; yields (process, port, key) and stops the process at the end."""
    import asyncio
    import os
    import subprocess
    import sys
    import urllib.request

    from tokenstream.keys import KeyStore
    from tokenstream.stack.service import free_port
    from topics import CHAT_REQUESTS, CONTROL, TOKENS, inference_topic
    from topics.admin import apply

    await apply([CHAT_REQUESTS, TOKENS, CONTROL, inference_topic(MODEL)], stack.kafka.address)
    port = free_port()
    env = {
        **os.environ,
        **stack.environment(),
        "PYTHONUNBUFFERED": "1",
        "TOKENSTREAM_GATEWAY_MODELS": json.dumps([MODEL]),
        "TOKENSTREAM_GATEWAY_ADMISSION_BUDGET_S": "100000",
        # the synthetic worker stands in for the processors too: no input verdicts come
        "TOKENSTREAM_GATEWAY_SCREENING": "serial",
        # every stream waits for its first token until all are open (minutes at 10,000): the progress
        # deadline (60 s by default) would end the first ones before the feed starts
        "TOKENSTREAM_GATEWAY_PROGRESS_TIMEOUT_S": str(OPEN_DEADLINE_S + 60),
    }

    def start() -> subprocess.Popen:
        with open(tmp / "gateway.log", "wb") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "tokenstream.cli", "gateway", "--port", str(port)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    gateway = await asyncio.to_thread(start)
    try:
        for _ in range(300):
            try:
                await asyncio.to_thread(
                    urllib.request.urlopen, f"http://127.0.0.1:{port}/health/ready", None, 1
                )
                break
            except Exception:  # noqa: BLE001
                await asyncio.sleep(0.2)
        else:
            raise RuntimeError("gateway did not become ready: " + (tmp / "gateway.log").read_text())
        key, _ = KeyStore(stack.redis.address).create("bench", tier="paid", name=key_name, max_streams=-1)
        yield gateway, port, key
    finally:
        gateway.terminate()
        try:
            await asyncio.to_thread(gateway.wait, 10)
        except Exception:  # noqa: BLE001
            gateway.kill()


async def _run(streams: int, rate: float, tokens: int, light_requests: int) -> dict:
    import os
    import platform
    import tempfile

    import psutil

    from tokenstream.stack import Stack
    from tokenstream.stack.stack import use

    tmp = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    stack = Stack.ephemeral(tmp)
    say = lambda m: print(m, flush=True)
    stack.kafka.start(say)
    stack.redis.start(say)
    stack.cache.start(say)
    use(
        {**stack.kafka.environment(), "TOKENSTREAM_REDIS_URL": stack.redis.address}
    )  # this process's keyring too
    try:
        async with synthetic_gateway(stack, tmp, "bench gateway") as (gateway, port, key):
            bootstrap = stack.kafka.address
            proc = psutil.Process(gateway.pid)
            worker = await SyntheticWorker(bootstrap).start()
            try:
                say("(b) light load: TTFT overhead")
                light = await _light(port, key, worker, light_requests)
                say(f"(a) fan-out: {streams} streams, {tokens} tokens at {rate}/s each")
                fan = await fanout(port, key, worker, proc, streams, rate, tokens)
            finally:
                await worker.stop()
            return {
                "command": f"tokenstream bench gateway --streams {streams} --rate {rate} --tokens {tokens} "
                f"--light-requests {light_requests}",
                "machine": {
                    "cpus": os.cpu_count(),
                    "python": platform.python_version(),
                    "load_average_1m_at_end": round(os.getloadavg()[0], 2),
                    "note": "gateway, broker and load generator share this host (loopback)",
                },
                "fanout": fan,
                "light_load": light,
                "targets": {"overhead_p50_ms": 15, "overhead_p99_ms": 50},
            }
    finally:
        stack.cache.stop(say)
        stack.redis.stop(say)
        stack.kafka.stop(say)


class SyntheticWorker:
    """Stands in for the pipeline: reads ChatRequests, writes token events where they ask, and notes
    each request's first record in Redis as a worker does (common/first_records.py)."""

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        self.arrived: dict[str, tuple[int, float]] = {}  # request_id -> (reply partition, received at)
        self.first_written: dict[str, float] = {}
        self.auto_answer = False
        self._waiters: list = []

    async def start(self) -> SyntheticWorker:
        import asyncio

        from aiokafka.structs import TopicPartition

        from common.config import settings
        from common.first_records import FirstRecords
        from producers import start_consumer, start_producer
        from topics import CHAT_REQUESTS

        self.first = FirstRecords(settings().redis_url)
        self.producer = await start_producer(self.bootstrap)
        self.consumer = await start_consumer(group=None, bootstrap=self.bootstrap)
        tps = [TopicPartition(CHAT_REQUESTS.name, p) for p in range(CHAT_REQUESTS.partitions)]
        self.consumer.assign(tps)
        await self.consumer.seek_to_end(*tps)
        for tp in tps:
            await self.consumer.position(tp)
        self.task = asyncio.create_task(self._read())
        return self

    async def stop(self) -> None:
        self.task.cancel()
        await self.consumer.stop()
        await self.producer.stop()
        await self.first.close()

    async def _read(self) -> None:
        import time as _t

        from schemas import ChatRequest, decode

        while True:
            for records in (await self.consumer.getmany(timeout_ms=100)).values():
                for record in records:
                    req = decode(record.value, ChatRequest)
                    now = _t.time()
                    self.arrived[req.request_id] = (req.reply_partition, now)
                    if self.auto_answer:
                        await self._answer_now(req.request_id, req.reply_partition, now)

    async def _answer_now(self, rid: str, partition: int, received: float) -> None:
        """Light load: first token at once (the worker's own TTFT is ~0 and measured), then done."""
        from producers import publish
        from schemas import Completion, TokenChunk, Usage
        from topics import TOKENS

        ack = await publish(
            self.producer,
            TOKENS,
            TokenChunk(request_id=rid, seq=0, text="hello"),
            partition=partition,
            wait=False,
        )
        self.first.note(rid, ack)
        self.first_written[rid] = time.time()
        await publish(
            self.producer,
            TOKENS,
            Completion(
                request_id=rid, seq=1, finish_reason="stop", usage=Usage(prompt_tokens=1, completion_tokens=1)
            ),
            partition=partition,
            wait=False,
        )

    async def tick(self, rids: list[str], seq: int, last: bool) -> dict[str, float]:
        """One token for each of `rids` (and their completions when `last`); returns created_at. As the
        worker writes them: the chunks of one tick as one step record per reply partition
        (schemas/steps.py), each Completion after its partition's step record."""
        from common.unblocked import unblocked
        from producers import publish
        from schemas import Completion, TokenChunk, encode
        from schemas.steps import STEP_HEADERS, entry, step_value
        from topics import TOKENS

        created = {}
        steps: dict[int, list] = {}
        for rid in rids:
            ev = TokenChunk(request_id=rid, seq=seq, text=f" t{seq}")
            created[rid] = ev.created_at
            steps.setdefault(self.arrived[rid][0], []).append(entry(rid, await unblocked(encode, ev)))
        for partition, entries in steps.items():
            value = step_value(entries)
            ack = await self.producer.send(TOKENS.name, value, partition=partition, headers=STEP_HEADERS)
            if seq == 0:  # the requests' first record (no processor writes before it here)
                for e in entries:
                    self.first.note(e.key, ack)
        if last:
            for rid in rids:
                await publish(
                    self.producer,
                    TOKENS,
                    Completion(request_id=rid, seq=seq + 1, finish_reason="stop"),
                    partition=self.arrived[rid][0],
                    wait=False,
                )
        await self.producer.flush()
        return created


def _post(port: int, prompt: str, key: str) -> bytes:
    return chat_post(
        port,
        {"model": MODEL, "stream": True, "max_tokens": 64, "messages": [{"role": "user", "content": prompt}]},
        key=key,
    )


async def _light(port: int, key: str, worker: SyntheticWorker, n: int) -> dict:
    worker.auto_answer = True
    client_ttft, worker_ttft, overhead, inbound, outbound = [], [], [], [], []
    for i in range(n + 10):  # the first 10 warm up connections and code paths
        rid, t0, first = await first_token(port, _post(port, f"light {i}", key))
        if i < 10 or first is None or rid not in worker.first_written:
            continue
        client = first - t0
        own = worker.first_written[rid] - worker.arrived[rid][1]
        client_ttft.append(client * 1000)
        worker_ttft.append(own * 1000)
        overhead.append((client - own) * 1000)
        inbound.append((worker.arrived[rid][1] - t0) * 1000)
        outbound.append((first - worker.first_written[rid]) * 1000)
    worker.auto_answer = False
    return {
        "requests": len(overhead),
        "client_ttft_ms": {"p50": _pct(client_ttft, 50), "p99": _pct(client_ttft, 99)},
        "worker_ttft_ms": {"p50": _pct(worker_ttft, 50), "p99": _pct(worker_ttft, 99)},
        "request_to_worker_ms": {"p50": _pct(inbound, 50), "p99": _pct(inbound, 99)},
        "first_token_to_client_ms": {"p50": _pct(outbound, 50), "p99": _pct(outbound, 99)},
        "overhead_ms": {
            "p50": _pct(overhead, 50),
            "p90": _pct(overhead, 90),
            "p99": _pct(overhead, 99),
            "max": max(overhead) if overhead else None,
        },
    }


async def fanout(
    port: int, key: str, worker: SyntheticWorker, proc, streams: int, rate: float, tokens: int
) -> dict:
    """`streams` SSE streams open at once (held by a process of their own), each fed `tokens` tokens
    at `rate`/s; delivery, lag and the gateway's memory."""
    import asyncio

    from bench.sse_clients import Clients

    before = set(worker.arrived)  # requests of earlier parts
    clients = Clients(port, [_post(port, f"stream {i}", key) for i in range(streams)])
    rss = [proc.memory_info().rss]
    stop_sampling = asyncio.Event()

    async def sample() -> None:
        while not stop_sampling.is_set():
            rss.append(proc.memory_info().rss)
            await asyncio.sleep(0.25)

    sampler = asyncio.create_task(sample())
    t_open = time.time()
    clients.start()
    try:
        deadline = time.time() + OPEN_DEADLINE_S
        while clients.settled < streams and time.time() < deadline:
            await asyncio.sleep(0.1)
        open_s = time.time() - t_open
        while len(set(worker.arrived) - before) < clients.opened.value and time.time() < deadline:
            await asyncio.sleep(0.05)  # a stream's request reaches the worker as its first event goes out
        rids = [r for r in worker.arrived if r not in before]
        cpu_open = sum(proc.cpu_times()[:2])
        fed = await _feed(worker, rids, rate, tokens)
        seen = await clients.result(timeout=120)
        cpu_fed = sum(proc.cpu_times()[:2]) - cpu_open
    finally:
        clients.stop()
    stop_sampling.set()
    await sampler
    result = _delivery(seen, fed, streams, open_s, rate, tokens, rss)
    # the gateway's CPU from the first token to the last stream's end, per token delivered
    result["gateway_cpu_us_per_token"] = round(cpu_fed * 1e6 / max(1, result["tokens_delivered"]), 1)
    return result


async def _feed(worker: SyntheticWorker, rids: list[str], rate: float, tokens: int) -> dict:
    """`tokens` tokens to each of `rids` at `rate`/s: {rid: {seq: created_at}}."""
    import asyncio

    created: dict[str, dict[int, float]] = {r: {} for r in rids}
    # each stream gets its own phase within the token interval: a steady feed, not bursts of 1,000
    groups = 10
    t_start = time.time()
    for seq in range(tokens):
        for g in range(groups):
            target = t_start + seq / rate + g / (rate * groups)
            await asyncio.sleep(max(0.0, target - time.time()))
            for rid, at in (await worker.tick(rids[g::groups], seq, last=seq == tokens - 1)).items():
                created[rid][seq] = at
    return created


def _delivery(seen, created: dict, streams: int, open_s: float, rate: float, tokens: int, rss: list) -> dict:
    """Each token's delivery lag (client receipt - the event's created_at; one host, one clock)."""
    rids = list(created)
    lags, missing, by_seq = [], 0, {}
    for rid in rids:
        got = seen.received.get(rid, {})
        for seq, at in created[rid].items():
            # a coalesced frame carries the id of its last token: earlier tokens arrive with it
            later = [t for s, t in got.items() if s >= seq]
            if not later:
                missing += 1
                continue
            lags.append((min(later) - at) * 1000)
            by_seq.setdefault(seq, []).append(lags[-1])
    return {
        "streams_requested": streams,
        "streams_open": sum(1 for r in seen.rid_of if r),
        "connect_errors": seen.connect_errors,
        "http_statuses": seen.statuses,
        "refusals": seen.refusals,
        "open_all_s": round(open_s, 2),
        "tokens_per_stream": tokens,
        "rate_per_stream": rate,
        "events_per_s_offered": round(len(rids) * rate, 1),
        "events_per_s_written": _written_rate(created),
        "tokens_delivered": len(lags),
        "tokens_missing": missing,
        "frames_out_of_order": seen.out_of_order,
        "delivery_lag_ms": {
            "p50": _pct(lags, 50),
            "p90": _pct(lags, 90),
            "p99": _pct(lags, 99),
            "max": max(lags) if lags else None,
        },
        "delivery_lag_p99_by_token_ms": {s: round(_pct(v, 99), 1) for s, v in sorted(by_seq.items())},
        "gateway_rss_mb": {
            "per_stream_kb": round((max(rss) - rss[0]) / 1024 / max(1, len(rids)), 1),
            "before": round(rss[0] / 2**20, 1),
            "peak": round(max(rss) / 2**20, 1),
            "after": round(rss[-1] / 2**20, 1),
        },
    }


def _written_rate(created: dict) -> float:
    """Token events the synthetic worker actually wrote per second (below the offered rate when it
    could not keep up): all of them over the span from the first to the last write."""
    times = [at for per in created.values() for at in per.values()]
    return round(len(times) / (max(times) - min(times)), 1) if len(times) > 1 else 0.0


def _table(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    f, lt = r["fanout"], r["light_load"]
    t = Table("measure", "value", "target", title="tokenstream bench gateway")
    t.add_row("(a) streams open at once", f"{f['streams_open']:,} / {f['streams_requested']:,}", ">= 1,000")
    rates = f"{f['events_per_s_offered']:,} / {f['events_per_s_written']:,}"
    t.add_row("(a) token events/s offered / written", rates, "")
    t.add_row(
        "(a) tokens delivered / missing", f"{f['tokens_delivered']:,} / {f['tokens_missing']}", "all / 0"
    )
    t.add_row(
        "(a) delivery lag p50 / p99",
        f"{f['delivery_lag_ms']['p50']:.1f} / {f['delivery_lag_ms']['p99']:.1f} ms",
        "",
    )
    t.add_row("(a) gateway CPU per token delivered", f"{f['gateway_cpu_us_per_token']:.1f} us", "")
    t.add_row(
        "(a) gateway RSS before / peak / after",
        "{before} / {peak} / {after} MB".format(**f["gateway_rss_mb"]),
        "bounded",
    )
    ok50 = lt["overhead_ms"]["p50"] <= r["targets"]["overhead_p50_ms"]
    ok99 = lt["overhead_ms"]["p99"] <= r["targets"]["overhead_p99_ms"]
    t.add_row(
        "(b) client TTFT p50 / p99",
        f"{lt['client_ttft_ms']['p50']:.1f} / {lt['client_ttft_ms']['p99']:.1f} ms",
        "",
    )
    t.add_row(
        "(b) worker's own TTFT p50 / p99",
        f"{lt['worker_ttft_ms']['p50']:.2f} / {lt['worker_ttft_ms']['p99']:.2f} ms",
        "",
    )
    t.add_row(
        "(b) request -> worker p50 / p99",
        f"{lt['request_to_worker_ms']['p50']:.1f} / {lt['request_to_worker_ms']['p99']:.1f} ms",
        "",
    )
    t.add_row(
        "(b) first token -> client p50 / p99",
        f"{lt['first_token_to_client_ms']['p50']:.1f} / {lt['first_token_to_client_ms']['p99']:.1f} ms",
        "",
    )
    t.add_row(
        "(b) overhead p50",
        f"{lt['overhead_ms']['p50']:.1f} ms",
        f"<= 15 ms {'[green]ok' if ok50 else '[red]missed'}",
    )
    t.add_row(
        "(b) overhead p99",
        f"{lt['overhead_ms']['p99']:.1f} ms",
        f"<= 50 ms {'[green]ok' if ok99 else '[red]missed'}",
    )
    Console().print(t)
