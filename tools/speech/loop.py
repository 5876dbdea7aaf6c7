"""The speech loop of the tool processor: SpeechJob events on ts.speech.jobs -> results on ts.tokens.

Its own consumer group (`ts-speech`), beside the tool calls and ingestion in one process. Jobs of a
partition are done in order, each one's model work in a thread; every result is written as it is
made (a segment once recognised, a sentence's audio once spoken) to the job's reply partition of
ts.tokens, and the job's offset is committed once its last event is acknowledged. A processor that
dies mid-job leaves it to the next, which does it again from the start: the same events with the same
`seq`, which the gateway drops as duplicates. The recording is read from the durable store, where
the gateway put it; a job whose recording is gone (past its hour) ends with an error.
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis

from common import sealing
from common.config import settings
from producers import publish, start_consumer
from schemas import SpeechAudio, SpeechDone, SpeechJob, TranscriptDone, TranscriptSegment
from schemas.speech import Word
from tools.serial import ONE_AT_A_TIME, SerialConsumer
from topics import TOKENS
from topics.registry import SPEECH_GROUP, SPEECH_JOBS

log = logging.getLogger("tools.speech")
MAX_AUDIO_EVENT = 128 * 1024  # bytes of audio in one SpeechAudio (well under the broker's message limit)


class SpeechLoop(SerialConsumer):
    spec, group, log = SPEECH_JOBS, SPEECH_GROUP, log

    def __init__(self, redis_url: str | None = None) -> None:
        super().__init__()
        self.redis = aioredis.Redis.from_url(redis_url or settings().redis_url)

    async def _send(self, job: SpeechJob, event) -> asyncio.Future:
        return await publish(
            self.producer, TOKENS, event, key=job.request_id, partition=job.reply_partition, wait=False
        )

    def _ids(self, job: SpeechJob) -> dict:
        return {"request_id": job.request_id, "conversation_id": job.conversation_id, "tenant": job.tenant}

    async def transcribe(self, job: SpeechJob) -> str:
        from tools.speech.recognize import transcribe

        raw = await self.redis.get(job.audio_key) if job.audio_key else None
        audio = await sealing.unblocked(sealing.open_stored, raw)
        acks, seq, started = [], 0, time.monotonic()
        if audio is None:
            acks.append(
                await self._send(
                    job,
                    TranscriptDone(
                        **self._ids(job), seq=0, error="the recording is gone (kept an hour); send it again"
                    ),
                )
            )
            await asyncio.gather(*acks)
            return "failed: the recording is gone"
        loop = asyncio.get_running_loop()
        heard: asyncio.Queue = asyncio.Queue()

        def work():  # the model's thread: each segment to the loop as soon as it is recognised
            try:
                recording = transcribe(audio, job.transcribe)
                loop.call_soon_threadsafe(heard.put_nowait, ("start", recording))
                for segment in recording.segments:
                    loop.call_soon_threadsafe(heard.put_nowait, ("segment", segment))
                loop.call_soon_threadsafe(heard.put_nowait, ("end", None))
            except Exception as exc:  # noqa: BLE001 - the job ends with the reason
                loop.call_soon_threadsafe(heard.put_nowait, ("error", exc))

        thread = asyncio.create_task(asyncio.to_thread(work))
        recording, texts, error = None, [], None
        while True:
            what, value = await heard.get()
            if what == "start":
                recording = value
            elif what == "segment":
                texts.append(value.text)
                acks.append(
                    await self._send(
                        job,
                        TranscriptSegment(
                            **self._ids(job),
                            seq=seq,
                            start=value.start,
                            end=value.end,
                            text=value.text,
                            words=[Word(w, s, e) for w, s, e in value.words],
                            seek=value.seek,
                            tokens=value.tokens,
                            temperature=value.temperature,
                            avg_logprob=value.avg_logprob,
                            compression_ratio=value.compression_ratio,
                            no_speech_prob=value.no_speech_prob,
                        ),
                    )
                )
                seq += 1
            else:
                error = None if what == "end" else str(value)
                break
        await thread
        seconds = time.monotonic() - started
        acks.append(
            await self._send(
                job,
                TranscriptDone(
                    **self._ids(job),
                    seq=seq,
                    text="".join(texts).strip(),
                    error=error,
                    language=recording.language if recording else "",
                    seconds=seconds,
                    duration_s=recording.duration_s if recording else 0.0,
                ),
            )
        )
        await asyncio.gather(*acks)
        await self.redis.delete(job.audio_key)
        if error:
            return f"failed: {error}"
        return f"{seq} segments of {recording.duration_s:.1f} s in {seconds:.2f} s"

    async def speak(self, job: SpeechJob) -> str:
        from tools.speech.voice import RATE, spoken

        params = job.speak
        acks, seq, total, samples, error = [], 0, 0, 0, None
        made = spoken(params.text, params.voice, params.speed, params.format)
        while True:
            try:
                part = await asyncio.to_thread(next, made, None)
            except Exception as exc:  # noqa: BLE001 - eSpeak or the codec failed: the job ends with why
                error = f"{type(exc).__name__}: {exc}"
                break
            if part is None:
                break
            sentence, data, count = part
            samples += count
            for at in range(0, len(data), MAX_AUDIO_EVENT):
                acks.append(
                    await self._send(
                        job,
                        SpeechAudio(
                            **self._ids(job),
                            seq=seq,
                            audio=data[at : at + MAX_AUDIO_EVENT],
                            text=sentence if at == 0 else "",
                        ),
                    )
                )
                seq, total = seq + 1, total + len(data[at : at + MAX_AUDIO_EVENT])
        acks.append(
            await self._send(
                job,
                SpeechDone(
                    **self._ids(job), seq=seq, bytes_total=total, duration_s=samples / RATE, error=error
                ),
            )
        )
        await asyncio.gather(*acks)
        return (
            f"failed: {error}"
            if error
            else f"{total} bytes of {params.format}, {samples / RATE:.1f} s of speech"
        )

    async def handle(self, job: SpeechJob) -> str:
        return await (self.transcribe(job) if job.kind == "transcribe" else self.speak(job))

    async def subscribe(self):
        return await start_consumer(SPEECH_JOBS, group=SPEECH_GROUP, **ONE_AT_A_TIME)

    def describe(self, job: SpeechJob) -> str:
        return f"{job.kind} {job.request_id}"

    async def close(self) -> None:
        await super().close()
        await self.redis.aclose()
