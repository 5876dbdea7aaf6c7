"""Safety classifier benchmark: quality on the held-out eval set and the latency safety adds.

    tokenstream bench safety [--iterations 100] [--threads N]

Quality: per category precision, recall and false-positive rate of the trained classifier on
safety_model/data/eval.jsonl, beside a keyword baseline (a small fixed word list per
category, below) scored in the same run on the same lines. Latency: p50/p99 of judging one
request's input (one eval line, as the safety processor judges the newest user message), one
~64-token output window, and one long (~300-token) input. Writes bench/results/safety.json.
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import typer

RESULTS = Path(__file__).resolve().parent / "results" / "safety.json"
EVAL = Path(__file__).resolve().parent.parent / "processors" / "safety" / "data" / "eval.jsonl"

# The baseline: what a quick keyword filter would block. Fixed before the eval set was scored;
# whole words or phrases, case-insensitive.
BASELINE_WORDS: dict[str, list[str]] = {
    "harassment": [
        "idiot",
        "moron",
        "loser",
        "stupid",
        "worthless",
        "pathetic",
        "ugly",
        "shut up",
        "nobody likes you",
        "everyone hates you",
        "bully",
        "humiliate",
    ],
    "hate": [
        "inferior",
        "subhuman",
        "vermin",
        "parasites",
        "savages",
        "primitive",
        "degenerate",
        "filthy",
        "go back to",
        "race",
        "abomination",
    ],
    "self-harm": [
        "kill myself",
        "suicide",
        "end my life",
        "end it all",
        "cut myself",
        "cutting",
        "overdose",
        "want to die",
        "self harm",
        "hang myself",
        "noose",
    ],
    "sexual": [
        "sex",
        "sexy",
        "sexual",
        "explicit",
        "erotic",
        "erotica",
        "naked",
        "nude",
        "porn",
        "orgasm",
        "horny",
        "dirty",
    ],
    "violence": [
        "kill",
        "murder",
        "stab",
        "shoot",
        "bomb",
        "torture",
        "beat",
        "hurt",
        "blood",
        "strangle",
        "poison",
        "attack",
    ],
    "illicit": [
        "hack",
        "steal",
        "meth",
        "cocaine",
        "counterfeit",
        "launder",
        "fraud",
        "scam",
        "phishing",
        "fake id",
        "shoplift",
        "drugs",
        "malware",
    ],
}


class KeywordBaseline:
    def __init__(self, words: dict[str, list[str]] = BASELINE_WORDS):
        self.patterns = {
            c: re.compile(r"\b(?:" + "|".join(map(re.escape, ws)) + r")\b", re.IGNORECASE)
            for c, ws in words.items()
        }

    def flagged(self, text: str) -> list[str]:
        return [c for c, p in self.patterns.items() if p.search(text)]


def read_eval(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def confusion(examples: list[dict], predicted: list[list[str]], categories: list[str]) -> dict[str, dict]:
    """Per category (and "any": blocked vs. labelled unsafe) counts, precision, recall, FPR."""
    out = {}
    for c in [*categories, "any"]:
        truth = [bool(e["labels"]) if c == "any" else c in e["labels"] for e in examples]
        pred = [bool(p) if c == "any" else c in p for p in predicted]
        tp = sum(t and p for t, p in zip(truth, pred))
        fp = sum(p and not t for t, p in zip(truth, pred))
        fn = sum(t and not p for t, p in zip(truth, pred))
        neg = sum(not t for t in truth)
        out[c] = {
            "positives": tp + fn,
            "negatives": neg,
            "tp": tp,
            "fp": fp,
            "fn": fn,
            "precision": tp / (tp + fp) if tp + fp else None,
            "recall": tp / (tp + fn) if tp + fn else None,
            "fpr": fp / neg if neg else None,
        }
    return out


def percentiles_ms(samples_s: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples_s)
    q = statistics.quantiles(ms, n=100, method="inclusive")
    return {
        "p50": round(q[49], 3),
        "p99": round(q[98], 3),
        "mean": round(statistics.fmean(ms), 3),
        "n": len(ms),
    }


def time_each(fn: Callable[[str], object], texts: list[str], iterations: int, warmup: int = 5) -> list[float]:
    for i in range(warmup):
        fn(texts[i % len(texts)])
    samples = []
    for i in range(iterations):
        t0 = time.perf_counter()
        fn(texts[i % len(texts)])
        samples.append(time.perf_counter() - t0)
    return samples


def windows_of(texts: list[str], tokenizer, tokens: int) -> list[str]:
    """Answer-like texts of about `tokens` tokens: consecutive eval lines joined, cut at a token."""
    out, buf = [], ""
    for t in texts:
        buf = f"{buf} {t}".strip()
        enc = tokenizer(buf, add_special_tokens=False, return_offsets_mapping=True)
        if len(enc["input_ids"]) >= tokens:
            out.append(buf[: enc["offset_mapping"][tokens - 1][1]])
            buf = ""
    return out


def fmt(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def main(
    iterations: Annotated[int, typer.Option(help="timed calls per latency case")] = 100,
    threads: Annotated[int | None, typer.Option(help="torch CPU threads (default: torch's choice)")] = None,
    eval_path: Annotated[Path, typer.Option("--eval", help="held-out JSONL set")] = EVAL,
    out: Annotated[Path, typer.Option(help="where to write the JSON results")] = RESULTS,
) -> None:
    """Safety classifier vs. a keyword baseline on the held-out set, and its latency per request."""
    import torch
    from rich.console import Console
    from rich.table import Table

    from safety_model.classifier import SafetyClassifier
    from safety_model.config import safety_settings

    console = Console()
    if threads:
        torch.set_num_threads(threads)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    clf = SafetyClassifier.load()
    load_s = time.perf_counter() - t0
    baseline = KeywordBaseline()
    cats = clf.categories
    examples = read_eval(eval_path)
    texts = [e["text"] for e in examples]
    console.print(
        f"loaded classifier in {load_s:.1f}s; {len(examples)} eval lines, policy "
        f"{clf.policy.version}, torch threads {torch.get_num_threads()}"
    )

    t0 = time.perf_counter()
    judgements = clf.judge(texts)
    batch_s = time.perf_counter() - t0
    model_q = confusion(examples, [j.categories for j in judgements], cats)
    base_q = confusion(examples, [baseline.flagged(t) for t in texts], cats)

    table = Table(
        title=f"Safety on the held-out set ({eval_path.name}, {len(examples)} lines): "
        "precision / recall / false-positive rate"
    )
    for col in ("category", "unsafe / safe", "classifier", "keyword baseline"):
        table.add_column(col, justify="left" if col == "category" else "right")
    for c in [*cats, "any"]:
        m, b = model_q[c], base_q[c]
        table.add_row(
            "any category" if c == "any" else c,
            f"{m['positives']} / {m['negatives']}",
            " / ".join(fmt(m[k]) for k in ("precision", "recall", "fpr")),
            " / ".join(fmt(b[k]) for k in ("precision", "recall", "fpr")),
        )
    console.print(table)

    tokenizer = clf.embedder.tokenizer
    safe_texts = [e["text"] for e in examples if not e["labels"]]
    windows = windows_of(texts, tokenizer, 64)
    long_inputs = windows_of(safe_texts + texts, tokenizer, 300)
    cases = {
        "input: one eval line": texts,
        "output window, 64 tokens": windows,
        "long input, 300 tokens": long_inputs,
    }
    latency = {}
    lat = Table(title=f"Latency safety adds per call, ms ({iterations} calls each, CPU)")
    for col in ("case", "tokens", "classifier p50 / p99", "keywords p50 / p99"):
        lat.add_column(col, justify="left" if col == "case" else "right")
    for name, items in cases.items():
        with console.status(f"timing {name}"):
            model_t = percentiles_ms(time_each(lambda t: clf.judge([t]), items, iterations))
            base_t = percentiles_ms(time_each(baseline.flagged, items, iterations))
        tokens = statistics.fmean(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in items)
        latency[name] = {
            "texts": len(items),
            "mean_tokens": round(tokens, 1),
            "classifier": model_t,
            "keywords": base_t,
        }
        lat.add_row(
            name,
            f"{tokens:.0f}",
            f"{model_t['p50']:.1f} / {model_t['p99']:.1f}",
            f"{base_t['p50']:.3f} / {base_t['p99']:.3f}",
        )
    console.print(lat)
    console.print(f"whole eval set judged in one batch: {batch_s:.2f}s ({len(texts) / batch_s:.0f} lines/s)")
    load_after = os.getloadavg()
    console.print(
        f"load average before/after: {load_before[0]:.1f} / {load_after[0]:.1f} "
        f"on {os.cpu_count()} CPUs (latency is sensitive to other work on the machine)"
    )

    s = safety_settings()
    result = {
        "benchmark": "safety",
        "command": "tokenstream bench safety"
        + (f" --iterations {iterations}" if iterations != 100 else "")
        + (f" --threads {threads}" if threads else ""),
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(),
            "load_average_before": load_before[0],
            "load_average_after": load_after[0],
        },
        "policy": {"version": clf.policy.version, "thresholds": {c: clf.policy.threshold(c) for c in cats}},
        "settings": {
            "chunk_tokens": s.chunk_tokens,
            "chunk_overlap": s.chunk_overlap,
            "sentence_units": s.sentence_units,
        },
        "head": {k: clf.head.metadata.get(k) for k in ("trained_at", "train_sha256", "train_examples")},
        "eval": {
            "file": str(eval_path.name),
            "lines": len(examples),
            "unsafe_lines": sum(1 for e in examples if e["labels"]),
        },
        "quality": {"classifier": model_q, "keywords": base_q},
        "baseline_words": BASELINE_WORDS,
        "latency_ms": latency,
        "batch": {"lines": len(texts), "seconds": round(batch_s, 3)},
        "classifier_load_s": round(load_s, 2),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(out)
    console.print(f"wrote {out}")


if __name__ == "__main__":
    typer.run(main)
