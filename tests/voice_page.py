"""The chat page's voice mode in a real headless Chromium whose microphone plays a recorded question
(eSpeak NG's WAV as Chromium's fake capture device), against the whole chain: the recording is
transcribed by the tool processor's Whisper, sent as the turn, and the streamed answer spoken sentence
by sentence (eSpeak NG through /v1/audio/speech) while it still streams; Stop interrupts the speech."""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import wave
from pathlib import Path

from tests.gateway_support import Chromium, default_key
from tests.test_speech import spoken, wer

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
QUESTION = "Tell me a short story about a cat."
SILENCE_S = 3.0  # after the question: Chromium's fake microphone plays its file in a loop
LOG = "window.tokenstreamVoice.log"
STATUS = "document.getElementById('status').textContent"


def with_silence(wav: bytes, path: Path, seconds: float) -> float:
    """`wav` written to `path` with `seconds` of silence after it; returns the seconds of speech
    (eSpeak NG's header, written to a pipe, holds no length: the frames are read to the end)."""
    with wave.open(io.BytesIO(wav)) as w:
        params, frames = w.getparams(), w.readframes(2**31 - 1)
    with wave.open(str(path), "wb") as out:
        out.setparams(params)
        out.writeframes(frames + bytes(int(seconds * params.framerate) * params.sampwidth * params.nchannels))
    return len(frames) / (params.framerate * params.sampwidth * params.nchannels)


def kinds(log: list[dict], what: str) -> list[dict]:
    return [e for e in log if e["what"] == what]


async def voice_round_trip(gateway: str, tmp_path: Path, interrupt: bool = True) -> None:
    """Ask by voice and hear the answer; with `interrupt`, ask again and press stop while it is spoken."""
    recording = tmp_path / "question.wav"
    seconds = with_silence(spoken(QUESTION), recording, SILENCE_S)
    browser = Chromium(
        tmp_path / "profile",
        CHROMIUM,
        extra_args=(
            "--use-fake-ui-for-media-stream",
            "--use-fake-device-for-media-stream",
            f"--use-file-for-fake-audio-capture={recording}",
            "--autoplay-policy=no-user-gesture-required",
        ),
    )
    try:
        await asyncio.to_thread(browser.connect)

        async def js(expr: str):
            return await asyncio.to_thread(browser.js, expr)

        async def wait_for(expr: str, timeout: float = 60):
            try:
                return await asyncio.to_thread(browser.wait_for, expr, timeout)
            except TimeoutError:
                raise AssertionError(
                    f"{expr}: not within {timeout:.0f} s; the voice log: "
                    f"{await js(LOG)}; status: {await js(STATUS)}"
                ) from None

        async def hold_to_talk() -> None:
            """Press the button, hold it while the question plays into the microphone, release it."""
            count = len(kinds(await js(LOG), "recording"))
            await js("document.getElementById('talk').dispatchEvent(new PointerEvent('pointerdown'))")
            await wait_for(f"{LOG}.filter(e => e.what === 'recording').length > {count}", 20)
            await asyncio.sleep(seconds + 1.0)  # the user holds the button while speaking, then lets go
            await js("document.getElementById('talk').dispatchEvent(new PointerEvent('pointerup'))")

        await asyncio.to_thread(browser.call, "Page.enable")
        await asyncio.to_thread(browser.call, "Page.navigate", url=f"{gateway}/#key={default_key()}")
        await wait_for("document.body.dataset.state === 'idle' && document.getElementById('model').value")

        await hold_to_talk()
        await wait_for(f"{LOG}.some(e => e.what === 'play')", 180)
        speaking = tmp_path / "voice-mode.png"  # the transcribed question, the answer being spoken
        await asyncio.to_thread(browser.screenshot, speaking)
        await wait_for(f"{LOG}.some(e => e.what === 'answer-done')", 180)
        await wait_for(
            f"{LOG}.filter(e => e.what === 'played').length === {LOG}.filter(e => e.what === 'speak').length",
            120,
        )
        log = await js(LOG)
        [transcript] = kinds(log, "transcript")
        assert wer(QUESTION, transcript["text"]) < 0.2, transcript
        bubbles = await js("Array.from(document.querySelectorAll('.msg')).map(d => d.firstChild.data)")
        assert bubbles[0] == transcript["text"]  # the transcript was sent as the turn
        said = [e["text"] for e in kinds(log, "speak")]
        assert " ".join(" ".join(said).split()) == " ".join(bubbles[1].split())  # the whole answer spoken
        [done] = kinds(log, "answer-done")
        assert len(said) > 1 and kinds(log, "speak")[0]["t"] < done["t"], log  # speech began mid-answer
        assert [e["text"] for e in kinds(log, "played")] == said  # every sentence played, in order
        assert not kinds(log, "speech-failed"), log
        if os.environ.get("TOKENSTREAM_SCREENSHOTS"):  # the page in voice mode, for bench/results
            shutil.copy(speaking, Path(os.environ["TOKENSTREAM_SCREENSHOTS"]) / "voice-mode.png")

        if not interrupt:
            return
        # Stop while the answer is spoken: the sound stops and nothing more of it is said
        await hold_to_talk()
        await wait_for(f"{LOG}.filter(e => e.what === 'play').length > {len(kinds(log, 'play'))}", 180)
        await js("document.getElementById('stop').click()")
        await wait_for("document.body.dataset.state === 'idle'")
        assert await js("window.tokenstreamVoice.audio === null && !window.tokenstreamVoice.speaking")
        # a typed question (never spoken) answered to its end is the marker after which to look
        await js(
            f"document.getElementById('input').value = {json.dumps('Say hi.')};"
            "document.getElementById('send').click()"
        )
        await wait_for(
            "document.querySelectorAll('.assistant').length === 3 && document.body.dataset.state === 'idle'",
            120,
        )
        log = await js(LOG)
        stopped = kinds(log, "interrupted")[-1]["t"]
        assert not [e for e in log if e["t"] > stopped and e["what"] in ("speak", "play", "played")], log
    finally:
        browser.close()
