"""Safety policy knobs, from TOKENSTREAM_SAFETY_* environment variables.

Examples:
    TOKENSTREAM_SAFETY_POLICY_VERSION=2026-11-29.1
    TOKENSTREAM_SAFETY_THRESHOLD=0.6                                  # every category
    TOKENSTREAM_SAFETY_THRESHOLDS='{"violence": 0.7, "illicit": 0.4}'  # per category (wins)
    TOKENSTREAM_SAFETY_CATEGORIES='["hate", "self-harm"]'              # judge only these
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DATA_DIR = Path(__file__).resolve().parent / "data"

# OpenAI moderation category names. The trained head may know more; only these are judged.
DEFAULT_CATEGORIES = ["harassment", "hate", "self-harm", "sexual", "violence", "illicit"]


@dataclass(frozen=True)
class Policy:
    """What counts as blocked: a category is flagged when its score >= its threshold."""

    version: str
    thresholds: dict[str, float]
    default_threshold: float = 0.5
    categories: tuple[str, ...] = field(default_factory=lambda: tuple(DEFAULT_CATEGORIES))

    def threshold(self, category: str) -> float:
        return self.thresholds.get(category, self.default_threshold)

    @classmethod
    def from_settings(cls, settings: SafetySettings | None = None) -> Policy:
        s = settings or safety_settings()
        return cls(
            version=s.policy_version,
            thresholds={c: s.thresholds.get(c, s.threshold) for c in s.categories},
            default_threshold=s.threshold,
            categories=tuple(s.categories),
        )


class SafetySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOKENSTREAM_SAFETY_", extra="ignore")

    policy_version: str = Field("safety-v1", min_length=1, description="stamped on every judgement")
    categories: list[str] = Field(default_factory=lambda: list(DEFAULT_CATEGORIES))
    threshold: float = Field(0.5, ge=0, description="threshold for categories not in `thresholds`")
    thresholds: dict[str, float] = Field(default_factory=dict, description="per-category thresholds")

    head_path: Path = Field(DATA_DIR / "head.safetensors", description="trained head weights")
    model_path: Path | None = Field(None, description="embedding model folder (default: bundled MiniLM)")
    chunk_tokens: int = Field(128, ge=16, le=512, description="tokens per scored chunk; longer texts split")
    chunk_overlap: int = Field(32, ge=0, description="tokens shared by consecutive chunks of a long text")
    sentence_units: bool = Field(True, description="also score each sentence of a multi-sentence text alone")
    batch_size: int = Field(32, ge=1, description="chunks per embedding forward pass")
    num_threads: int | None = Field(
        1,
        ge=1,
        description="torch CPU threads (None: torch's default, one per core). One: the classifier judges one "
        "short text at a time, where a second thread gains little (2-core host at load 10: 16 ms "
        "p50 with one, 13-22 ms with two), while two threads wait for each other at every "
        "operation and, on an oversubscribed host, took 1.4-1.6 s per judgement against "
        "67-88 ms for one (load 17-28)",
    )

    @field_validator("categories")
    @classmethod
    def _categories_unique(cls, v: list[str]) -> list[str]:
        if not v or len(set(v)) != len(v):
            raise ValueError("categories must be a non-empty list without repeats")
        return v

    @model_validator(mode="after")
    def _thresholds_known(self) -> SafetySettings:
        unknown = set(self.thresholds) - set(self.categories)
        if unknown:
            raise ValueError(f"thresholds for unknown categories: {sorted(unknown)}")
        if self.chunk_overlap >= self.chunk_tokens - 2:
            raise ValueError("chunk_overlap must be smaller than chunk_tokens - 2")
        return self


@lru_cache
def safety_settings() -> SafetySettings:
    return SafetySettings()
