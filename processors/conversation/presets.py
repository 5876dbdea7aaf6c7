"""Assistant presets (like custom GPTs): a named system prompt with model and sampling settings."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import msgspec

from schemas import ChatMessage, SamplingParams


class Preset(msgspec.Struct, kw_only=True):
    system: str
    model: str | None = None
    sampling: dict[str, object] = msgspec.field(default_factory=dict)


@lru_cache(maxsize=4)
def load_presets(path: Path) -> dict[str, Preset]:
    return msgspec.convert(json.loads(Path(path).read_text()), dict[str, Preset])


def apply_preset(preset: Preset, messages: list[ChatMessage], model: str,
                 sampling: SamplingParams) -> tuple[list[ChatMessage], str, SamplingParams]:
    """The preset's system prompt replaces any other; its model and sampling settings win."""
    turns = [m for m in messages if m.role != "system"]
    merged = msgspec.structs.replace(sampling, **preset.sampling) if preset.sampling else sampling
    return [ChatMessage(role="system", content=preset.system), *turns], preset.model or model, merged
