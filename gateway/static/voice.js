"use strict";
// Voice mode of the chat page (index.html): hold the microphone button to talk. The recording goes
// to POST /v1/audio/transcriptions (Whisper, run by the tool processor) and its text is sent as the
// turn; the answer is spoken sentence by sentence through POST /v1/audio/speech while its tokens
// still stream, so speech starts before the answer ends. Stop, or talking again, interrupts both.
// The page tells this script what it streams with two DOM events: "ts:answer" ({text, done}) and
// "ts:stop". voice.log records what happened, with times, for tests and curious users.
const voice = { recorder: null, holding: false, chunks: [], speaking: false, said: 0, generation: 0,
                chain: Promise.resolve(), audio: null, controllers: [], pending: 0, log: [] };
window.tokenstreamVoice = voice;
const SPEECH_MODEL = "tts-1", TRANSCRIBE_MODEL = "whisper-1", MAX_SPOKEN = 4000;
// a piece to speak ends at . ! ? : ; followed by a space, at a line break, or at a comma once it is
// MIN_CLAUSE characters long (a long first sentence is not waited for to its end)
const PIECE_END = /[.!?:;,](?=\s)|\n/g, MIN_CLAUSE = 40;

function logVoice(what, extra) { voice.log.push(Object.assign({ what, t: performance.now() }, extra || {})); }

async function startTalking() {
  voice.holding = true;
  if (voice.recorder) return;
  if (state.busy) await stop();  // talking over the answer interrupts it
  silence();
  let stream;
  // the answer is silenced while the user talks, so no echo to cancel; the browser's noise suppression and
  // gain control change the voice in ways that cost the recogniser words
  const audio = { echoCancellation: false, noiseSuppression: false, autoGainControl: false };
  try { stream = await navigator.mediaDevices.getUserMedia({ audio }); }
  catch (e) { voice.holding = false; setState("idle", "no microphone: " + (e.message || e.name)); return; }
  const recorder = new MediaRecorder(stream, { audioBitsPerSecond: 128000 });
  voice.recorder = recorder; voice.chunks = [];
  recorder.ondataavailable = (e) => { if (e.data.size) voice.chunks.push(e.data); };
  recorder.start();
  $("talk").classList.add("listening");
  setState("listening", "listening\u2026 release to send");
  logVoice("recording");
  if (!voice.holding) stopTalking();  // released before the microphone opened
}

async function stopTalking() {
  voice.holding = false;
  const recorder = voice.recorder;
  if (!recorder) return;
  voice.recorder = null;
  $("talk").classList.remove("listening");
  const stopped = new Promise((ok) => { recorder.onstop = ok; });
  recorder.stop();
  await stopped;
  recorder.stream.getTracks().forEach((t) => t.stop());
  const recording = new Blob(voice.chunks, { type: recorder.mimeType || "audio/webm" });
  logVoice("recorded", { bytes: recording.size });
  setState("transcribing", "transcribing\u2026");
  const form = new FormData();
  form.append("file", recording, "question.webm");
  form.append("model", TRANSCRIBE_MODEL);
  let text = "";
  try {
    const r = await fetch("/v1/audio/transcriptions", { method: "POST", headers: auth(), body: form });
    if (!r.ok) throw new Error(await errorMessage(r));
    text = ((await r.json()).text || "").trim();
  } catch (e) { setState("idle", "transcription failed: " + (e.message || e)); return; }
  logVoice("transcript", { text });
  if (!text) { setState("idle", "heard nothing"); return; }
  voice.speaking = true; voice.said = 0;
  await send(text);
}

// The answer so far: every piece completed since the last call is spoken (all the rest at the end).
function speakAlong(text, done) {
  const rest = text.slice(voice.said);
  let cut = done ? rest.length : 0;
  for (const m of done ? [] : rest.matchAll(PIECE_END)) {
    const end = m.index + m[0].length;
    if (m[0] !== "," || end >= MIN_CLAUSE) cut = end;
  }
  if (cut <= 0) return;
  voice.said += cut;
  const sentence = rest.slice(0, cut).trim();
  if (sentence) say(sentence.slice(0, MAX_SPOKEN));
}

// Asks for the sentence's audio now and plays it after the sentences before it.
function say(sentence) {
  const controller = new AbortController();
  const generation = voice.generation;
  voice.controllers.push(controller);
  voice.pending += 1;
  $("stop").disabled = false;  // Stop silences what is still to be said, after the answer's end too
  logVoice("speak", { text: sentence });
  const audio = fetch("/v1/audio/speech", {
    method: "POST", signal: controller.signal, headers: auth({ "Content-Type": "application/json" }),
    body: JSON.stringify({ model: SPEECH_MODEL, input: sentence, voice: "alloy", response_format: "mp3" }),
  }).then((r) => (r.ok ? r.blob() : Promise.reject(new Error("speech: HTTP " + r.status))));
  audio.catch(() => {});  // an interrupted or failed sentence is skipped where it would play
  voice.chain = voice.chain.then(() => play(audio, sentence, generation));
}

async function play(audio, sentence, generation) {
  try { await playing(audio, sentence, generation); } finally {
    if (generation === voice.generation && --voice.pending === 0 && !state.busy) $("stop").disabled = true;
  }
}

async function playing(audio, sentence, generation) {
  let blob;
  try { blob = await audio; } catch (e) { if (generation === voice.generation) logVoice("speech-failed", { error: e.message }); return; }
  if (generation !== voice.generation) return;  // interrupted while it was made
  const url = URL.createObjectURL(blob);
  const player = new Audio(url);
  voice.audio = player;
  logVoice("play", { text: sentence });
  await new Promise((ok) => {
    player.onended = player.onerror = player.onpause = ok;
    player.play().catch(ok);
  });
  URL.revokeObjectURL(url);
  if (generation === voice.generation) logVoice("played", { text: sentence });
}

// Stops what is being spoken and everything still to be said.
function silence() {
  voice.generation += 1;
  voice.speaking = false;
  voice.controllers.forEach((c) => c.abort());
  voice.controllers = [];
  voice.pending = 0;
  if (voice.audio) voice.audio.pause();
  voice.audio = null;
  voice.chain = Promise.resolve();
}

document.addEventListener("ts:answer", (e) => {
  if (!voice.speaking) return;
  speakAlong(e.detail.text, e.detail.done);
  if (e.detail.done) { voice.speaking = false; logVoice("answer-done"); }
});
document.addEventListener("ts:stop", () => { if (voice.speaking || voice.audio) logVoice("interrupted"); silence(); });

const talk = $("talk");
talk.addEventListener("pointerdown", (e) => { e.preventDefault(); startTalking(); });
talk.addEventListener("pointerup", stopTalking);
talk.addEventListener("pointerleave", () => { if (voice.holding) stopTalking(); });
talk.addEventListener("keydown", (e) => { if ((e.key === " " || e.key === "Enter") && !e.repeat) { e.preventDefault(); startTalking(); } });
talk.addEventListener("keyup", (e) => { if (e.key === " " || e.key === "Enter") stopTalking(); });
if (!navigator.mediaDevices || !window.MediaRecorder) { talk.disabled = true; talk.title = "this browser cannot record"; }
