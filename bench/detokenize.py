"""What incremental detokenisation costs the worker per token:
`python -m bench.detokenize [tokens] [length] [prime]`.

The text is real: this repository's README.md and docs/*.md, with a paragraph of accented, CJK and
emoji text every 4,000 characters, encoded with SmolLM2's tokenizer (byte-level BPE). The first
`tokens` ids (default 20,000) are fed one `Detokenizer.add` at a time, as gpu_workers/streaming.py
does, as requests of `length` tokens each (default 500; a new Detokenizer per request). Two columns on
the same ids: `stream`, the Detokenizer as the worker builds it (DecodeStream, in Rust), and `window`,
the same class on a tokenizer that hides its Rust backend (the fallback: two decodes per token from
Python). Microseconds per token, best of 3 alternating runs (the machine is shared); then a takeover's
construction with `prime` earlier ids (default 1,000), median of 5. Checks every request's text
against a full decode of its ids.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIXED = "\nGrüße aus Köln — 東京タワーと日本語のテキスト, 北京欢迎你 🚀🎉👩‍💻 naïve café ½ → ∑ done.\n"


def corpus() -> str:
    parts = [(ROOT / "README.md").read_text(), *(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))]
    text = "".join(parts)
    return "".join(text[i : i + 4000] + MIXED for i in range(0, len(text), 4000))


class WindowOnly:
    """A tokenizer with only `decode`: the Detokenizer decodes windows from Python."""

    def __init__(self, tokenizer) -> None:
        self.decode = tokenizer.decode


def run(tok, requests: list[list[int]]) -> float:
    from gpu_workers.detokenizer import Detokenizer

    started = time.perf_counter()
    for ids in requests:
        d = Detokenizer(tok)
        add = d.add
        for t in ids:
            add(t)
    return time.perf_counter() - started


def main(tokens: int = 20_000, length: int = 500, prime: int = 1_000) -> None:
    from common.models import load_tokenizer
    from gpu_workers.detokenizer import Detokenizer

    tok = load_tokenizer("smollm2")
    ids = tok(corpus())["input_ids"][:tokens]
    requests = [ids[i : i + length] for i in range(0, len(ids), length)]
    for r in requests:  # a request may end inside a character: it waits, the full decode shows U+FFFD
        text, full = Detokenizer(tok, r).text, tok.decode(r, skip_special_tokens=True)
        assert full.startswith(text) and (full == text or full.endswith("\ufffd")), (
            "differs from a full decode"
        )
    columns: dict[str, list[float]] = {"stream": [], "window": []}
    for _ in range(3):
        columns["stream"].append(run(tok, requests))
        columns["window"].append(run(WindowOnly(tok), requests))
    primes = []
    for _ in range(5):
        started = time.perf_counter()
        Detokenizer(tok, ids[:prime])
        primes.append(time.perf_counter() - started)
    print(f"{len(ids)} tokens as {len(requests)} requests of {length}:")
    for name, runs in columns.items():
        each = ", ".join(f"{r * 1e3:.0f}" for r in runs)
        print(f"  {name:6} {min(runs) / len(ids) * 1e6:6.2f} us/token (runs {each} ms)")
    print(f"takeover with {prime} earlier ids: {statistics.median(primes) * 1e3:.2f} ms (median of 5)")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]))
