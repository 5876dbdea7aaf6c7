"""Applying an assistant preset (defined in common.presets, shared with the gateway)."""

from __future__ import annotations

import msgspec

from common.presets import Preset, load_presets, presets
from schemas import ChatMessage, SamplingParams

__all__ = ["Preset", "apply_preset", "load_presets", "presets"]


def apply_preset(
    preset: Preset, messages: list[ChatMessage], model: str, sampling: SamplingParams
) -> tuple[list[ChatMessage], str, SamplingParams]:
    """The preset's system prompt replaces any other; its model and sampling settings win."""
    turns = [m for m in messages if m.role != "system"]
    merged = msgspec.structs.replace(sampling, **preset.sampling) if preset.sampling else sampling
    return [ChatMessage(role="system", content=preset.system), *turns], preset.model or model, merged
