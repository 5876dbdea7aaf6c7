"""Liveness, readiness, Prometheus metrics and the chat page."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Depends
from fastapi.responses import FileResponse, JSONResponse, Response

from gateway.auth import admin
from gateway.deps import pipeline
from gateway.pipeline import Gateway

STATIC = Path(__file__).parent.parent / "static"
router = APIRouter()


@router.get("/", include_in_schema=False)
async def index() -> FileResponse:
    return FileResponse(STATIC / "index.html", media_type="text/html")


@router.get("/health/live")
async def live(gw: Gateway = Depends(pipeline)) -> dict:
    return {"status": "ok", "instance": gw.cfg.instance_id}


@router.get("/health/ready")
async def ready(gw: Gateway = Depends(pipeline)) -> JSONResponse:
    """200 only while a request can be served: the broker answers, the tokens fan-out runs and Redis
    (API keys, rate limits) answers; otherwise 503 with what is missing."""
    redis = await gw.redis_reachable()
    ready = gw.ready and redis
    body = {"ready": ready, "instance": gw.cfg.instance_id, "partitions": gw.partitions,
            "broker": gw.admission.healthy(), "fanout": gw.fanout is not None, "redis": redis}
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get("/metrics", dependencies=[Depends(admin)])
async def metrics(gw: Gateway = Depends(pipeline)) -> Response:
    """Prometheus metrics, for an admin key only (scrape with `authorization: Bearer ...`)."""
    return Response(gw.metrics.render(), media_type="text/plain; version=0.0.4")
