"""Conversation knobs, from TOKENSTREAM_CONVERSATION_* environment variables."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_PRESETS = Path(__file__).with_name("presets.json")


class ConversationSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOKENSTREAM_CONVERSATION_", extra="ignore")

    context_tokens: int = Field(8192, ge=64, description="context window of the served models, in tokens")
    context_tokens_by_model: dict[str, int] = Field(default_factory=dict, description="per-model windows")
    tokenizer_by_model: dict[str, str] = Field(
        default_factory=dict, description="model name -> name whose tokenizer counts its tokens "
                                          "(default: the model's own; unknown models use smollm2's)")
    presets_file: Path = Field(DEFAULT_PRESETS, description="JSON object: preset name -> preset")
    max_history_messages: int = Field(200, ge=2, description="turns kept per conversation in the table")
    pending_timeout_s: float = Field(120.0, gt=0, description="stop waiting for an answer after this long")

    def window_for(self, model: str) -> int:
        return self.context_tokens_by_model.get(model, self.context_tokens)
