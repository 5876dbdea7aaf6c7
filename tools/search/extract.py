"""Uploaded files' text (common/documents.py) cut into overlapping chunks for the search index."""

from __future__ import annotations

import re

from common.documents import Document, UnsupportedFile, extract, kind_of  # noqa: F401 - the search's readers

SENTENCE = re.compile(r"[^.!?\n]+(?:[.!?]+[\"')\]]*|$)")


def chunks(text: str, max_words: int = 90, overlap_sentences: int = 1) -> list[str]:
    """Sentences packed into chunks of at most ~max_words, each starting with the last
    `overlap_sentences` of the one before (a fact cut at a boundary is whole in one of them).
    A paragraph break always ends a chunk."""
    out: list[str] = []
    for paragraph in re.split(r"\n\s*\n", text):
        sentences = [s.strip() for s in SENTENCE.findall(" ".join(paragraph.split())) if s.strip()]
        current: list[str] = []
        for sentence in sentences:
            words = sum(len(s.split()) for s in current) + len(sentence.split())
            if current and words > max_words:
                out.append(" ".join(current))
                current = current[-overlap_sentences:] if overlap_sentences else []
            current.append(sentence)
        if current:
            out.append(" ".join(current))
    return [c for c in out if c]
