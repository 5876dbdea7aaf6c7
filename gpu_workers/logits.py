"""What a request asks of the next-token logits besides temperature and top-p: penalties, a logit
bias, and the log probabilities it wants reported (both engines' rows; vLLM does its own).

    logits --token_logprobs--> reported log probabilities (the model's own distribution)
           --shape-----------> presence/frequency penalties and logit_bias, in place
           --mask_rows-------> grammar (gpu_workers/grammar.py) --sample--> token

Penalties follow OpenAI's definition: a token's logit loses `frequency_penalty` for each time it
appears in the answer so far and `presence_penalty` once if it appears at all; the prompt does not
count. The answer so far includes what a previous worker emitted before a takeover (`generated`
is restored), so a resumed request is penalised as the uninterrupted one was.

Reported log probabilities are those of the model's distribution before any of these changes
(vLLM's default, `raw_logprobs`): what the model thought, not what the sampler was told to do.
Only rows that ask for something cost anything: the rest of the batch is not touched.
"""

from __future__ import annotations

import torch

from schemas import TokenLogprob, TopLogprob

# One reported token: (token id, log probability, [(alternative id, its log probability), ...] most
# likely first)
Reported = tuple[int, float, list[tuple[int, float]]]


def shape(logits: torch.Tensor, seqs) -> None:
    """Apply each row's penalties and logit bias to `logits` ([len(seqs), V]) in place."""
    vocab = logits.shape[-1]
    for row, seq in enumerate(seqs):
        if (seq.presence_penalty or seq.frequency_penalty) and seq.generated:
            ids = torch.tensor(seq.generated, device=logits.device)
            counts = torch.bincount(ids[ids < vocab], minlength=vocab).to(logits.dtype)
            logits[row] -= seq.frequency_penalty * counts + seq.presence_penalty * (counts > 0).to(
                logits.dtype
            )
        if seq.logit_bias:
            ids = [t for t in seq.logit_bias if t < vocab]
            if ids:
                index = torch.tensor(ids, device=logits.device)
                bias = torch.tensor(
                    [seq.logit_bias[t] for t in ids], device=logits.device, dtype=logits.dtype
                )
                logits[row].index_add_(0, index, bias)


class Logprobs:
    """The log-softmax of the rows that asked for log probabilities, taken before `shape` changes them."""

    def __init__(self, logits: torch.Tensor, seqs) -> None:
        self.rows = {row: seq.logprobs for row, seq in enumerate(seqs) if seq.logprobs is not None}
        self.logp = None
        if self.rows:
            index = torch.tensor(list(self.rows), device=logits.device)
            self.logp = torch.log_softmax(logits[index].float(), dim=-1)
            self.position = {row: i for i, row in enumerate(self.rows)}

    def of(self, row: int, token: int) -> Reported | None:
        """The report for the token sampled in `row`, or None when that row asked for none."""
        k = self.rows.get(row)
        if k is None:
            return None
        logp = self.logp[self.position[row]]
        top: list[tuple[int, float]] = []
        if k:
            values, ids = torch.topk(logp, k)
            top = list(zip(ids.tolist(), values.tolist()))
        return token, float(logp[token]), top


class TokenTexts:
    """A token id's text and exact UTF-8 bytes, as OpenAI reports them beside a log probability.

    A byte-level BPE token can end inside a character: its text then shows U+FFFD, and its bytes are
    the token's own bytes (those of several tokens join into the character). Other tokenizers give
    the bytes of the decoded text."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, tuple[str, list[int]]] = {}
        self.byte_of = _byte_level_alphabet()

    def __call__(self, token: int) -> tuple[str, list[int]]:
        got = self.cache.get(token)
        if got is None:
            text = self.tokenizer.decode([token], skip_special_tokens=False)
            piece = self.tokenizer.convert_ids_to_tokens(token)
            if isinstance(piece, str) and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                raw = [int(piece[3:5], 16)]  # SentencePiece's byte fallback
            elif isinstance(piece, str) and piece and all(ch in self.byte_of for ch in piece):
                raw = [self.byte_of[ch] for ch in piece]
            else:
                raw = list(text.encode("utf-8"))
            got = self.cache[token] = (text, raw)
            if len(self.cache) > 200_000:
                self.cache.clear()
        return got

    def report(self, reported: list[Reported]) -> list[TokenLogprob]:
        """gpu_workers.logits.Reported entries -> schemas.TokenLogprob events."""
        out = []
        for token, logprob, top in reported:
            text, raw = self(token)
            alternatives = [
                TopLogprob(token=t, bytes=b, logprob=lp) for t, b, lp in ((*self(alt), lp) for alt, lp in top)
            ]
            out.append(TokenLogprob(token=text, bytes=raw, logprob=logprob, top_logprobs=alternatives))
        return out


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's character for each byte (GPT-2's table, which SmolLM2, Llama 3 and Qwen share):
    printable Latin-1 bytes stand for themselves, the other bytes for the characters from U+0100 on."""
    kept = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\u00a1"), ord("\u00ac") + 1),
        *range(ord("\u00ae"), ord("\u00ff") + 1),
    ]
    moved = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + i): b for i, b in enumerate(moved)}}
