"""The gateway's FastAPI app: OpenAI chat completions over the Kafka pipeline.

    POST /v1/chat/completions                      a ChatRequest event; the answer from token events
    GET  /v1/chat/completions/{id}/stream          resume a stream (Last-Event-ID), on any instance
    POST /v1/chat/completions/{id}/cancel          stop generating now (the chat page's stop button)
    POST /v1/files, /v1/vector_stores ...          uploads, vector stores (routes/files.py, vector_stores.py)
    POST /v1/responses, GET /v1/responses/{id}     the Responses API: a run of steps through server tools
    GET  /v1/models, /health/live, /health/ready, /metrics, / (the chat page)

Routes live in `gateway/routes/` (one module per resource); the instance's connections to the
pipeline in `gateway/pipeline.py`; turning token events into frames in `gateway/framing.py`.
"""

from __future__ import annotations

import contextlib

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from common import id_key, sealing
from gateway import openai_api as api
from gateway.config import GatewaySettings
from gateway.home_region import HomeRegion
from gateway.limits import BodyLimits
from gateway.pipeline import Gateway
from gateway.routes import ROUTERS

UPLOAD_FORM_BYTES = 64 * 1024  # the multipart framing and the purpose field around an uploaded file


def create_app(
    cfg: GatewaySettings, bootstrap: str, redis_url: str | None = None, cache_url: str | None = None
) -> FastAPI:
    id_key.install()  # request ids are sealed with the deployment's key (schemas/ids.py)
    sealing.install(redis_url)  # and tenants' content with their conversations' keys (common/sealing.py)
    gw = Gateway(cfg, bootstrap, redis_url, cache_url)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await gw.start()
        try:
            yield
        finally:
            await gw.stop()

    app = FastAPI(title="tokenstream gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.gateway = gw
    app.add_exception_handler(RequestValidationError, api.validation_error_handler)
    app.add_exception_handler(api.APIError, api.api_error_handler)
    app.add_exception_handler(HTTPException, api.http_error_handler)
    app.add_exception_handler(Exception, api.unexpected_error_handler)
    if gw.key_homes is not None:  # a deployment with regions: a key at home elsewhere is served there
        app.add_middleware(HomeRegion, gateway=gw)
    app.add_middleware(
        BodyLimits,
        max_body_bytes=cfg.max_body_bytes,
        uploads={
            "/v1/files": cfg.file_max_bytes + UPLOAD_FORM_BYTES,
            "/v1/audio/transcriptions": cfg.audio_max_bytes + UPLOAD_FORM_BYTES,
            "/v1/audio/translations": cfg.audio_max_bytes + UPLOAD_FORM_BYTES,
        },
    )
    for router in ROUTERS:
        app.include_router(router)
    return app
