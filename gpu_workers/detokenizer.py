"""Incremental detokenisation: each new token costs a decode of a few tokens, not of the whole output.

The scheme vLLM and TGI use: decode the tokens since the last completed text with and without
the new one (`prefix_offset`..`read_offset` vs `prefix_offset`..end) and append the difference.
Decoding a short window rather than the lone token keeps the spacing rules of tokenizers that
strip a leading space or merge bytes (byte-level BPE: one character may span several tokens).
While the window's text ends in U+FFFD (an incomplete UTF-8 character) nothing is appended and
the window grows until the character is complete. The text equals `decode(all tokens)` for
byte-level BPE (`tests/test_worker_engine.py` checks it against full decodes of every prefix).
"""

from __future__ import annotations

WINDOW = 5  # tokens of context decoded before the new ones when resuming


class Detokenizer:
    __slots__ = ("ids", "prefix_offset", "read_offset", "text", "tokenizer")

    def __init__(self, tokenizer, ids: list[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(ids or [])
        # resuming (takeover): the text so far is decoded once, then only windows
        self.read_offset = len(self.ids)
        self.text = self._decode(self.ids)
        while self.text.endswith("\ufffd") and self.read_offset > 0:  # a split character at the end
            self.read_offset -= 1
            self.text = self._decode(self.ids[: self.read_offset])
        self.prefix_offset = max(0, self.read_offset - WINDOW)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""

    def add(self, token: int) -> str:
        """Append one token; returns the text it completed (possibly "")."""
        self.ids.append(token)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # nothing visible yet (a special token, or an incomplete character)
        new = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += new
        return new
