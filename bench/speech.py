"""`tokenstream bench speech`: voice through the log, each figure beside the model alone in this process.

One run against a throwaway Kafka and Redis, a real tool processor and a real gateway (the jobs go
gateway -> ts.speech.jobs -> tool processor -> ts.tokens -> gateway), the requests one at a time.

transcription  seconds from sending a recording (eSpeak NG reading a sentence, about 3 s of audio) to
               its whole JSON answer, as a real-time factor (seconds / seconds of audio), beside
               faster-whisper transcribing the same recordings here with the same settings (what
               the log, the gateway and the upload add)
speech         time to the first audio byte of a streamed mp3 of a multi-sentence text, and to its
               last byte, beside eSpeak NG + the encoder making the whole mp3 here (streaming means
               the first sentence plays while the rest is made)

Results go to bench/results/speech.json.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
import wave
from pathlib import Path

import typer

from bench.stats import nearest_rank

RESULTS = Path(__file__).parent / "results" / "speech.json"
SENTENCES = [
    "What time does the train to London leave tomorrow morning?",
    "Please send me the report before the meeting on Friday.",
    "The weather will be sunny and warm this afternoon.",
    "My favourite colour is blue and I like to read books.",
]
TEXT = (
    "Thank you for calling. The library opens early in the morning. It closes late in the evening. "
    "Books may be borrowed for three weeks. Please bring your card with you."
)


def main(
    rounds: int = typer.Option(5, help="times each recording and the speech text are sent"),
    out: Path = typer.Option(RESULTS, help="where the JSON results go"),
) -> None:
    """Transcription real-time factor and speech time to first byte through the log, beside the models
    alone."""
    result = asyncio.run(_run(rounds))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    _table(result)
    print(f"written to {out}")


def _recording(text: str) -> bytes:
    return subprocess.run(
        ["espeak-ng", "--stdout", "--", text], capture_output=True, check=True, timeout=60
    ).stdout


def _duration_s(wav: bytes) -> float:
    """Seconds of audio in a WAV file, from its header."""
    with wave.open(io.BytesIO(wav)) as w:
        return w.getnframes() / w.getframerate()


def _alone(recordings: list[bytes], rounds: int) -> tuple[list[float], list[float]]:
    """(transcription seconds per recording, whole-mp3 seconds per round), in this process."""
    from schemas import TranscribeParams
    from tools.speech.recognize import transcribe
    from tools.speech.voice import spoken

    heard = []
    for _ in range(rounds):
        for audio in recordings:
            started = time.perf_counter()
            list(transcribe(audio, TranscribeParams(language="en")).segments)
            heard.append(time.perf_counter() - started)
    made = []
    for _ in range(rounds):
        started = time.perf_counter()
        b"".join(part for _, part, _ in spoken(TEXT, "alloy", 1.0, "mp3"))
        made.append(time.perf_counter() - started)
    return heard, made


async def _run(rounds: int) -> dict:
    import httpx

    from tokenstream.stack.local import LocalSystem
    from tokenstream.stack.service import free_port
    from tools.speech.recognize import model

    recordings = [_recording(s) for s in SENTENCES]
    seconds = [_duration_s(r) for r in recordings]
    tmp = Path(tempfile.mkdtemp(prefix="bench-speech-"))
    async with LocalSystem(tmp, "smollm2", gateways={"speech": {}}, instances=0, workers=0) as system:
        port = free_port()
        system.add(
            "tools",
            "tools",
            "tools",
            "--health-port",
            str(port),
            probe=f"http://127.0.0.1:{port}/health/live",
        )
        await system.ready([system.procs["tools"]])
        url, headers = system.url("speech"), {"Authorization": f"Bearer {system.key}"}
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as http:
            for _ in range(60):  # the speech loop joins its group after the tools are warm
                answer = await http.post(
                    "/v1/audio/transcriptions",
                    data={"model": "whisper-1"},
                    files={"file": ("w.wav", recordings[0])},
                )
                if answer.status_code == 200:
                    break
                await asyncio.sleep(2)
            chain, first, last = [], [], []
            for i in range(rounds):
                for audio in recordings:
                    started = time.perf_counter()
                    answer = await http.post(
                        "/v1/audio/transcriptions",
                        data={"model": "whisper-1"},
                        files={"file": ("q.wav", audio)},
                    )
                    answer.raise_for_status()
                    chain.append(time.perf_counter() - started)
                started = time.perf_counter()
                async with http.stream(
                    "POST",
                    "/v1/audio/speech",
                    json={"model": "tts-1", "voice": "alloy", "input": TEXT, "response_format": "mp3"},
                ) as r:
                    got = None
                    async for _ in r.aiter_bytes():
                        got = got or time.perf_counter()
                    first.append(got - started)
                    last.append(time.perf_counter() - started)
                print(f"round {i + 1}/{rounds}", flush=True)
    model()  # loaded before timing the model alone
    heard, made = await asyncio.to_thread(_alone, recordings, rounds)
    rtf_chain = [c / seconds[i % len(seconds)] for i, c in enumerate(chain)]
    rtf_alone = [h / seconds[i % len(seconds)] for i, h in enumerate(heard)]

    def p(values, q):
        return round(nearest_rank(values, q), 3)

    return {
        "command": f"tokenstream bench speech --rounds {rounds}",
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_average_1m_at_end": round(os.getloadavg()[0], 2),
            "note": "the broker, Redis, the tool processor, the gateway and this client share this host",
        },
        "transcription": {
            "recording_s": round(statistics.mean(seconds), 2),
            "through_the_log_rtf": {"p50": p(rtf_chain, 50), "p90": p(rtf_chain, 90)},
            "model_alone_rtf": {"p50": p(rtf_alone, 50), "p90": p(rtf_alone, 90)},
            "ratio_p50": round(nearest_rank(rtf_chain, 50) / nearest_rank(rtf_alone, 50), 2),
        },
        "speech": {
            "text_chars": len(TEXT),
            "first_byte_s": {"p50": p(first, 50), "p90": p(first, 90)},
            "last_byte_s": {"p50": p(last, 50), "p90": p(last, 90)},
            "whole_mp3_alone_s": {"p50": p(made, 50), "p90": p(made, 90)},
            "first_byte_vs_whole_alone_p50": round(nearest_rank(first, 50) / nearest_rank(made, 50), 2),
        },
    }


def _table(r: dict) -> None:
    t, s = r["transcription"], r["speech"]
    print(f"transcription of {t['recording_s']} s recordings, real-time factor (lower is faster)")
    print(
        f"  through the log   p50 {t['through_the_log_rtf']['p50']:.3f}  "
        f"p90 {t['through_the_log_rtf']['p90']:.3f}"
    )
    print(f"  model alone       p50 {t['model_alone_rtf']['p50']:.3f}  p90 {t['model_alone_rtf']['p90']:.3f}")
    print(f"  ratio (p50)       {t['ratio_p50']:.2f}x")
    print(f"speech of {s['text_chars']} characters as mp3, seconds")
    print(f"  first byte        p50 {s['first_byte_s']['p50']:.3f}  p90 {s['first_byte_s']['p90']:.3f}")
    print(f"  last byte         p50 {s['last_byte_s']['p50']:.3f}  p90 {s['last_byte_s']['p90']:.3f}")
    print(
        f"  whole mp3 alone   p50 {s['whole_mp3_alone_s']['p50']:.3f}  "
        f"p90 {s['whole_mp3_alone_s']['p90']:.3f}"
    )
    print(f"  first byte / whole alone (p50) {s['first_byte_vs_whole_alone_p50']:.2f}x")
