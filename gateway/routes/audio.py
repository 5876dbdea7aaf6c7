"""/v1/audio: transcriptions (speech to text) and speech (text to speech), as jobs on the log.

The gateway checks the request, keeps a recording in the durable store for the tool processor,
writes a `SpeechJob` to ts.speech.jobs and answers from the results the tool processor writes to
this instance's partition of ts.tokens (schemas/speech.py): one body, or a stream as they come.
Every field of OpenAI's requests is honoured or a 400 naming it; `translations` is refused (the
model transcribes English only).
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.datastructures import UploadFile

from common import sealing
from gateway import openai_api as api
from gateway.auth import principal
from gateway.deps import pipeline
from gateway.file_objects import multipart_form
from gateway.pipeline import Gateway
from gateway.resume import new_request_id
from gateway.transcripts import as_format, usage_of
from producers import publish
from schemas import (
    SpeakParams,
    SpeechAudio,
    SpeechDone,
    SpeechJob,
    TranscribeParams,
    TranscriptDone,
    TranscriptSegment,
)
from schemas import keys as K
from schemas.keys import ApiKey
from schemas.speech import (
    AUDIO_FORMATS,
    MAX_SPEECH_CHARS,
    MODEL_ALIASES,
    SPEAK_MODEL,
    TRANSCRIBE_MODEL,
    VOICES,
)
from topics import SPEECH_JOBS

router = APIRouter(prefix="/v1/audio", dependencies=[Depends(principal)])
TEXT_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
MEDIA = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}
RECORDING_TTL_S = 3600


def _model(name: str, serves: str) -> str:
    if MODEL_ALIASES.get(name, name) != serves:
        raise api.model_not_found(name)
    return name


async def _job(gw: Gateway, job: SpeechJob) -> AsyncIterator:
    """Write `job` and yield its result events in seq order, duplicates dropped, until its end."""
    if gw.fanout is None or gw.producer is None:
        raise api.unavailable("The gateway is not connected to the pipeline yet.")
    stream = gw.fanout.subscribe(job.request_id)
    try:
        await asyncio.wait_for(publish(gw.producer, SPEECH_JOBS, job), timeout=10)
    except Exception as exc:  # noqa: BLE001
        gw.fanout.unsubscribe(job.request_id)
        raise api.unavailable(
            f"Could not hand the job to the pipeline: {exc or type(exc).__name__}"
        ) from None

    async def results():
        next_seq = 0
        try:
            while True:
                batch = await stream.take(gw.cfg.progress_timeout_s)
                if not batch:
                    yield None  # no progress within the deadline
                    return
                for event in batch:
                    if getattr(event, "seq", -1) < next_seq:
                        continue  # a job done again after its processor died: seen already
                    next_seq = event.seq + 1
                    yield event
                    if isinstance(event, TranscriptDone | SpeechDone):
                        return
        finally:
            gw.fanout.unsubscribe(job.request_id)

    return results()


def _timeout(gw: Gateway) -> api.APIError:
    return api.APIError(
        504,
        f"The speech job made no progress for {gw.cfg.progress_timeout_s:.0f}s. Please retry.",
        "server_error",
        code="timeout",
    )


# ------------------------------------------------------------------------------ transcriptions

TRANSCRIBE_FIELDS = {
    "file",
    "model",
    "language",
    "prompt",
    "response_format",
    "temperature",
    "stream",
    "timestamp_granularities[]",
    "timestamp_granularities",
    "include[]",
    "include",
    "chunking_strategy",
    "known_speaker_names[]",
    "known_speaker_references[]",
}


async def _form(request: Request, max_bytes: int) -> tuple[dict[str, list], bytes, str]:
    form = await multipart_form(request, "the recording with the fields `file` and `model`", 16, 4096)
    try:
        fields: dict[str, list] = {}
        for name, value in form.multi_items():
            fields.setdefault(name, []).append(value)
        upload = (fields.get("file") or [None])[0]
        if not isinstance(upload, UploadFile):
            raise api.invalid_request(
                "`file` is required: the recording, a file part of the multipart body.", param="file"
            )
        data = await upload.read(max_bytes + 1)
        filename = upload.filename or "audio"
    finally:
        await form.close()
    if not data:
        raise api.APIError(
            400, "The file is empty.", "invalid_request_error", param="file", code="empty_file"
        )
    if len(data) > max_bytes:
        raise api.APIError(
            413,
            f"The file has {len(data):,} bytes; the limit is {max_bytes:,}.",
            "invalid_request_error",
            param="file",
            code="file_too_large",
        )
    return fields, data, filename


def _one(fields: dict[str, list], name: str, default: str | None = None) -> str | None:
    values = fields.get(name)
    if not values:
        return default
    if len(values) > 1 or not isinstance(values[0], str):
        raise api.invalid_request(f"`{name}` must be given once, as text.", param=name)
    return values[0]


def _transcribe_params(fields: dict[str, list]) -> tuple[TranscribeParams, str, bool]:
    unknown = sorted(set(fields) - TRANSCRIBE_FIELDS)
    if unknown:
        raise api.invalid_request(f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0])
    for name, why in (
        ("include[]", "log probabilities of a transcript are not offered"),
        ("include", "log probabilities of a transcript are not offered"),
        ("chunking_strategy", "the recording is read in Whisper's own 30 s windows"),
        ("known_speaker_names[]", "speaker diarization is not offered"),
        ("known_speaker_references[]", "speaker diarization is not offered"),
    ):
        if fields.get(name):
            raise api.invalid_request(f"`{name}` is not supported: {why}.", param=name)
    model = _one(fields, "model")
    if not model:
        raise api.invalid_request("`model` is required.", param="model")
    _model(model, TRANSCRIBE_MODEL)
    fmt = _one(fields, "response_format", "json")
    if fmt not in TEXT_FORMATS:
        raise api.invalid_request(
            f"response_format must be one of {', '.join(TEXT_FORMATS)}.", param="response_format"
        )
    language = _one(fields, "language")
    if language not in (None, "", "en"):
        raise api.invalid_request(
            f"language {language!r} is not served: the model transcribes English (en) only.", param="language"
        )
    try:
        temperature = float(_one(fields, "temperature", "0"))
    except ValueError:
        raise api.invalid_request("temperature must be a number.", param="temperature") from None
    if not 0 <= temperature <= 1:
        raise api.invalid_request("temperature must be from 0 to 1.", param="temperature")
    prompt = _one(fields, "prompt", "") or ""
    if len(prompt) > 2000:
        raise api.invalid_request("prompt holds at most 2000 characters.", param="prompt")
    granularities = [*fields.get("timestamp_granularities[]", []), *fields.get("timestamp_granularities", [])]
    if any(g not in ("segment", "word") for g in granularities):
        raise api.invalid_request(
            "timestamp_granularities may hold `segment` and `word`.", param="timestamp_granularities[]"
        )
    if granularities and fmt != "verbose_json":
        raise api.invalid_request(
            "timestamp_granularities needs response_format verbose_json.", param="timestamp_granularities[]"
        )
    stream = (_one(fields, "stream", "false") or "false").lower()
    if stream not in ("true", "false"):
        raise api.invalid_request("stream must be true or false.", param="stream")
    if stream == "true" and fmt not in ("json", "text"):
        raise api.invalid_request(
            "A streamed transcript comes as transcript.text events: response_format must be json or text.",
            param="response_format",
        )
    params = TranscribeParams(
        language="en", prompt=prompt, temperature=temperature, word_timestamps="word" in granularities
    )
    return params, fmt, stream == "true"


@router.post("/transcriptions")
async def transcriptions(request: Request, gw: Gateway = Depends(pipeline), key: ApiKey = Depends(principal)):
    if gw.files_redis is None:
        raise api.unavailable("Recordings cannot be kept for transcription: the gateway has no Redis.")
    fields, data, filename = await _form(request, gw.cfg.audio_max_bytes)
    params, fmt, stream = _transcribe_params(fields)
    partition, created_at = gw.reply_partition(), time.time()
    rid = new_request_id(partition, created_at)
    await gw.limiter.take(key, 0, rid)
    sealed = await sealing.unblocked(sealing.seal_stored, key.tenant, rid, data)
    await gw.files_redis.set(K.speech_audio(rid), sealed, ex=RECORDING_TTL_S)
    job = SpeechJob(
        request_id=rid,
        conversation_id=rid,
        tenant=key.tenant,
        created_at=created_at,
        kind="transcribe",
        model=TRANSCRIBE_MODEL,
        reply_partition=partition,
        audio_key=K.speech_audio(rid),
        filename=filename[:255],
        transcribe=params,
    )
    results = await _job(gw, job)
    if stream:
        return StreamingResponse(
            _transcript_events(gw, results),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    segments: list[TranscriptSegment] = []
    async for event in results:
        if event is None:
            raise _timeout(gw)
        if isinstance(event, TranscriptSegment):
            segments.append(event)
        elif isinstance(event, TranscriptDone):
            if event.error:
                raise api.APIError(
                    400,
                    f"The recording could not be transcribed: {event.error}",
                    "invalid_request_error",
                    param="file",
                    code="invalid_file",
                )
            body = as_format(fmt, event, segments, words=params.word_timestamps)
            return PlainTextResponse(body) if isinstance(body, str) else body
    raise _timeout(gw)


async def _transcript_events(gw: Gateway, results) -> AsyncIterator[bytes]:
    """OpenAI's transcription stream: transcript.text.delta per segment, then transcript.text.done."""
    async for event in results:
        if event is None:
            body = {"type": "error", "error": _timeout(gw).message}
        elif isinstance(event, TranscriptSegment):
            body = {"type": "transcript.text.delta", "delta": event.text, "logprobs": None}
        elif event.error:
            body = {"type": "error", "error": f"The recording could not be transcribed: {event.error}"}
        else:
            body = {
                "type": "transcript.text.done",
                "text": event.text,
                "logprobs": None,
                "usage": usage_of(event),
            }
        yield f"data: {json.dumps(body)}\n\n".encode()


@router.post("/translations")
async def translations() -> None:
    raise api.APIError(
        400,
        f"Translations are not offered: {TRANSCRIBE_MODEL} transcribes English only; use "
        "/v1/audio/transcriptions.",
        "invalid_request_error",
        param="model",
        code="unsupported_endpoint",
    )


# ------------------------------------------------------------------------------------ speech


class SpeechRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=api.MAX_NAME_CHARS)
    input: str = Field(min_length=1, max_length=MAX_SPEECH_CHARS)
    voice: str | dict = "alloy"
    response_format: str = "mp3"
    speed: float = Field(1.0, ge=0.25, le=4.0)
    stream_format: str = "audio"
    instructions: str | None = None


@router.post("/speech")
async def speech(body: SpeechRequest, gw: Gateway = Depends(pipeline), key: ApiKey = Depends(principal)):
    _model(body.model, SPEAK_MODEL)
    if body.instructions:
        raise api.invalid_request(
            "instructions are not supported: eSpeak NG speaks as its voice does; choose voice and speed.",
            param="instructions",
        )
    if not isinstance(body.voice, str) or body.voice not in VOICES:
        raise api.invalid_request(f"voice must be one of {', '.join(VOICES)}.", param="voice")
    if body.response_format not in AUDIO_FORMATS:
        raise api.invalid_request(
            f"response_format must be one of {', '.join(AUDIO_FORMATS)}.", param="response_format"
        )
    if body.stream_format not in ("audio", "sse"):
        raise api.invalid_request("stream_format must be audio or sse.", param="stream_format")
    partition, created_at = gw.reply_partition(), time.time()
    rid = new_request_id(partition, created_at)
    await gw.limiter.take(key, 0, rid)
    job = SpeechJob(
        request_id=rid,
        conversation_id=rid,
        tenant=key.tenant,
        created_at=created_at,
        kind="speak",
        model=SPEAK_MODEL,
        reply_partition=partition,
        speak=SpeakParams(text=body.input, voice=body.voice, speed=body.speed, format=body.response_format),
    )
    results = await _job(gw, job)
    first = await anext(results)  # the first result, so a failure before any audio is an HTTP error
    if first is None:
        raise _timeout(gw)
    if isinstance(first, SpeechDone) and first.error:
        raise api.APIError(500, f"Speech failed: {first.error}", "server_error", code="speech_error")
    media = "text/event-stream" if body.stream_format == "sse" else MEDIA[body.response_format]
    return StreamingResponse(
        _audio(first, results, body.stream_format == "sse"),
        media_type=media,
        headers={"x-tokenstream-request-id": rid, "Cache-Control": "no-cache"},
    )


async def _audio(first, results, sse: bool) -> AsyncIterator[bytes]:
    """The audio bytes as they are made, or OpenAI's speech.audio.delta / speech.audio.done events."""

    async def events():
        yield first
        async for event in results:
            yield event

    async for event in events():
        if event is None:
            return  # no progress: the body ends short (a client sees a truncated file)
        if isinstance(event, SpeechAudio):
            if sse:
                body = {"type": "speech.audio.delta", "audio": base64.b64encode(event.audio).decode()}
                yield f"data: {json.dumps(body)}\n\n".encode()
            else:
                yield event.audio
        elif sse:
            body = {"type": "error", "error": event.error} if event.error else {"type": "speech.audio.done"}
            yield f"data: {json.dumps(body)}\n\n".encode()
