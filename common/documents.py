"""Text out of files (txt, md, pdf, html): what the file search indexes (the tool processor's ingestion)
and what the model reads of an `input_file` (the gateway). pypdf reads PDFs, trafilatura the main
text of HTML."""

from __future__ import annotations

import io
from dataclasses import dataclass

from schemas.files import MEDIA_TYPES as KINDS
from schemas.files import file_kind


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
            return Document(
                "\n\n".join(page.extract_text() or "" for page in reader.pages), len(reader.pages)
            )
        except Exception as exc:  # noqa: BLE001 - pypdf raises assorted errors on malformed files
            raise UnsupportedFile(f"{filename!r} is not a readable PDF: {exc}") from None
    text = data.decode("utf-8", errors="replace")
    if kind == "html":
        text = readable(text)
    return Document(text, 1)


def readable(html: str, url: str = "") -> str:
    """The page's main text (trafilatura), or all its text when it finds no main part."""
    import trafilatura

    text = trafilatura.extract(
        html, url=url or None, include_comments=False, include_tables=True, favor_recall=True
    )
    if text:
        return text
    from lxml import html as lhtml

    try:
        return " ".join(lhtml.fromstring(html).text_content().split())
    except Exception:  # noqa: BLE001 - an empty or broken document has no text
        return ""
