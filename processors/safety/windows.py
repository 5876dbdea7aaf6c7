"""Sliding windows over a streaming answer: what the output check judges, and when (pure functions)."""

from __future__ import annotations

import msgspec
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas import OutputWindow, TokenChunk


class WindowSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOKENSTREAM_SAFETY_WINDOW_", extra="ignore")

    every_tokens: int = Field(
        32,
        ge=1,
        description="judge the window after this many new tokens (one judgement costs ~30-120 ms of CPU)",
    )
    overlap_chars: int = Field(
        200,
        ge=0,
        description="text kept from the last window, so a phrase cut at a boundary is still seen whole",
    )
    max_chars: int = Field(2000, ge=64, description="longest text held per answer")
    held_windows: int = Field(
        10_000, ge=1, description="windows held in memory; the least recently used is checkpointed and let go"
    )
    checkpoint_chunks: int = Field(
        256, ge=1, description="checkpoint a window holding this many chunks unacknowledged (safety/held.py)"
    )
    batch_records: int = Field(
        128,
        ge=1,
        description="records of ts.tokens handled as one batch, the windows due among them judged in one "
        "classifier call (safety/batch.py; 1: one record at a time)",
    )
    judge_piece: int = Field(
        4,
        ge=1,
        description="most windows in one classifier call: a request's input judgement waits for one such "
        "call at most (safety/turns.py)",
    )
    checkpoint_s: float = Field(
        2.0, gt=0, description="checkpoint a window whose oldest unacknowledged chunk is this old"
    )


def fold(window: OutputWindow, chunk: TokenChunk, cfg: WindowSettings) -> OutputWindow | None:
    """The window with `chunk` added; None when the chunk was folded in before (a replay)."""
    if chunk.seq <= window.last_seq:
        return None
    text = (window.text + chunk.text)[-cfg.max_chars :]
    return msgspec.structs.replace(
        window,
        text=text,
        last_seq=chunk.seq,
        pending_tokens=window.pending_tokens + max(1, len(chunk.token_ids)),
    )


def due(window: OutputWindow, cfg: WindowSettings, *, final: bool = False) -> bool:
    return (
        not window.blocked
        and window.pending_tokens > 0
        and (final or window.pending_tokens >= cfg.every_tokens)
    )


def judged(
    window: OutputWindow, cfg: WindowSettings, blocked: bool, scores: dict[str, float] | None = None
) -> OutputWindow:
    """After a judgement: keep only the overlap, remember a block and each category's highest score."""
    tail = window.text[-cfg.overlap_chars :] if cfg.overlap_chars else ""
    peak = {**window.peak, **{c: max(s, window.peak.get(c, 0.0)) for c, s in (scores or {}).items()}}
    return msgspec.structs.replace(window, text=tail, pending_tokens=0, blocked=blocked, peak=peak)
