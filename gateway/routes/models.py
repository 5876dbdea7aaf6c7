"""GET /v1/models and /v1/models/{name}."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from gateway import openai_api as api
from gateway.auth import principal
from gateway.deps import pipeline
from gateway.pipeline import Gateway
from schemas.speech import MODEL_ALIASES, SPEAK_MODEL, TRANSCRIBE_MODEL

# the speech models the tool processor serves (/v1/audio), under their names and OpenAI's
SPEECH_MODELS = (TRANSCRIBE_MODEL, SPEAK_MODEL, *MODEL_ALIASES)

router = APIRouter(prefix="/v1", dependencies=[Depends(principal)])


def model_entry(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "tokenstream"}


@router.get("/models")
async def list_models(gw: Gateway = Depends(pipeline)) -> dict:
    return {"object": "list", "data": [model_entry(name) for name in (*gw.cfg.models, *SPEECH_MODELS)]}


@router.get("/models/{name}")
async def get_model(name: str, gw: Gateway = Depends(pipeline)) -> dict:
    if name not in gw.cfg.models and name not in SPEECH_MODELS:
        raise api.model_not_found(name)
    return model_entry(name)
