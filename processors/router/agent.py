"""The router: ts.requests.screened (and ts.requests.prepared, screened in parallel) -> ts.inference.<target>.

Routes come from configuration, overlaid by RouteUpdate events on the compacted ts.routes
topic (read whole at start, then followed), so canary weights change at run time and a
rollback is one event. Load is the consumer lag of each target's worker group.
"""

from __future__ import annotations

import asyncio
import functools
import logging

import msgspec
from aiokafka.errors import KafkaError
from aiokafka.structs import TopicPartition

from common import tracing
from common.config import settings
from processors.effects import Ledger
from processors.faust_app import make_app, send, topic, traced, typed
from processors.router.config import Route, RouterSettings
from processors.router.policy import decide
from processors.router.prefixes import Placement, PrefixMap, by_cache_key
from producers import start_consumer
from producers.consume import caught_up
from producers.lag import LagSampler
from schemas import Completion, DecodeError, InferenceRequest, PrefixHeld, RouteUpdate, WorkerLoad, decode
from topics import DEAD_LETTER, KV_PREFIXES, PREPARED, ROUTES, SCREENED, TOKENS, inference_topic, worker_group

log = logging.getLogger(__name__)

cfg = RouterSettings()
app = make_app("router")
ledger = Ledger("router")
# Requests screened in series arrive on ts.requests.screened once safety passed them; requests
# screened in parallel are taken from ts.requests.prepared at once (safety judges them meanwhile).
inbox = app.topic(
    SCREENED.name,
    PREPARED.name,
    key_type=bytes,
    value_type=bytes,
    key_serializer="raw",
    value_serializer="raw",
)
tokens_out, dead_letters = topic(app, TOKENS), topic(app, DEAD_LETTER)
routes: dict[str, Route] = dict(cfg.routes)  # a cache of config + ts.routes, rebuilt at every start
routes_ready = asyncio.Event()
sampler = LagSampler(settings().kafka_bootstrap)
prefixes = PrefixMap(stale_s=cfg.prefix_stale_s)
_prefix_reader: dict[str, object] = {}  # the consumer following ts.kv.prefixes, while it runs
_outputs: dict[str, object] = {}


def apply_update(update: RouteUpdate) -> None:
    base = routes.get(update.model) or cfg.routes.get(update.model) or Route()
    routes[update.model] = base.model_copy(
        update={"weights": dict(update.weights), "fallback": update.fallback or base.fallback}
    )
    log.info("route %s: weights %s, fallback %s", update.model, update.weights, routes[update.model].fallback)


@app.task
async def follow_routes() -> None:
    """Read ts.routes from the beginning (compacted: the latest weights per model), then follow it."""
    consumer = await start_consumer(group=None)
    try:
        tps = [TopicPartition(ROUTES.name, p) for p in range(ROUTES.partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        while True:
            for records in (await consumer.getmany(timeout_ms=200)).values():
                for record in records:
                    try:
                        apply_update(decode(record.value or b"", RouteUpdate))
                    except DecodeError as exc:
                        log.warning("ignoring bad route update at offset %d: %s", record.offset, exc.reason)
            if not routes_ready.is_set() and await caught_up(consumer, ends):
                routes_ready.set()
    finally:
        await consumer.stop()


@app.task
async def follow_prefixes() -> None:
    """Read ts.kv.prefixes from the beginning (compacted: the latest holder of each prefix and each
    worker's latest heartbeat), then follow it. Until it is read, turns are placed by their key."""
    if not cfg.prefix_routing:
        return
    consumer = await start_consumer(group=None)
    try:
        tps = [TopicPartition(KV_PREFIXES.name, p) for p in range(KV_PREFIXES.partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        _prefix_reader["consumer"] = consumer
        while True:
            for records in (await consumer.getmany(timeout_ms=200)).values():
                for record in records:
                    try:
                        prefixes.apply(decode(record.value or b"", PrefixHeld, WorkerLoad))
                    except DecodeError as exc:
                        log.warning(
                            "ignoring a bad %s record at offset %d: %s",
                            KV_PREFIXES.name,
                            record.offset,
                            exc.reason,
                        )
    finally:
        _prefix_reader.pop("consumer", None)
        await consumer.stop()


async def placement(request: InferenceRequest, target: str):
    """Where the request goes by prefix (processors/router/prefixes.py). A later turn whose prefix is
    not known yet waits (at most prefix_catch_up_s) until ts.kv.prefixes is read to its end: the
    answer before it was announced just before its client saw it."""
    place = prefixes.place(request, target)
    consumer = _prefix_reader.get("consumer")
    if place.reason != "no-prefix" or consumer is None:
        return place
    loop = asyncio.get_running_loop()
    deadline = loop.time() + cfg.prefix_catch_up_s
    try:
        ends = await consumer.end_offsets(list(consumer.assignment()))
        while not await caught_up(consumer, ends) and loop.time() < deadline:
            await asyncio.sleep(0.005)
    except KafkaError as exc:  # the broker away: placed by its key
        log.debug("prefix map not caught up: %s", exc)
    return prefixes.place(request, target)


def targets() -> set[str]:
    found = set()
    for model, route in routes.items():
        found |= set(route.weights or {model: 1.0}) | set(route.tiers.values())
        if route.fallback:
            found.add(route.fallback)
    return found


@app.task
async def sample_loads() -> None:
    while True:
        for target in targets():
            try:
                await sampler.sample(worker_group(target), inference_topic(target).name)
            except Exception as exc:  # noqa: BLE001 - the broker may be restarting
                log.warning("lag sample of %s failed: %s", target, exc)
        await asyncio.sleep(cfg.poll_s)


def waits() -> dict[str, float]:
    return {load.group.removeprefix("worker."): load.wait_s(cfg.min_rate) for load in sampler.loads.values()}


async def exists(target: str) -> bool:
    load = sampler.loads.get((worker_group(target), inference_topic(target).name))
    if load is None or load.partitions == 0:
        load = await sampler.sample(worker_group(target), inference_topic(target).name)
    return load.partitions > 0


@app.agent(inbox)
async def route(stream):
    await routes_ready.wait()
    async for request, raw in typed(stream, {SCREENED.name: SCREENED, PREPARED.name: PREPARED}, dead_letters):
        if raw.message.topic == PREPARED.name and request.screening != "parallel":
            continue  # screened in series: it comes back on ts.requests.screened if it passes
        # a request routed before a restart is not routed again
        with traced(raw, f"route {request.model}", tracing.request_attributes(request)) as span:
            await ledger.once("routed", request.request_id, functools.partial(forward, request, span))


async def forward(request: InferenceRequest, span: tracing.Hop) -> None:
    """Send the request to its target's worker topic, or end it with an error if none serves it."""
    tier = request.tier or cfg.tenant_tiers.get(request.tenant, cfg.default_tier)
    decision = decide(
        request.request_id,
        request.model,
        routes.get(request.model),
        tier,
        waits(),
        cfg.wait_budget_s,
        request.priority,
    )
    trace = span.trace
    span.set(
        {
            "gen_ai.response.model": decision.target,
            "tokenstream.route.reason": decision.reason,
            "tokenstream.tier": tier,
        }
    )
    if not await exists(decision.target):
        await send(
            tokens_out,
            TOKENS,
            Completion(
                request_id=request.request_id,
                conversation_id=request.conversation_id,
                tenant=request.tenant,
                seq=0,
                finish_reason="error",
                error=f"no worker group serves model {decision.target!r}",
            ),
            key=request.request_id,
            partition=request.reply_partition,
            trace=trace,
        )
        return
    spec = inference_topic(decision.target)
    out = _outputs.get(spec.name) or _outputs.setdefault(spec.name, topic(app, spec))
    # a held prefix first (when prefix routing is on), else the client's prompt_cache_key, else the key
    place = await placement(request, decision.target) if cfg.prefix_routing else Placement(None, "off")
    place = by_cache_key(place, request, decision.target, spec.partitions)
    span.set({"tokenstream.route.prefix": place.reason, "tokenstream.route.prefix_worker": place.worker_id})
    await send(
        out,
        spec,
        msgspec.structs.replace(request, model=decision.target),
        key=request.request_id,
        partition=place.partition,
        trace=trace,
    )
    log.debug(
        "routed %s: %s -> %s (%s; prefix: %s)",
        request.request_id,
        request.model,
        decision.target,
        decision.reason,
        place.reason,
    )
