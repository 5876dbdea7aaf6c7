"""Liveness, readiness, Prometheus metrics and the chat page."""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import APIRouter, Depends
from fastapi.responses import FileResponse, JSONResponse, Response

from common import vectordb
from gateway.auth import admin
from gateway.deps import pipeline
from gateway.pipeline import Gateway

STATIC = Path(__file__).parent.parent / "static"
router = APIRouter()


@router.get("/", include_in_schema=False)
async def index() -> FileResponse:
    return FileResponse(STATIC / "index.html", media_type="text/html")


@router.get("/voice.js", include_in_schema=False)
async def voice_script() -> FileResponse:
    """The chat page's voice mode (hold to talk; the answer spoken as it streams)."""
    return FileResponse(STATIC / "voice.js", media_type="text/javascript")


@router.get("/health/live")
async def live(gw: Gateway = Depends(pipeline)) -> dict:
    return {"status": "ok", "instance": gw.cfg.instance_id}


@router.get("/health/ready")
async def ready(gw: Gateway = Depends(pipeline)) -> JSONResponse:
    """200 only while a request can be served: the broker answers, the tokens fan-out runs, Redis
    (API keys, rate limits) answers and, where the deployment has regions, every region's key homes
    were read; otherwise 503 with what is missing. Weaviate (the semantic cache)
    and the cache Redis (the exact cache) are optional: while one is away the answer stays 200 and
    `degraded` says so (lookups are misses)."""
    redis, cache, weaviate = await asyncio.gather(
        gw.redis_reachable(), gw.cache_reachable(), vectordb.aready(timeout_s=0.5)
    )
    broker, fanout = gw.admission.healthy(), gw.streaming
    homes = gw.key_homes is None or gw.key_homes.caught_up
    ready = broker and fanout and redis and homes  # gw.ready, with Redis
    missing = [
        what
        for what, ok in (
            ("broker: no answer", broker),
            ("tokens fan-out: not connected", fanout),
            ("redis: no answer (API keys, rate limits)", redis),
            ("key homes: the regions' keys not read yet", homes),
        )
        if not ok
    ]
    degraded = [
        what
        for what, ok in (
            ("weaviate: no answer (semantic cache lookups are misses)", weaviate),
            ("cache redis: no answer (exact cache lookups are misses)", cache),
        )
        if not ok
    ]
    body = {
        "ready": ready,
        "instance": gw.cfg.instance_id,
        "partitions": gw.partitions,
        "region": gw.region or None,
        "broker": broker,
        "fanout": fanout,
        "redis": redis,
        "cache": cache,
        "weaviate": weaviate,
        "detail": missing,
        "degraded": degraded,
    }
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get("/metrics", dependencies=[Depends(admin)])
async def metrics(gw: Gateway = Depends(pipeline)) -> Response:
    """Prometheus metrics, for an admin key only (scrape with `authorization: Bearer ...`)."""
    return Response(gw.metrics.render(), media_type="text/plain; version=0.0.4")
