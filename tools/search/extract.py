"""Text out of uploaded files (txt, md, pdf, html), and that text cut into overlapping chunks."""

from __future__ import annotations

import io
import re
from dataclasses import dataclass

from schemas.files import MEDIA_TYPES as KINDS
from schemas.files import file_kind

SENTENCE = re.compile(r"[^.!?\n]+(?:[.!?]+[\"')\]]*|$)")


class UnsupportedFile(ValueError):
    pass


@dataclass
class Document:
    text: str
    pages: int  # PDF pages, or 1


def kind_of(filename: str) -> str:
    kind = file_kind(filename)
    if kind is None:
        raise UnsupportedFile(f"{filename!r}: only {', '.join(sorted(KINDS))} files are searched")
    return kind


def extract(filename: str, data: bytes) -> Document:
    kind = kind_of(filename)
    if kind == "pdf":
        from pypdf import PdfReader

        try:
            reader = PdfReader(io.BytesIO(data))
            return Document("\n\n".join(page.extract_text() or "" for page in reader.pages), len(reader.pages))
        except Exception as exc:  # noqa: BLE001 - pypdf raises assorted errors on malformed files
            raise UnsupportedFile(f"{filename!r} is not a readable PDF: {exc}") from None
    text = data.decode("utf-8", errors="replace")
    if kind == "html":
        from tools.web import readable

        text = readable(text)
    return Document(text, 1)


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
