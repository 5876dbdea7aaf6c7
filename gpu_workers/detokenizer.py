"""Incremental detokenisation: each new token costs a decode of a few tokens, not of the whole output.

The scheme vLLM and TGI use: decode the tokens since the last completed text with and without
the new one (`prefix_offset`..`read_offset` vs `prefix_offset`..end) and append the difference.
Decoding a short window rather than the lone token keeps the spacing rules of tokenizers that
strip a leading space or merge bytes (byte-level BPE: one character may span several tokens).
While the window's text ends in U+FFFD (an incomplete UTF-8 character) nothing is appended and
the window grows until the character is complete. The text equals `decode(all tokens)` for
byte-level BPE (`tests/test_detokenizer.py` checks it against full decodes of every prefix).

A fast tokenizer (its `backend_tokenizer` a `tokenizers.Tokenizer`, and no clean-up of spaces in
the transformers `decode` on top) runs the scheme in Rust: `tokenizers.decoders.DecodeStream` is the
same algorithm (it windows from the last completed text, withholds a text ending in U+FFFD), one call
per token. Any other tokenizer, and a stream whose text stops extending its window's text (the one
case where the two differ: DecodeStream refuses it, the window scheme appends the tail), decode the
windows here. Both keep `prefix_offset`/`read_offset` (gpu_workers/streaming.py reads them to flush
an incomplete character at the end).

Earlier ids (a takeover resuming a request) are fed one at a time at construction, as if streamed:
where the windows fall depends on every earlier token, so a resumed stream then has the windows, the
texts per token and the text of an uninterrupted one (`tests/test_detokenizer.py`, at every split).
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


def stream_backend(tokenizer) -> Tokenizer | None:
    """The `tokenizers.Tokenizer` whose own decode is `tokenizer.decode`, or None (decode in windows)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer) or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return backend


class Detokenizer:
    __slots__ = ("backend", "ids", "parts", "prefix_offset", "read_offset", "stream", "tokenizer")

    def __init__(self, tokenizer, ids: list[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.backend = stream_backend(tokenizer)
        self.stream = DecodeStream(skip_special_tokens=True) if self.backend is not None else None
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0
        self.parts: list[str] = []  # the text's pieces, joined when read (appending to a str copies it)
        for token in ids or ():
            self.add(token)

    @property
    def text(self) -> str:
        """The text completed so far."""
        if len(self.parts) > 1:
            self.parts[:] = ["".join(self.parts)]
        return self.parts[0] if self.parts else ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""

    def add(self, token: int) -> str:
        """Append one token; returns the text it completed (possibly "")."""
        self.ids.append(token)
        if self.stream is not None:
            try:
                new = self.stream.step(self.backend, token)
            except Exception:  # noqa: BLE001 - tokenizers' InvalidPrefix is a bare Exception
                # the text no longer extends its window's: windows are decoded here from now on
                self.stream = None
            else:
                if new is None:
                    return ""  # nothing visible yet (a special token, or an incomplete character)
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
                self.parts.append(new)
                return new
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        new = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.parts.append(new)
        return new
