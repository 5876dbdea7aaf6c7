"""Text to speech: eSpeak NG (Debian's package) speaks each sentence; PyAV encodes the samples as they
come, so the first sentence's audio leaves before the last is spoken.

Why eSpeak NG: it is a Debian package that runs anywhere with no model to fetch, and its voices are
clear enough that Whisper reads them back (tests/test_speech.py). Piper sounds more natural but has no
voice that ships inside a package reachable here.

Output: OpenAI's formats at 24 kHz mono (eSpeak's 22.05 kHz resampled): mp3, opus (in Ogg), aac
(ADTS), flac, wav (a header that announces an open length, then 16-bit samples: playable as it
streams) and pcm (raw 16-bit little-endian samples).
"""

from __future__ import annotations

import io
import re
import shutil
import struct
import subprocess
import wave
from collections.abc import Iterator

import numpy as np

from schemas.speech import VOICES

RATE = 24_000
_SENTENCE = re.compile(r"(?<=[.!?;:])\s+|\n+")
_CONTAINERS = {
    "mp3": ("mp3", "libmp3lame"),
    "opus": ("ogg", "libopus"),
    "aac": ("adts", "aac"),
    "flac": ("flac", "flac"),
}


def sentences(text: str) -> list[str]:
    return [s.strip() for s in _SENTENCE.split(text) if s.strip()]


def available() -> str | None:
    """Why speech cannot be made here, or None."""
    return None if shutil.which("espeak-ng") else "espeak-ng is not installed (apt-get install espeak-ng)"


def speak(sentence: str, voice: str, speed: float) -> np.ndarray:
    """One sentence as 16-bit samples at RATE Hz."""
    words_per_minute = max(80, min(450, round(175 * speed)))
    done = subprocess.run(
        [
            "espeak-ng",
            "--stdout",
            "-v",
            VOICES.get(voice, voice),
            "-s",
            str(words_per_minute),
            "--",
            sentence,
        ],
        capture_output=True,
        timeout=60,
        check=True,
    )
    with wave.open(io.BytesIO(done.stdout)) as w:
        rate, samples = w.getframerate(), np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    if rate != RATE and len(samples):
        at = np.linspace(0, len(samples) - 1, round(len(samples) * RATE / rate))
        samples = np.interp(at, np.arange(len(samples)), samples.astype(np.float32)).astype("<i2")
    return samples


class Encoder:
    """16-bit samples in, the bytes of `fmt` out, as soon as the codec gives them."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        self.started = False
        if fmt in _CONTAINERS:
            import av

            container, codec = _CONTAINERS[fmt]
            self.buffer = io.BytesIO()
            self.out = av.open(self.buffer, "w", format=container)
            self.stream = self.out.add_stream(codec, rate=RATE, layout="mono")
            self.read = 0

    def encode(self, samples: np.ndarray) -> bytes:
        if self.fmt == "pcm":
            return samples.astype("<i2").tobytes()
        if self.fmt == "wav":
            head = b"" if self.started else _wav_header()
            self.started = True
            return head + samples.astype("<i2").tobytes()
        import av

        frame = av.AudioFrame.from_ndarray(samples.astype("<i2").reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = RATE
        for packet in self.stream.encode(frame):
            self.out.mux(packet)
        return self._new_bytes()

    def close(self) -> bytes:
        if self.fmt not in _CONTAINERS:
            return b"" if self.started or self.fmt == "pcm" else _wav_header()
        for packet in self.stream.encode(None):
            self.out.mux(packet)
        self.out.close()
        return self._new_bytes()

    def _new_bytes(self) -> bytes:
        data = self.buffer.getvalue()
        new, self.read = data[self.read :], len(data)
        return new


def _wav_header() -> bytes:
    """A RIFF header whose sizes say "open" (0xFFFFFFFF): players read the samples as they stream."""
    return (
        b"RIFF"
        + struct.pack("<I", 0xFFFFFFFF)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, RATE, RATE * 2, 2, 16)
        + b"data"
        + struct.pack("<I", 0xFFFFFFFF)
    )


def spoken(text: str, voice: str, speed: float, fmt: str) -> Iterator[tuple[str, bytes, int]]:
    """(sentence, its encoded bytes, its sample count) for each sentence, then ("", the codec's tail, 0)."""
    encoder = Encoder(fmt)
    for sentence in sentences(text):
        samples = speak(sentence, voice, speed)
        yield sentence, encoder.encode(samples), len(samples)
    yield "", encoder.close(), 0
