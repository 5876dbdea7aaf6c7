"""What a request streams: each sampled token through its grammar state, the detokenizer, stop strings
and max_tokens to text chunks and the end (shared by every backend: gpu_workers/engine.py and
gpu_workers/backend_vllm.py, so both stream the same text in the same chunks for the same tokens).

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
        """One sampled token; `reported` is its gpu_workers.logits.Reported when the request asked for it."""
        advance(seq, token)  # grammar hook: the request's grammar state follows the sampled token
        if self.metrics is not None:
            self.metrics.token(seq, now)
        if seq.first_token_at is None:
            seq.first_token_at = now
        seq.last_token_at = now
        if token in self.eos_ids:  # flush text held back for a stop string that never came
            self._emit(seq, self._final_text(seq), outputs)
            self._finish(seq, "stop", outputs)
            return
        seq.generated.append(token)
        seq.unsent_ids.append(token)
        if reported is not None:
            seq.unsent_logprobs.append(reported)
        seq.text += seq.detok.add(token)
        text = seq.text
        region = text  # stop strings never apply inside what a grammar forces (a tool call, a JSON answer)
        if seq.matcher.stops and seq.grammar is not None:
            region = seq.grammar.stop_region(text)
        at = seq.matcher.find(region, len(seq.emitted_text)) if seq.matcher.stops and region else None
        if at is not None:
            self._emit(seq, text[:at], outputs)
            self._finish(seq, "stop", outputs)
            return
        done = len(seq.generated) >= seq.max_tokens
        if region is None:  # free text or a call: not known yet, so nothing is streamed yet
            safe = 0
        else:
            safe = (seq.matcher if region is text else NO_STOPS).safe_end(text)
        self._emit(seq, self._final_text(seq) if done else text[:safe], outputs)
        if done:
            self._finish(seq, "length", outputs)

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

    def _emit(self, seq: Sequence, upto: str, outputs: list[Output]) -> None:
        n = len(seq.emitted_text)
        delta = upto[n:] if len(upto) > n and upto.startswith(seq.emitted_text) else ""
        if not delta:
            return
        seq.emitted_text += delta
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
        """The request's last output: its end, with the ids (and log probabilities) not yet sent."""
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
