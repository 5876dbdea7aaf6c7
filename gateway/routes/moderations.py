"""`POST /v1/moderations`: OpenAI's moderation endpoint, answered by this deployment's safety classifier
through the log like every other verdict.

Each text goes to ts.requests.prepared as an InferenceRequest screened `moderation`: the safety processor
judges it as it judges a request's input, writes the verdict to ts.safety.verdicts (where an auditor sees
it) and in band to this instance's tokens partition, and nothing is generated. The classifier judges
OpenAI's top-level categories it was trained on; a subcategory (`hate/threatening`, ...) it does not
judge is reported false, scored 0 and applied to no input type. Images are a 400: the classifier reads text.
"""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Literal

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field

from gateway import openai_api as api
from gateway.auth import principal
from gateway.deps import pipeline
from gateway.pipeline import Gateway
from gateway.responses_api import MODERATION_MODELS
from gateway.resume import new_request_id
from producers import publish
from schemas import ChatMessage, InferenceRequest, SafetyVerdict
from schemas import keys as K
from schemas.ids import new_item_id
from topics import PREPARED

router = APIRouter(prefix="/v1")
MAX_INPUTS = 32
MAX_CHARS = 100_000
#: OpenAI's categories, in its order; the classifier judges those of them its policy names
CATEGORIES = (
    "harassment",
    "harassment/threatening",
    "hate",
    "hate/threatening",
    "illicit",
    "illicit/violent",
    "self-harm",
    "self-harm/intent",
    "self-harm/instructions",
    "sexual",
    "sexual/minors",
    "violence",
    "violence/graphic",
)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str = Field(max_length=MAX_CHARS)


class ImagePart(BaseModel):
    """Named in a 400: the classifier cannot judge images."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image_url"]


class ModerationRequest(api.UnicodeBody):
    model_config = ConfigDict(extra="forbid")

    input: (
        Annotated[str, Field(max_length=MAX_CHARS)]
        | list[Annotated[str, Field(max_length=MAX_CHARS)]]
        | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]]
    )
    model: str = Field("omni-moderation-latest", max_length=api.MAX_NAME_CHARS)


def texts_of(body: ModerationRequest) -> list[str]:
    """The texts to judge, one result each (a list of parts is one text per part, as OpenAI answers)."""
    given = [body.input] if isinstance(body.input, str) else body.input
    if not 0 < len(given) <= MAX_INPUTS:
        raise api.invalid_request(f"input must hold 1 to {MAX_INPUTS} texts", "input")
    texts = []
    for i, part in enumerate(given):
        if isinstance(part, ImagePart):
            raise api.invalid_request(
                f"input[{i}]: image inputs are not supported: this deployment's safety classifier judges "
                "text only.",
                f"input[{i}].type",
            )
        texts.append(part if isinstance(part, str) else part.text)
    return texts


def result(verdict: SafetyVerdict) -> dict:
    """One text's verdict in OpenAI's shape."""
    judged = set(verdict.scores)
    flagged = set(verdict.categories)
    return {
        "flagged": bool(flagged),
        "categories": {c: c in flagged for c in CATEGORIES},
        "category_scores": {c: float(verdict.scores.get(c, 0.0)) for c in CATEGORIES},
        "category_applied_input_types": {c: ["text"] if c in judged else [] for c in CATEGORIES},
    }


@router.post("/moderations")
async def moderations(
    body: ModerationRequest, gw: Gateway = Depends(pipeline), key: K.ApiKey = Depends(principal)
):
    if body.model not in MODERATION_MODELS:
        raise api.invalid_request(
            f"model {body.model!r} is not served here; use one of {', '.join(MODERATION_MODELS)} (each is "
            "this deployment's safety classifier).",
            "model",
        )
    texts = texts_of(body)
    partition, now = gw.reply_partition(), time.time()
    rids = [new_request_id(partition, now) for _ in texts]
    streams = [gw.fanout.subscribe(rid) for rid in rids]
    try:
        await asyncio.gather(
            *(
                publish(
                    gw.producer,
                    PREPARED,
                    InferenceRequest(
                        request_id=rid,
                        conversation_id=rid,
                        tenant=key.tenant,
                        model=body.model,
                        messages=[ChatMessage(role="user", content=text)],
                        reply_partition=partition,
                        admitted_at=now,
                        screening="moderation",
                        tier=key.tier,
                    ),
                    key=rid,
                )
                for rid, text in zip(rids, texts, strict=True)
            )
        )
        verdicts = await asyncio.gather(*(_verdict(gw, s) for s in streams))
    except (OSError, TimeoutError) as exc:
        raise api.unavailable(f"Could not hand the input to the safety processor: {exc}") from None
    finally:
        for rid in rids:
            gw.fanout.unsubscribe(rid)
    if any(v is None for v in verdicts):
        raise api.APIError(
            504,
            f"The safety processor gave no verdict within {gw.cfg.progress_timeout_s:.0f}s. Please retry.",
            "server_error",
            code="timeout",
        )
    policy = verdicts[0].policy_version
    return {
        "id": new_item_id("modr"),
        "model": "tokenstream-safety" + (f":{policy}" if policy else ""),
        "results": [result(v) for v in verdicts],
    }


async def _verdict(gw: Gateway, stream) -> SafetyVerdict | None:
    deadline = time.monotonic() + gw.cfg.progress_timeout_s
    while (left := deadline - time.monotonic()) > 0:
        for event in await stream.take(left):
            if isinstance(event, SafetyVerdict) and event.stage == "input":
                return event
    return None
