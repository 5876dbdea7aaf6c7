"""What a request streams: each sampled token through its grammar state, the detokenizer, stop strings
and max_tokens to text chunks and the end (shared by every backend: gpu_workers/engine.py and
gpu_workers/backend_vllm.py, so both stream the same text in the same chunks for the same tokens).

The stream interval (vLLM's `stream_interval`, in tokens and milliseconds; `Sequence.stream_interval`,
`Sequence.stream_interval_ms`). At each engine step a request's pending new text is written as ONE
chunk when

- it is the request's first text (the first this worker writes for it), or
- the request ends: pending text is always written before its Completion, on every finish path
  (stop, length, EOS, cancel, error), or
- at least `stream_interval` tokens are pending (generated since its last chunk), or
- at least `stream_interval_ms` milliseconds have passed since its last chunk was written
  (0: no time bound, tokens only).

Otherwise the text, its token ids and log probabilities stay pending (`seq.emitted_text`,
`seq.unsent_ids`, `seq.unsent_logprobs` go on accumulating) and go out together in the next chunk:
chunk numbers stay gap-free, and the chunks' text, token ids and log probabilities put end to end
are those of interval 1. A step's several tokens of one request (a vLLM output) are one chunk at most.

A class using `TextStream` provides `tokenizer`, `eos_ids`, `metrics` (or None) and
`_finish(seq, reason, outputs, error=None)`.
"""

from __future__ import annotations

from gpu_workers.grammar import advance
from gpu_workers.sequence import Output, Sequence
from gpu_workers.stops import StopMatcher

NO_STOPS = StopMatcher([])  # what may be streamed when no stop string applies: all but a split character


class TextStream:
    def _append(self, seq: Sequence, token: int, now: float, outputs: list[Output], reported=None) -> None:
        """A step's one sampled token of `seq`; `reported` is its gpu_workers.logits.Reported when the
        request asked for it."""
        self._arrived(seq, now)
        if not self._token(seq, token, outputs, reported):
            self._offer(seq, now, outputs)

    def _append_step(
        self, seq: Sequence, tokens: list[int], now: float, outputs: list[Output], reports=None
    ) -> int:
        """A step's several tokens of `seq` (`reports`: their Reported, or None), written as one chunk at
        most; returns how many were taken (fewer when one of them ended the request)."""
        if not tokens:
            return 0
        self._arrived(seq, now)
        for i, token in enumerate(tokens):
            if self._token(seq, token, outputs, reports[i] if reports is not None else None):
                return i + 1
        self._offer(seq, now, outputs)
        return len(tokens)

    def _arrived(self, seq: Sequence, now: float) -> None:
        if self.metrics is not None:
            self.metrics.latency(seq, now)
        if seq.first_token_at is None:
            seq.first_token_at = now
        seq.last_token_at = now

    def _token(self, seq: Sequence, token: int, outputs: list[Output], reported) -> bool:
        """One sampled token; True when it ended the request (its text written, then its end)."""
        advance(seq, token)  # grammar hook: the request's grammar state follows the sampled token
        if token in self.eos_ids:  # flush text held back for a stop string that never came
            self._emit(seq, self._final_text(seq), outputs)
            self._finish(seq, "stop", outputs)
            return True
        seq.generated.append(token)
        seq.unsent_ids.append(token)
        if reported is not None:
            seq.unsent_logprobs.append(reported)
        seq.text += seq.detok.add(token)
        if seq.matcher.stops:
            text = seq.text
            region = (
                text  # stop strings never apply inside what a grammar forces (a tool call, a JSON answer)
            )
            if seq.grammar is not None:
                region = seq.grammar.stop_region(text)
            at = seq.matcher.find(region, len(seq.emitted_text)) if region else None
            if at is not None:
                self._emit(seq, text[:at], outputs)
                self._finish(seq, "stop", outputs)
                return True
        if len(seq.generated) >= seq.max_tokens:
            self._emit(seq, self._final_text(seq), outputs)
            self._finish(seq, "length", outputs)
            return True
        return False

    def _offer(self, seq: Sequence, now: float, outputs: list[Output]) -> None:
        """The stream interval's rule at the end of a step (the module's docstring)."""
        last = seq.last_chunk_at
        if (
            last is None
            or len(seq.unsent_ids) >= seq.stream_interval
            or (seq.stream_interval_ms and (now - last) * 1000.0 >= seq.stream_interval_ms)
        ):
            self._emit(seq, self._ready_text(seq), outputs, now)

    def _ready_text(self, seq: Sequence) -> str:
        """The text that may be streamed now: all but what may still become a stop string (or an
        incomplete character), nothing while a grammar's free text may still open a call."""
        text = seq.text
        region = text
        if seq.matcher.stops and seq.grammar is not None:
            region = seq.grammar.stop_region(text)
        if region is None:  # free text or a call: not known yet, so nothing is streamed yet
            return ""
        return text[: (seq.matcher if region is text else NO_STOPS).safe_end(text)]

    def _final_text(self, seq: Sequence) -> str:
        """All the text: what the detokenizer completed plus any incomplete character at the end."""
        d = seq.detok
        if d is None or d.read_offset == len(d.ids):
            return seq.text
        return (
            seq.text
            + self.tokenizer.decode(d.ids[d.prefix_offset :], skip_special_tokens=True)[
                len(self.tokenizer.decode(d.ids[d.prefix_offset : d.read_offset], skip_special_tokens=True)) :
            ]
        )

    def _emit(self, seq: Sequence, upto: str, outputs: list[Output], now: float | None = None) -> None:
        n = len(seq.emitted_text)
        delta = upto[n:] if len(upto) > n and upto.startswith(seq.emitted_text) else ""
        if not delta:
            return
        seq.emitted_text += delta
        if now is not None:
            seq.last_chunk_at = now
        outputs.append(
            Output(
                seq,
                chunk_seq=seq.next_seq,
                text=delta,
                token_ids=seq.unsent_ids,
                logprobs=seq.unsent_logprobs,
            )
        )
        seq.unsent_ids, seq.unsent_logprobs = [], []
        seq.next_seq += 1

    def _completion(self, seq: Sequence, reason: str, outputs: list[Output], error: str | None) -> None:
        """The request's last output: its end, with the ids (and log probabilities) not yet sent. An end
        from outside the text (cancelled, an error) first writes the text pending under the stream
        interval (stop, EOS and length have written their final text already)."""
        if reason in ("cancelled", "error") and seq.unsent_ids and seq.detok is not None:
            self._emit(seq, self._ready_text(seq), outputs)
        outputs.append(
            Output(
                seq,
                finish_reason=reason,
                completion_seq=seq.next_seq,
                error=error,
                token_ids=seq.unsent_ids,
                logprobs=seq.unsent_logprobs,
            )
        )
        seq.unsent_ids, seq.unsent_logprobs = [], []
        seq.next_seq += 1
        if self.metrics is not None:
            self.metrics.finished(seq)
