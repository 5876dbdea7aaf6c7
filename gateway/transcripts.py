"""A transcript in the shapes OpenAI's `response_format` names: json, text, srt, vtt, verbose_json."""

from __future__ import annotations

import math
from typing import Any

from schemas import TranscriptDone, TranscriptSegment


def usage_of(done: TranscriptDone) -> dict[str, Any]:
    """What a transcription used, as OpenAI counts it for Whisper: seconds of audio."""
    return {"type": "duration", "seconds": math.ceil(done.duration_s)}


def _stamp(seconds: float, comma: bool) -> str:
    ms = round(seconds * 1000)
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{',' if comma else '.'}{ms:03d}"


def as_format(
    fmt: str, done: TranscriptDone, segments: list[TranscriptSegment], *, words: bool
) -> dict | str:
    """The body of a finished transcription: a dict for the JSON formats, text for the others."""
    if fmt == "text":
        return done.text + "\n"
    if fmt in ("srt", "vtt"):
        cues = [
            f"{i}\n{_stamp(s.start, True)} --> {_stamp(s.end, True)}\n{s.text.strip()}\n"
            if fmt == "srt"
            else f"{_stamp(s.start, False)} --> {_stamp(s.end, False)}\n{s.text.strip()}\n"
            for i, s in enumerate(segments, 1)
        ]
        return ("WEBVTT\n\n" if fmt == "vtt" else "") + "\n".join(cues)
    if fmt == "json":
        return {"text": done.text, "usage": usage_of(done)}
    body: dict[str, Any] = {
        "task": "transcribe",
        "language": "english" if done.language == "en" else done.language,
        "duration": done.duration_s,
        "text": done.text,
        "segments": [
            {
                "id": s.seq,
                "seek": s.seek,
                "start": s.start,
                "end": s.end,
                "text": s.text,
                "tokens": s.tokens,
                "temperature": s.temperature,
                "avg_logprob": s.avg_logprob,
                "compression_ratio": s.compression_ratio,
                "no_speech_prob": s.no_speech_prob,
            }
            for s in segments
        ],
        "usage": usage_of(done),
    }
    if words:
        body["words"] = [
            {"word": w.word.strip(), "start": w.start, "end": w.end} for s in segments for w in s.words
        ]
    return body
