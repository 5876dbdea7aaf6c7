"""Voice: speech to text and text to speech as jobs on the log, like every other step.

    client --audio--> gateway --SpeechJob--> ts.speech.jobs --> tool processor (speech loop)
          <--SSE/body-- gateway <--TranscriptSegment*, TranscriptDone | SpeechAudio*, SpeechDone-- ts.tokens

The gateway keeps an uploaded recording in the durable store (`schemas.keys.speech_audio`, an hour)
and names it in the job; the tool processor transcribes it (or speaks the job's text) and writes
the results in band to the request's tokens partition, keyed by the request id, numbered by `seq`
without gaps like a TokenChunk: the gateway streams them as they come, a client that reconnects
resumes from the log, and an auditor reads every transcript and every spoken text there.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import msgspec

from schemas.base import Event

#: What the speech loop serves: the transcription model and the voices of the speech model.
TRANSCRIBE_MODEL = "whisper-tiny.en"
SPEAK_MODEL = "espeak-ng"
#: OpenAI's model names, served by the models above (clients hard-code them).
MODEL_ALIASES = {"whisper-1": TRANSCRIBE_MODEL, "tts-1": SPEAK_MODEL, "tts-1-hd": SPEAK_MODEL}
#: OpenAI's voices, each an eSpeak NG voice of its own (American English with a variant).
VOICES = {
    "alloy": "en-us+m3",
    "ash": "en-us+m1",
    "ballad": "en-us+m5",
    "coral": "en-us+f2",
    "echo": "en-us+m2",
    "fable": "en-gb+m3",
    "nova": "en-us+f3",
    "onyx": "en-us+m7",
    "sage": "en-us+f4",
    "shimmer": "en-us+f1",
    "verse": "en-us+m4",
    "marin": "en-us+f5",
    "cedar": "en-us+m6",
}
AUDIO_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
MAX_SPEECH_CHARS = 4096
MAX_AUDIO_BYTES = 25 * 1024 * 1024  # OpenAI's upload limit


class TranscribeParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    language: str | None = None  # ISO 639-1; None: detected
    prompt: str = ""  # text the model continues from (names, spelling)
    temperature: float = 0.0
    word_timestamps: bool = False


class SpeakParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    text: str
    voice: str = "alloy"
    speed: float = 1.0
    format: str = "mp3"


class SpeechJob(Event, tag="speech_job"):
    """Written by the gateway to ts.speech.jobs, keyed by request id: transcribe the recording the
    durable store holds under `audio_key`, or speak `speak.text`. Results go to `reply_partition`
    of ts.tokens."""

    content: ClassVar[frozenset[str]] = frozenset(
        {"filename", "transcribe", "speak"}
    )  # sealed (schemas/sealing.py)

    kind: Literal["transcribe", "speak"]
    model: str
    reply_partition: int
    audio_key: str = ""
    filename: str = ""
    transcribe: TranscribeParams | None = None
    speak: SpeakParams | None = None


class Word(msgspec.Struct, array_like=True):
    word: str
    start: float
    end: float


class TranscriptSegment(Event, tag="transcript_segment"):
    """One recognised stretch of speech, in order (seq from 0)."""

    content: ClassVar[frozenset[str]] = frozenset({"text", "words", "tokens"})  # sealed (schemas/sealing.py)

    seq: int
    start: float
    end: float
    text: str
    words: list[Word] = msgspec.field(default_factory=list)
    # the model's own figures for the segment (OpenAI's verbose_json repeats them)
    seek: int = 0
    tokens: list[int] = msgspec.field(default_factory=list)
    temperature: float = 0.0
    avg_logprob: float = 0.0
    compression_ratio: float = 0.0
    no_speech_prob: float = 0.0


class TranscriptDone(Event, tag="transcript_done"):
    """The end of a transcription: seq follows the last segment; `error` set when it failed."""

    content: ClassVar[frozenset[str]] = frozenset({"text", "error"})  # sealed (schemas/sealing.py)

    seq: int
    text: str = ""
    language: str = ""
    duration_s: float = 0.0  # of the recording
    seconds: float = 0.0  # the model's run (real-time factor = seconds / duration_s)
    error: str | None = None


class SpeechAudio(Event, tag="speech_audio"):
    """The next bytes of the spoken answer in the job's format, in order (seq from 0)."""

    content: ClassVar[frozenset[str]] = frozenset({"audio", "text"})  # sealed (schemas/sealing.py)

    seq: int
    audio: bytes
    text: str = ""  # the sentence these bytes begin to speak, if they begin one


class SpeechDone(Event, tag="speech_done"):
    """The end of a speech job: seq follows the last audio chunk; `error` set when it failed."""

    content: ClassVar[frozenset[str]] = frozenset({"error"})  # sealed (schemas/sealing.py)

    seq: int
    bytes_total: int = 0
    duration_s: float = 0.0  # of the audio made
    error: str | None = None
